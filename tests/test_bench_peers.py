"""bench/peers.py's TRL-free parts (``bench/_peers.py``): the tool TRL calls renders as this project's
``CODE_TOOL``, a TRL completion is scored and labelled as a trajectory is, and the TRL config keywords
match the job's ``Config`` (every TRL default that differs set). No TRL needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from transformers.utils import get_json_schema

import _peers
from retool.config import load_config


def test_tool_schema_is_code_tool_byte_for_byte() -> None:
    seen: list[str] = []
    tool = _peers.code_interpreter_tool(lambda code: seen.append(code) or "4\n")
    assert tool.__name__ == "code_interpreter"
    assert _peers.tool_schema_matches(get_json_schema(tool))
    assert tool(code="print(2+2)") == "4\n" and seen == ["print(2+2)"]


def _call(code: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": code}}}


@pytest.mark.parametrize(
    ("messages", "ended", "stop"),
    [
        ([{"role": "assistant", "content": "\\boxed{4}"}], True, "answer"),
        ([{"role": "assistant", "content": "so the answer is"}], False, "context_full"),
        (  # a call whose result would not fit: TRL drops it and ends the completion
            [{"role": "assistant", "content": "", "tool_calls": [_call("print(1)")]}],
            True,
            "context_full",
        ),
        (  # two calls run, a third one made: past the budget
            [
                {"role": "assistant", "content": "", "tool_calls": [_call("a")]},
                {"role": "tool", "content": "1"},
                {"role": "assistant", "content": "", "tool_calls": [_call("b")]},
                {"role": "tool", "content": "2"},
                {"role": "assistant", "content": "", "tool_calls": [_call("c")]},
            ],
            True,
            "max_code_calls",
        ),
        (
            [
                {"role": "assistant", "content": "", "tool_calls": [_call("a")]},
                {"role": "tool", "content": "4"},
                {"role": "assistant", "content": "\\boxed{4}"},
            ],
            True,
            "answer",
        ),
    ],
)
def test_trl_stop_reason_and_reward(messages: list[dict[str, object]], ended: bool, stop: str) -> None:
    assert _peers.trl_stop_reason(messages, ended, max_code_calls=2) == stop
    checked: list[str] = []

    def score(text: str) -> float:
        checked.append(text)
        return 1.0 if "\\boxed{4}" in text else -1.0

    reward = _peers.trl_reward(messages, ended, 2, score)
    # Only an answer is checked by the verifier, on the last assistant turn's text; every other end is -1.
    assert reward == (1.0 if stop == "answer" else -1.0)
    assert checked == (["\\boxed{4}"] if stop == "answer" else [])


def test_tool_calls_counted_per_call() -> None:
    msgs = [{"role": "assistant", "content": "", "tool_calls": [_call("a"), _call("b")]}, {"role": "tool"}]
    assert _peers.trl_tool_calls(msgs) == 2


def test_trl_args_match_the_job() -> None:
    cfg = load_config("demo-smollm2")
    a = _peers.trl_grpo_args(cfg, completion_budget=256, steps=3)
    r, o = cfg.rollout, cfg.optimizer
    # One generation of questions x group per optimizer step, one group per micro-batch.
    assert a["per_device_train_batch_size"] * a["steps_per_generation"] == r.questions_per_step * r.group_size
    assert a["gradient_accumulation_steps"] == a["steps_per_generation"] == r.questions_per_step
    assert a["num_generations"] == r.group_size
    assert a["max_tool_calling_iterations"] == r.max_code_calls
    assert a["max_completion_length"] == 256
    assert (a["learning_rate"], a["adam_beta1"], a["adam_beta2"]) == (o.lr, o.beta1, o.beta2)
    assert a["max_grad_norm"] == o.grad_clip_norm and a["weight_decay"] == o.weight_decay
    # PPO clip: ratio thresholds 0.8 / 1.28 are TRL's epsilons 0.2 / 0.28.
    assert a["epsilon"] == pytest.approx(1 - cfg.loss.clip_low)
    assert a["epsilon_high"] == pytest.approx(cfg.loss.clip_high - 1)
    # TRL's defaults that differ, set to this project's.
    assert a["gradient_checkpointing"] is False and a["bf16"] is False
    assert a["loss_type"] == "grpo" and a["scale_rewards"] == "none"
    assert a["lr_scheduler_type"] == "constant" and a["warmup_steps"] == 0
    assert a["beta"] == 0.0 and a["num_iterations"] == 1 and a["shuffle_dataset"] is False


def test_trl_args_refuse_another_loss() -> None:
    cfg = load_config("demo-smollm2", ["loss.name=cispo"])
    with pytest.raises(ValueError, match="ppo"):
        _peers.trl_grpo_args(cfg, 256, 3)


def test_retool_overrides_budget_and_decomposition() -> None:
    cfg = load_config("demo-smollm2")
    sets = _peers.retool_overrides(cfg, completion_budget=256, prompt_tokens=290)
    assert "rollout.max_trajectory_tokens=546" in sets
    assert "rollout.max_tokens_per_turn=128" in sets
    # Each arm against retool-rl over the steps both ran: no-prefix ran one step only.
    rows = _peers.decompose({"retool": [10.0, 20.0], "trl": [35.0, 70.0], "no-prefix": [12.0]})
    assert rows == [("retool", 2, 15.0, 1.0), ("trl", 2, 52.5, 3.5), ("no-prefix", 1, 12.0, 1.2)]


def _run(seed: int, sft: float, trl: float, retool: float, heldout: int = 48) -> dict[str, object]:
    args = {"steps": 3, "completion_tokens": 160, "threads": 2, "heldout": heldout, "task": "synthetic"}
    acc = {m: {"average_at_n": v} for m, v in (("sft", sft), ("trl", trl), ("retool", retool))}
    records = {"trl": [{"wall_s": 60.0}, {"wall_s": 66.0}], "retool": [{"wall_s": 12.0}, {"wall_s": 10.0}]}
    return {"args": {**args, "seed": seed}, "accuracy": acc, "records": records}


def test_learning_over_seeds_gains_and_step_ratio() -> None:
    text = _peers.learning_over_seeds([_run(1, 0.10, 0.20, 0.15), _run(0, 0.10, 0.15, 0.20)])
    rows = [line for line in text.splitlines() if line.startswith("| 0") or line.startswith("| 1")]
    assert rows[0] == "| 0 | 10.0% | 15.0% | 20.0% | +5.0 | +10.0 |"  # sorted by seed
    assert "TRL +7.5 (sd 3.5), retool-rl +7.5 (sd 3.5) points" in text
    assert "TRL 63.0 s, retool-rl 11.0 s (5.73x)" in text


def test_learning_over_seeds_refuses_other_jobs_and_repeated_seeds() -> None:
    with pytest.raises(ValueError, match="not the same job"):
        _peers.learning_over_seeds([_run(0, 0.1, 0.2, 0.2), _run(1, 0.1, 0.2, 0.2, heldout=8)])
    with pytest.raises(ValueError, match="share a seed"):
        _peers.learning_over_seeds([_run(0, 0.1, 0.2, 0.2), _run(0, 0.1, 0.2, 0.2)])
    no_eval = {**_run(2, 0.1, 0.2, 0.2), "accuracy": {}}
    with pytest.raises(ValueError, match="no held-out accuracy"):
        _peers.learning_over_seeds([no_eval])
