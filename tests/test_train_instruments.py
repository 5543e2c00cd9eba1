"""The instruments of every step's metrics line: rates over every sampled trajectory, the informative
share, the sampled-token NLL, and the policy's entropy and KL to the start, which the local backend
measures (every ``train.ref_kl_every`` steps) and a backend without them reports as null."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.types import ForwardBackwardResult
from retool.components import Components, build_components
from retool.config import ConfigError, load_config
from retool.env import ReToolOutcome, source_from_config
from retool.rollout import AssistantTurn, Trajectory, Transition
from retool.train.loop import Trainer, _loss_config
from retool.train.metrics import rollout_metrics
from retool.train.sampling import Collected
from retool.train.step import TrainStepResult
from test_train_loop import PROBLEMS, FakeClient, fake_config, make_trainer, read_metrics
from train_harness import ParityScoredSource

INSTRUMENTS = (
    "policy/entropy",
    "policy/sampled_nll",
    "policy/ref_kl",
    "tool/code_share",
    "task/void_turn_rate",
    "task/truncated_rate",
    "policy/response_length",
    "sampling/groups_sampled",
    "sampling/groups_informative",
    "sampling/informative_share",
)


def _traj(
    stop: str, logprobs: list[float], *, sampler_stop: str = "stop", status: str = "ok", calls: int = 0
) -> Trajectory:
    n = len(logprobs)
    turn = AssistantTurn([1, 2], list(range(3, 3 + n)), logprobs, "x", sampler_stop=sampler_stop)
    return Trajectory(
        problem=PROBLEMS[0],
        group_index=0,
        transitions=(Transition(turn, 0.0, True),),
        reward=0.0,
        outcome=ReToolOutcome(
            correct=False, stop_reason=stop, reward_status=status, codes=("print(1)",) * calls
        ),
    )


def test_rates_and_sampled_nll_are_over_every_sampled_trajectory() -> None:
    groups = [
        [
            _traj("answer", [-1.0, -3.0], calls=1),  # fine
            _traj("invalid", [-2.0]),  # void: a broken turn
            _traj("answer", [-0.5, -0.5, -2.0], status="no_answer"),  # void: an answer without one
        ],
        [
            _traj("context_full", [-1.0]),  # truncated: out of context
            _traj("answer", [-4.0, -1.0], sampler_stop="length", calls=2),  # truncated: the turn's cap
            _traj("answer", [-1.0]),
        ],
    ]
    m = rollout_metrics(groups)
    assert m["task/void_turn_rate"] == pytest.approx(2 / 6)
    assert m["task/truncated_rate"] == pytest.approx(2 / 6)
    assert m["tool/code_share"] == pytest.approx(2 / 6)  # the tool-call rate
    assert m["policy/response_length"] == pytest.approx(10 / 6)
    assert m["policy/sampled_nll"] == pytest.approx(16 / 10)  # the sampled tokens' mean -logprob


def test_informative_share_counts_every_sampled_group() -> None:
    g = [_traj("answer", [-1.0])]
    # dynamic sampling: three rounds sampled five groups, two of them informative, one kept
    m = Collected(groups=[g], sampled=[g] * 5, rounds=3, informative=2).metrics()
    assert m["sampling/groups_sampled"] == 5 and m["sampling/groups_informative"] == 2
    assert m["sampling/informative_share"] == pytest.approx(0.4)
    assert Collected(groups=[]).metrics()["sampling/informative_share"] == 0.0


def test_a_step_without_a_measure_reports_null() -> None:
    m = TrainStepResult(0, 0, False, None).metrics()
    assert m["policy/entropy"] is None and m["policy/ref_kl"] is None
    fb = ForwardBackwardResult(loss=0.0, trained_tokens=4, entropy=1.5)
    m = TrainStepResult(1, 1, True, fb).metrics()
    assert m["policy/entropy"] == 1.5 and m["policy/ref_kl"] is None


class ReferenceClient(FakeClient):
    """A fake backend that can compute the reference policy's logprobs: records the loss configs."""

    reference_kl_unavailable = None

    def __init__(self) -> None:
        super().__init__()
        self.configs: list[dict[str, float] | None] = []

    async def forward_backward_async(self, datums: Any, loss_fn: Any, loss_config: Any = None) -> Any:
        self.configs.append(loss_config)
        result = await super().forward_backward_async(datums, loss_fn, loss_config)
        if loss_config and ("measure_ref_kl" in loss_config or "ref_kl_coef" in loss_config):
            result.ref_kl = 0.25
        return result


