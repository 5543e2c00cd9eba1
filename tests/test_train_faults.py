"""A full disk or a torn write during training: the error says what failed and where, the previous
checkpoint stays intact, and a resume continues exactly like an uninterrupted run.

Faults are injected at the run's write boundaries (the backend's save, torch's RNG file, the trainer
state, the ``latest`` pointer, the metrics line); the metrics case also uses ``/dev/full``, where the
kernel itself answers ENOSPC. Fake components (``test_train_loop``'s) keep each run to a fraction of a
second; ``test_train_worker_faults`` does a full-disk save with the real local backend. Also here: a step
whose every trajectory was lost to infrastructure failures stops the run.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retool.backends.remote.guarded import guard_training_client
from retool.env import ProblemList
from retool.retry import TransientStatusError
from retool.train import checkpoint as checkpoint_mod
from retool.train import metrics as metrics_mod
from retool.train.checkpoint import CheckpointManager, CheckpointWriteError, RunWriteError
from retool.train.loop import Trainer
from retool.train.metrics import StepLostError
from test_train_loop import (
    PROBLEMS,
    FakeClient,
    as_rollout_fn,
    essentials,
    fake_components,
    fake_config,
    make_trainer,
    read_metrics,
    scripted_rollouts,
)

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class FullDiskClient(FakeClient):
    """Saves half a file, then the disk is full, when saving the checkpoint of step ``full_at``."""

    def __init__(self, full_at: int) -> None:
        super().__init__()
        self.full_at = full_at
        self.saves = 0

    async def save_state_async(self, name: str) -> str:
        self.saves += 1
        if self.saves == self.full_at:
            path = Path(name)
            path.mkdir(parents=True, exist_ok=True)
            (path / "state.json").write_text('{"weight": ')  # torn
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / "state.json"))
        return await super().save_state_async(name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run = tmp_path_factory.mktemp("ref") / "run"
    make_trainer(fake_config(steps=6, every=2), run).run()
    return read_metrics(run)


def _resume_matches(run: Path, reference: list[dict[str, Any]], start: int) -> None:
    summary = make_trainer(fake_config(steps=6, every=2), run, resume=True).run()
    assert summary.start_step == start and summary.last_step == 6
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert essentials(rows) == essentials(reference)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_full_disk_while_the_backend_saves(tmp_path: Path, reference: list[dict[str, Any]]) -> None:
    run = tmp_path / "run"
    client = FullDiskClient(full_at=2)  # every=2: the checkpoint of step 4
    with pytest.raises(CheckpointWriteError) as info:
        make_trainer(fake_config(steps=6, every=2), run, client=client).run()
    message = str(info.value)
    assert "checkpoint step_000004: saving the backend state" in message
    assert str(run / "checkpoints" / ".tmp-step_000004") in message  # where
    assert "No space left on device" in message  # what
    assert "previous checkpoint" in message and "step_000002 is intact" in message
    assert f"retool train --resume {run}" in message
    manager = CheckpointManager(run)
    assert manager.latest() == run / "checkpoints" / "step_000002"
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the half-written checkpoint is gone
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    _resume_matches(run, reference, start=2)


@pytest.mark.parametrize("target", ["rng", "state", "latest"])
def test_full_disk_while_the_trainer_writes_its_files(
    tmp_path: Path, reference: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    run = tmp_path / "run"
    make_trainer(fake_config(steps=2, every=2), run).run()  # step_000002 on disk
    before = _snapshot(run / "checkpoints" / "step_000002")

    import torch

    real_save, real_write = torch.save, checkpoint_mod.write_text_atomic

    def failing_save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if target == "rng" and "step_000004" in str(path):
            Path(path).write_bytes(b"PK\x03\x04 torn")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
        real_save(obj, path, *args, **kwargs)

    def failing_write(path: Path, text: str) -> None:
        name = path.name
        if (target == "state" and name == "trainer_state.json" and "step_000004" in str(path)) or (
            target == "latest" and name == "latest" and text.startswith("step_000004")
        ):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, text)

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(checkpoint_mod, "write_text_atomic", failing_write)
    with pytest.raises(CheckpointWriteError) as info:
        make_trainer(fake_config(steps=6, every=2), run, resume=True).run()
    message = str(info.value)
    expected = {
        "rng": "writing the RNG state",
        "state": "writing the trainer state",
        "latest": "updating",
    }[target]
    assert expected in message and "step_000004" in message, message
    if target != "latest":
        assert "No space left on device" in message or "unexpected pos" in message
        assert not (run / "checkpoints" / "step_000004").exists()
    # The previous checkpoint is untouched and still the one a resume starts from.
    assert _snapshot(run / "checkpoints" / "step_000002") == before
    assert CheckpointManager(run).latest() == run / "checkpoints" / "step_000002"
    monkeypatch.undo()
    _resume_matches(run, reference, start=2)


def test_torn_metrics_line_is_cut_back(
    tmp_path: Path, reference: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills in the middle of a metrics line: no torn line stays in the file."""
    run = tmp_path / "run"
    real_open = open

    class HalfWriter:
        def __init__(self, fh: Any) -> None:
            self._fh = fh

        def write(self, text: str) -> int:
            self._fh.write(text[: len(text) // 2])
            self._fh.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._fh, name)

        def __enter__(self) -> HalfWriter:
            return self

        def __exit__(self, *exc: object) -> None:
            self._fh.close()

    appends = {"n": 0}

    def fake_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(path, mode, *args, **kwargs)
        if mode == "a":
            appends["n"] += 1
            if appends["n"] == 3:  # step 3's line
                return HalfWriter(fh)
        return fh

    monkeypatch.setattr(metrics_mod, "open", fake_open, raising=False)
    with pytest.raises(RunWriteError) as info:
        make_trainer(fake_config(steps=6, every=2), run).run()
    message = str(info.value)
    assert f"appending step 3's metrics to {run / 'metrics.jsonl'} failed" in message
    assert "No space left on device" in message and "the file still ends with the previous step" in message
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()] == [1, 2]
    monkeypatch.undo()
    _resume_matches(run, reference, start=2)


