"""The parts of ``bench/peers.py`` that need no TRL: the job both trainers run, said once.

- ``code_interpreter_tool``: the tool TRL calls, a Python function whose JSON schema (what
  ``transformers.utils.get_json_schema`` reads from its signature and docstring, and the chat template
  renders into the system prompt) is this project's ``CODE_TOOL``, byte for byte;
- ``trl_stop_reason`` / ``trl_reward``: a TRL completion (its messages) scored as this project scores a
  trajectory: only one that ended with an answer is checked by the verifier, every other end is -1;
- ``trl_grpo_args`` / ``retool_overrides``: one ``Config`` turned into TRL's ``GRPOConfig`` keywords and
  this project's ``--set`` overrides, every TRL default that differs set to match;
- ``decompose`` and the markdown table of the result.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from retool.config import Config
from retool.protocol.prompts import CODE_TOOL

# What cannot be made equal between the two, said in the table.
UNREMOVABLE = (
    "TRL has one completion budget for all turns plus tool output (`max_completion_length`); retool-rl "
    "has a per-turn budget as well, and its trajectory budget counts the prompt (set to prompt + the "
    "same completion budget, to the longest prompt of the step)",
    "TRL regenerates each tool round as a new `generate` over the rows that called, re-reading the whole "
    "history, all rows in step; retool-rl continues each trajectory on its own from its cached prefix",
    "TRL trains every group, all-equal ones included (zero advantage, but they count in the loss mean and "
    "their tokens run forward and backward); retool-rl skips them and, with dynamic sampling, draws "
    "replacement groups (one extra round at most)",
    "TRL's old-policy logprobs are the trainer's own (one update per batch: ratio 1); retool-rl's are the "
    "sampler's (ratio ~1, within 1e-4)",
)


def code_interpreter_tool(run: Callable[[str], str]) -> Callable[[str], Any]:
    """The ``code_interpreter`` tool as TRL wants it: a function of the call's arguments returning the
    observation text (``run(code)``: the sandbox's output fitted to the observation budget)."""

    # No return annotation: transformers would add a "return" key to the schema, and so to the prompt.
    def code_interpreter(code: str):
        """Run Python code and return printed output. Each execution starts fresh.

        Args:
            code: Python code to run; print what you want to see.
        """
        return run(code)

    return code_interpreter


def tool_schema_matches(schema: Mapping[str, Any]) -> bool:
    """``schema`` (as TRL / transformers build it from the tool function) renders as ``CODE_TOOL`` does:
    the same keys in the same order (the template's ``tojson`` keeps the order)."""
    import json  # deferred: only this check needs it

    return json.dumps(schema) == json.dumps(CODE_TOOL)


def _assistant_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [m for m in messages if m.get("role", "assistant") == "assistant"]


def trl_tool_calls(messages: Sequence[Mapping[str, Any]]) -> int:
    """Tool calls a TRL completion made (each assistant message's ``tool_calls``)."""
    return sum(len(m.get("tool_calls") or []) for m in _assistant_messages(messages))


def trl_stop_reason(messages: Sequence[Mapping[str, Any]], ended: bool, max_code_calls: int) -> str:
    """Why a TRL completion ended, in this project's names: ``answer`` (a turn without a call, closed by
    the end-of-turn token), ``max_code_calls`` (a call past the budget, not run), ``context_full`` (the
    completion budget ran out mid-turn, or a tool result was dropped because it would not fit)."""
    turns = _assistant_messages(messages)
    last = turns[-1] if turns else {}
    if last.get("tool_calls"):
        executed = trl_tool_calls(messages) - len(last["tool_calls"])
        return "max_code_calls" if executed >= max_code_calls else "context_full"
    return "answer" if ended else "context_full"


def trl_final_text(messages: Sequence[Mapping[str, Any]]) -> str:
    turns = _assistant_messages(messages)
    return str(turns[-1].get("content") or "") if turns else ""


def trl_reward(
    messages: Sequence[Mapping[str, Any]], ended: bool, max_code_calls: int, score: Callable[[str], float]
) -> float:
    """The chapter's reward of a TRL completion: ``score(final text)`` (+1 / -1 by the verifier) if it
    ended with an answer, else -1."""
    if trl_stop_reason(messages, ended, max_code_calls) != "answer":
        return -1.0
    return float(score(trl_final_text(messages)))


def trl_grpo_args(cfg: Config, completion_budget: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """``GRPOConfig`` keywords for the job ``cfg`` describes, every TRL default that differs set to this
    project's value (the notes: gradient checkpointing on, bf16, lr 1e-6 with decay, ``dapo`` loss,
    rewards scaled by the group's std)."""
    r, o, loss = cfg.rollout, cfg.optimizer, cfg.loss
    if loss.name != "ppo":
        raise ValueError(f"the peer bench compares the ppo loss, not {loss.name!r}")
    return {
        # One generation of questions x group per optimizer step, trained one group per micro-batch (the
        # memory of 16 full sequences at once would be ~10 GB in fp32); the "grpo" loss averages the
        # micro-batches, so the gradient is the mean over all 16, as in one batch.
        "per_device_train_batch_size": r.group_size,
        "gradient_accumulation_steps": r.questions_per_step,
        "num_generations": r.group_size,
        "steps_per_generation": r.questions_per_step,
        "num_iterations": 1,  # one update per batch, as retool-rl
        "max_completion_length": completion_budget,
        "max_tool_calling_iterations": r.max_code_calls,
        "temperature": cfg.sampling.temperature,
        "top_p": cfg.sampling.top_p,
        "top_k": 0 if cfg.sampling.top_k < 0 else cfg.sampling.top_k,
        "learning_rate": o.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_beta1": o.beta1,
        "adam_beta2": o.beta2,
        "adam_epsilon": o.eps,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.grad_clip_norm,
        "loss_type": "grpo",  # per-sequence token mean, then the mean over sequences (retool-rl's reduction)
        "scale_rewards": "none",  # A = R - mean(R), no std
        "epsilon": 1.0 - loss.clip_low,  # PPO clip: ratio thresholds as epsilons
        "epsilon_high": loss.clip_high - 1.0,
        "beta": 0.0,  # no KL term, no reference model
        "mask_truncated_completions": False,  # retool-rl trains truncated trajectories too
        "gradient_checkpointing": False,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "disable_dropout": True,
        "shuffle_dataset": False,  # the dataset is already in retool-rl's order
        "max_steps": steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": seed,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
    }


def retool_overrides(cfg: Config, completion_budget: int, prompt_tokens: int) -> list[str]:
    """``--set`` overrides of the retool-rl arm: its trajectory budget is prompt + ``completion_budget``
    (TRL's ``max_completion_length``); no checkpoints inside the bench's few steps."""
    return [
        f"rollout.max_trajectory_tokens={prompt_tokens + completion_budget}",
        f"checkpoint.every={10**6}",
        "logging.tracker=none",
        "logging.progress=false",
        f"rollout.max_tokens_per_turn={min(cfg.rollout.max_tokens_per_turn, completion_budget)}",
    ]


# retool-rl arms with one feature off each (the decomposition), as config overrides.
ABLATIONS: dict[str, tuple[str, list[str]]] = {
    "no-skip": ("group skipping off (dynamic sampling off, all-equal groups still skipped)", []),
    "no-prefix": ("prefix cache off", ["backend.prefix_cache_mb=0"]),
    "no-train-prefix": (
        "shared-prefix training off (each row's prompt forward and backward)",
        ["backend.share_train_prefix=false"],
    ),
    # No override: bench/peers.py's worker rolls this arm out with bench/_round_sync.py (the job's round_sync).
    "round-sync": ("round-synchronous rollouts", []),
    "subprocess": ("sandbox: a subprocess per call", ["sandbox.backend=subprocess"]),
}


def decompose(
    walls: Mapping[str, Sequence[float]], full: str = "retool"
) -> list[tuple[str, int, float, float]]:
    """(arm, steps compared, its mean step seconds, x the full arm's): each arm against the full retool-rl
    arm over the steps both ran (step k of every arm starts from the same seed; > 1: that much slower)."""
    rows = []
    for arm, w in walls.items():
        k = min(len(w), len(walls[full]))
        mine, base = sum(w[:k]), sum(walls[full][:k])
        rows.append((arm, k, mine / k if k else float("nan"), mine / base if base > 0 else float("nan")))
    return rows


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_row(arm: str, step: int, m: Mapping[str, float]) -> str:
    """One markdown row of the per-step table from an arm's step record (``bench/peers.py`` fills it)."""
    stops = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(m.get("stops", {}).items()) if v)  # type: ignore[attr-defined]
    return (
        f"| {arm} | {step} | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | {m['sampled_tokens']:.0f} | "
        f"{m['sampled_tok_s']:.1f} | {m['trained_tokens']:.0f} | {m['trained_tok_s']:.1f} | "
        f"{m['reward_mean']:+.2f} | {m['tool_call_rate']:.2f} | {stops} |"
    )


STEP_HEADER = (
    "| arm | step | wall s | CPU s | sampled tok | sampled tok/s | trained tok | trained tok/s | reward | "
    "calls / traj | stop reasons |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def learning_over_seeds(results: Sequence[Mapping[str, Any]]) -> str:
    """Held-out accuracy of the SFT start and of both trainers' end models, one row per seed (one finished
    ``bench/peers.py --seed S`` run each), then each trainer's mean gain over the start with its spread over
    the seeds, and the step time of each. The runs must be the same job (steps, budgets, held-out set)."""
    if not results:
        raise ValueError("no runs to compare")
    keys = ("steps", "completion_tokens", "threads", "heldout", "task")
    jobs = {tuple(r["args"].get(k) for k in keys) for r in results}
    if len(jobs) > 1:
        raise ValueError(f"the runs are not the same job ({', '.join(keys)} differ: {sorted(jobs)})")
    seeds = [int(r["args"].get("seed", 0)) for r in results]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"two runs share a seed: {seeds}")
    rows, gains = [], {"trl": [], "retool": []}
    walls: dict[str, list[float]] = {"trl": [], "retool": []}
    for seed, r in sorted(zip(seeds, results, strict=True)):
        acc = r.get("accuracy") or {}
        if not all(m in acc for m in ("sft", "trl", "retool")):
            raise ValueError(f"seed {seed}: the run has no held-out accuracy of sft, trl and retool")
        a = {m: 100 * float(acc[m]["average_at_n"]) for m in ("sft", "trl", "retool")}
        for m in ("trl", "retool"):
            gains[m].append(a[m] - a["sft"])
            walls[m] += [float(s["wall_s"]) for s in r["records"][m]]
        rows.append(
            f"| {seed} | {a['sft']:.1f}% | {a['trl']:.1f}% | {a['retool']:.1f}% | {a['trl'] - a['sft']:+.1f} |"
            f" {a['retool'] - a['sft']:+.1f} |"
        )

    def spread(values: list[float]) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        return f"{statistics.mean(values):+.1f} (sd {sd:.1f})"

    trl_s, retool_s = statistics.mean(walls["trl"]), statistics.mean(walls["retool"])
    first = results[0]["args"]
    return "\n".join(
        [
            f"The same job from the same SFT start and problems, {len(results)} seeds (each trainer's sampling"
            f" and LoRA initialisation), {first['steps']} steps per trainer per seed; held-out: "
            f"{first['heldout']} problems x 2 samples per model, this project's evaluator.",
            "",
            "| seed | sft | trl | retool | trl gain, points | retool gain, points |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Mean gain over the start (sd over seeds): TRL {spread(gains['trl'])}, retool-rl"
            f" {spread(gains['retool'])} points. Mean step: TRL {trl_s:.1f} s, retool-rl {retool_s:.1f} s"
            f" ({trl_s / retool_s:.2f}x).",
        ]
    )
