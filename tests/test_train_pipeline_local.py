"""Does the sampler sample from the weights it is said to? On the real local backend (tiny model).

The sampler/trainer mismatch makes a stale sampler visible: trained on-policy, the trainer's logprobs of
the sampled tokens equal the sampler's to float rounding; a sampler that never received the trained
weights (the failure of LoRA weight sync in other frameworks) drifts away. Each test runs the broken
variant too, so that it shows the check fails when the weights are not pushed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from retool.components import Components, build_components
from retool.config import Config, load_config
from retool.env import source_from_config
from retool.rollout import run_rollout
from retool.train.loop import Trainer
from train_harness import ParityScoredSource


def local_config(model_dir: Path, k: int) -> Config:
    return load_config(
        "tiny",
        [
            f"model.name='{model_dir}'",
            "data.source=synthetic",
            "data.options.count=40",
            "train.steps=2",
            f"train.max_steps_off_policy={k}",
            # fp32 sampler and trainer agree to ~1e-7 on the same weights; one optimizer step moves the
            # logprobs by ~0.05 here (the default tolerance is sized for bf16 engines)
            "train.sampler_check_tol=0.01",
            "checkpoint.every=0",
            "rollout.questions_per_step=2",
            "rollout.group_size=4",
            "rollout.max_tokens_per_turn=16",
            "rollout.max_assistant_turns=2",
            "rollout.max_trajectory_tokens=1400",
            "model.max_context=2048",
            "backend.micro_batch_tokens=2048",
            "backend.sample_batch_size=8",
            "lora.enabled=false",  # full fine-tuning: every weight moves
            "optimizer.lr=0.003",  # large steps, so one version differs visibly from the next
            "sandbox.workers=1",
            "sandbox.preimport=[]",
            "reward.verify_workers=1",
            "logging.tracker='none'",
            "logging.progress=false",
        ],
    )


class StaleSampler:
    """The real backend, except that the sampler never receives new weights: every refresh hands out a
    frozen copy of the first weights again."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._first: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def sampling_client_async(self) -> Any:
        if self._first is None:
            self._first = await self._inner.frozen_sampling_client_async()
        return self._first

    frozen_sampling_client_async = sampling_client_async


class Recorder:
    """Keeps a copy of the trainer's weights whenever a sampler is handed out (version = optimizer steps),
    and every rollout call's sampler and trajectories."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.calls: list[tuple[Any, list[list[Any]]]] = []

    def wrap_backend(self, outer: Any) -> Any:
        recorder = self

        class Recording:
            def __getattr__(self, name: str) -> Any:
                return getattr(outer, name)

            async def frozen_sampling_client_async(self) -> Any:
                sampler = await outer.frozen_sampling_client_async()
                inner = recorder.backend  # nothing trains while the trainer publishes: the weights are still
                recorder.weights[inner.step] = {
                    k: v.detach().clone() for k, v in inner.model.state_dict().items()
                }
                return sampler

            async def sampling_client_async(self) -> Any:
                return await self.frozen_sampling_client_async()

        return Recording()

    async def rollout(self, request: Any) -> Any:
        from retool.rollout import run_rollout

        groups = await run_rollout(request)
        self.calls.append((request.policy, groups))
        return groups


def run(tmp: Path, cfg: Config, wrap: Any = None, rollout_fn: Any = run_rollout) -> list[dict[str, Any]]:
    parts = build_components(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(tmp)})})
    )
    try:
        backend = wrap(parts.backend) if wrap is not None else parts.backend
        lent = Components(
            backend=backend, protocol=parts.protocol, verifier=parts.verifier, executor=parts.executor
        )
        Trainer(
            cfg,
            tmp / "run",
            source=ParityScoredSource(source_from_config(cfg)),
            components=lent,
            rollout_fn=rollout_fn,
        ).run()
    finally:
        parts.close()
    return [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def test_on_policy_check_passes_with_fresh_weights_and_fails_with_a_stale_sampler(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = local_config(tiny_model_dir, k=0)
    fresh = run(tmp_path / "fresh", cfg)
    assert all(r["train/optimizer_stepped"] for r in fresh)
    for r in fresh:
        assert r["offpolicy/lag_max"] == 0 and r["offpolicy/logprob_diff_mean"] < 1e-4
        assert r["offpolicy/sampler_check_failed"] == 0.0
    stale = run(tmp_path / "stale", cfg, wrap=StaleSampler)
    assert stale[0]["offpolicy/sampler_check_failed"] == 0.0  # version 0 is the stale sampler's own
    for r in stale[1:]:  # the trainer moved on, the sampler did not: the lag says 0, the logprobs do not
        assert r["offpolicy/lag_max"] == 0 and r["offpolicy/logprob_diff_mean"] > cfg.train.sampler_check_tol
        assert r["offpolicy/sampler_check_failed"] == 1.0


def sampled_by(recorder: Recorder, model_dir: Path) -> list[tuple[int, float]]:
    """For every rollout call: the version whose recorded weights reproduce the sampler's logprobs of
    the sampled tokens, and how closely (max |difference|); (-1, inf) when none does."""
    from transformers import AutoModelForCausalLM

    from retool.train.step import build_datum

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for _, groups in recorder.calls:
        datums = [build_datum(t, 0.0) for g in groups for t in g if t.completion_token_count]
        best = (-1, float("inf"))
        for version, weights in sorted(recorder.weights.items()):
            model.load_state_dict(weights)
            worst = 0.0
            with torch.no_grad():
                for d in datums:
                    logits = model(input_ids=torch.tensor([d.input_tokens])).logits[0].float()
                    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.target_tokens)[:, None])[
                        :, 0
                    ]
                    mask = torch.tensor(d.weights) != 0
                    worst = max(worst, float((lp[mask] - torch.tensor(d.logprobs)[mask]).abs().max()))
            if worst < best[1]:
                best = (version, worst)
        out.append(best)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_is_sampled_from_the_weights_of_its_version(
    tiny_model_dir: Path, tmp_path: Path, k: int
) -> None:
    """k >= 1 on the local backend: batch t comes from a frozen copy of version max(t - 1 - k, 0) while the
    trainer goes on. Checked against the trainer's weights recorded at each version; the stale variant
    (the sampler keeps the first weights) fails the same check."""
    cfg = local_config(tiny_model_dir, k=k).model_copy(deep=True)
    cfg.train.steps = 4
    for name, wrap in (("fresh", None), ("stale", StaleSampler)):
        recorders: list[Recorder] = []

        def wrapped(backend: Any, wrap: Any = wrap, recorders: list[Recorder] = recorders) -> Any:
            recorders.append(Recorder(backend))
            return recorders[0].wrap_backend(wrap(backend) if wrap is not None else backend)

        async def rollout(request: Any, recorders: list[Recorder] = recorders) -> Any:
            return await recorders[0].rollout(request)

        rows = run(tmp_path / name, cfg, wrap=wrapped, rollout_fn=rollout)
        recorder = recorders[0]
        versions = [max(t - 1 - k, 0) for t in range(1, 5)]
        assert [r["offpolicy/policy_version"] for r in rows] == versions
        found = sampled_by(recorder, tiny_model_dir)
        if name == "fresh":
            assert [v for v, _ in found] == versions and all(err < 1e-3 for _, err in found)
            assert [r["offpolicy/lag_max"] for r in rows] == [min(k, t - 1) for t in range(1, 5)]
            assert rows[-1]["offpolicy/logprob_diff_mean"] > 1e-3  # k versions behind: a real mismatch
        else:
            assert [v for v, _ in found] == [0, 0, 0, 0] and versions[-1] > 0