def test_metrics_on_a_full_device_real_enospc(tmp_path: Path, reference: list[dict[str, Any]]) -> None:
    """The kernel's own ENOSPC (/dev/full) on the metrics append of step 2, right after its checkpoint."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    kept = tmp_path / "metrics.kept"

    def fill_disk(step: int, record: dict[str, Any]) -> None:
        if step == 1:
            metrics.rename(kept)
            metrics.symlink_to("/dev/full")

    trainer = make_trainer(fake_config(steps=6, every=2), run, on_step=fill_disk)
    with pytest.raises(
        RunWriteError, match=r"appending step 2's metrics to .*metrics\.jsonl failed: OSError: \[Errno 28\]"
    ):
        trainer.run()
    assert CheckpointManager(run).latest() == run / "checkpoints" / "step_000002"
    metrics.unlink()  # space is freed: the file is back
    kept.rename(metrics)
    _resume_matches(run, reference, start=2)


def test_a_step_lost_entirely_to_infrastructure_failures_stops_the_run(tmp_path: Path) -> None:
    """One lost trajectory is absorbed; a step with nothing else means the sampler or sandbox is down."""

    async def loose(problems: Any, *, sampler: Any, group_size: int, seed: int, **kw: Any) -> Any:
        groups = await scripted_rollouts(problems, sampler=sampler, group_size=group_size, seed=seed, **kw)
        step = len(seen) + 1
        seen.append(step)
        lost = {"stop_reason": "sampler_error", "error": "ConnectionResetError: sampler died"}
        return [
            [
                replace(traj, reward=-1.0, outcome=replace(traj.outcome, **lost, correct=False))
                if step == 2 or (step == 1 and (g, b) == (0, 0))
                else traj
                for b, traj in enumerate(group)
            ]
            for g, group in enumerate(groups)
        ]

    rollouts = as_rollout_fn(loose)

    seen: list[int] = []
    trainer = Trainer(
        fake_config(steps=4, every=1),
        tmp_path / "run",
        source=ProblemList(PROBLEMS, shuffle=True),
        components=fake_components(),
        rollout_fn=rollouts,
    )
    with pytest.raises(
        StepLostError, match=r"step 2: all 12 trajectories ended in infrastructure failures"
    ) as info:
        trainer.run()
    assert "sampler died" in str(info.value)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0]["faults/trajectories_lost"] == 1.0
    assert CheckpointManager(tmp_path / "run").latest() == tmp_path / "run" / "checkpoints" / "step_000001"


class FlakyServiceClient(FakeClient):
    """A remote-like client: the first sampler refresh answers 503; one forward_backward (the second
    micro-batch after two optimizer steps) is applied but its answer is lost; it can discard its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fb_in_step: dict[int, int] = {}
        self.refresh_failed = False

    async def sampling_client_async(self) -> Any:
        if not self.refresh_failed:
            self.refresh_failed = True
            raise TransientStatusError("HTTP 503: warming up", 503)
        return await super().sampling_client_async()

    async def forward_backward_async(self, datums: Any, loss_fn: Any, loss_config: Any = None) -> Any:
        n = self.fb_in_step[self.optim_steps] = self.fb_in_step.get(self.optim_steps, 0) + 1
        result = await super().forward_backward_async(datums, loss_fn, loss_config)
        if self.optim_steps == 2 and n == 2:  # the second micro-batch after two optimizer steps
            raise ConnectionResetError("connection reset after the gradient was accumulated")
        return result

    async def zero_grad_async(self) -> None:
        self.grad = 0.0


def test_trainer_guards_remote_calls_and_never_double_counts_a_gradient(tmp_path: Path) -> None:
    cfg = fake_config(steps=6, every=2).model_copy(deep=True)
    cfg.backend.micro_batch_tokens = 16  # several micro-batches per step: the replay re-issues earlier ones
    make_trainer(cfg, tmp_path / "reference").run()  # no faults, no guard
    cfg.retry.guard = "always"
    cfg.retry.backoff = 0.001
    # The guard is the components' (``build_components`` applies it): the trainer wraps nothing again.
    guarded = guard_training_client(FlakyServiceClient(), cfg)
    make_trainer(cfg, tmp_path / "run", client=guarded).run()  # type: ignore[arg-type]
    rows = read_metrics(tmp_path / "run")
    # The same weights after every step, so the same samples, rewards and grad norms.
    assert essentials(rows) == essentials(read_metrics(tmp_path / "reference"))
    last = rows[-1]
    assert last["faults/remote_retries"] == 2 and last["faults/remote_failures"] == 0
    assert last["faults/remote_replays"] == 1