def test_the_reference_kl_is_measured_every_n_steps(tmp_path: Path) -> None:
    cfg = fake_config(steps=4, every=0).model_copy(deep=True)
    cfg.train.ref_kl_every = 2
    client = ReferenceClient()
    make_trainer(cfg, tmp_path / "every2", client=client).run()
    asked = [c is not None and c.get("measure_ref_kl") == 1.0 for c in client.configs]
    rows = read_metrics(tmp_path / "every2")
    trained = [r["step"] for r in rows if r["train/optimizer_stepped"]]
    assert trained  # the fake's rewards differ within groups
    assert [r["policy/ref_kl"] for r in rows] == [
        0.25 if r["step"] % 2 == 0 and r["step"] in trained else None for r in rows
    ]
    assert sum(asked) == sum(1 for s in trained if s % 2 == 0)
    # a fake without the reference: never asked, null every step (and no entropy either)
    make_trainer(fake_config(steps=2, every=0), tmp_path / "none").run()
    for r in read_metrics(tmp_path / "none"):
        assert r["policy/ref_kl"] is None and r["policy/entropy"] is None
        assert all(key in r for key in INSTRUMENTS)


def test_the_penalty_goes_to_the_backend_every_step() -> None:
    cfg = load_config(None, ["loss.ref_kl_coef=0.1"])
    assert _loss_config(cfg, 0.0, measure_ref_kl=False) == {
        "clip_low": 0.8,
        "clip_high": 1.28,
        "ref_kl_coef": 0.1,
    }
    cfg = load_config(None, [])
    assert _loss_config(cfg, 0.0, measure_ref_kl=True) == {
        "clip_low": 0.8,
        "clip_high": 1.28,
        "measure_ref_kl": 1.0,
    }
    assert _loss_config(cfg, 0.0) == {"clip_low": 0.8, "clip_high": 1.28}


@pytest.mark.parametrize("kind", ["pytrio", "tinker"])
def test_a_remote_backend_refuses_the_penalty_at_config_time(kind: str) -> None:
    with pytest.raises(ConfigError, match="only the local backend") as err:
        load_config(None, [f'backend.kind="{kind}"', "loss.ref_kl_coef=0.1"])
    assert "\n" not in str(err.value)
    load_config(None, [f'backend.kind="{kind}"'])  # measuring is no setting a service refuses


def test_full_fine_tuning_refuses_the_penalty_at_config_time() -> None:
    with pytest.raises(ConfigError, match="needs LoRA"):
        load_config(None, ["lora.enabled=false", "loss.ref_kl_coef=0.1"])


def test_a_tiny_local_run_records_every_instrument(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        "tiny",
        [
            f"model.name='{tiny_model_dir}'",
            "data.source=synthetic",
            "data.options.count=40",
            "train.steps=2",
            "checkpoint.every=0",
            "rollout.questions_per_step=2",
            "rollout.group_size=4",
            "rollout.max_tokens_per_turn=16",
            "rollout.max_assistant_turns=2",
            "rollout.max_trajectory_tokens=1400",
            "model.max_context=2048",
            "backend.micro_batch_tokens=2048",
            "backend.sample_batch_size=8",
            "lora.rank=4",
            "optimizer.lr=0.01",  # one step moves the policy visibly off its start
            "sandbox.workers=1",
            "sandbox.preimport=[]",
            "reward.verify_workers=1",
            "logging.tracker='none'",
            "logging.progress=false",
        ],
    )
    parts = build_components(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(tmp_path)})})
    )
    try:
        lent = Components(
            backend=parts.backend, protocol=parts.protocol, verifier=parts.verifier, executor=parts.executor
        )
        source = ParityScoredSource(
            source_from_config(cfg)
        )  # rewards differ within a group: every step trains
        Trainer(cfg, tmp_path / "run", source=source, components=lent).run()
    finally:
        parts.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/optimizer_stepped"] == 1.0
        for key in INSTRUMENTS:
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
        assert r["policy/entropy"] > 0 and r["policy/sampled_nll"] > 0
    assert rows[0]["policy/ref_kl"] == 0.0  # before the first optimizer step the policy is its start
    assert rows[1]["policy/ref_kl"] > 0.0
