"""`retool train` on the tiny local model: end to end on CPU, and SIGKILL at precise points then resume.

The tiny random model solves nothing, so every real reward is -1 and every group degenerate; these runs go
through ``tests/train_harness.py`` (the real CLI with a parity-scored environment and a phase hook that
kills the process) so that groups are mixed and real optimizer steps happen, which is what makes a
resumed run's samples depend on restored weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 3


def _overrides(model_dir: Path, tracker: str = "none") -> list[str]:
    sets = [
        f"model.name={model_dir}",
        "data.source=synthetic",
        "data.options.count=40",
        f"train.steps={STEPS}",
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
        "rollout.questions_per_step=1",
        "rollout.group_size=4",
        "rollout.max_tokens_per_turn=16",
        "rollout.max_assistant_turns=2",
        "rollout.max_trajectory_tokens=1400",
        "model.max_context=2048",
        "backend.micro_batch_tokens=2048",
        "backend.sample_batch_size=4",
        "sandbox.workers=1",
        "sandbox.preimport=[]",
        "sandbox.timeout=5",
        "reward.verify_workers=1",
        f"logging.tracker={tracker}",
        "logging.progress=false",
    ]
    return [arg for s in sets for arg in ("--set", s)]


HARNESS = Path(__file__).with_name("train_harness.py")


def run_train(
    args: list[str], kill_at: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    faults = ["--parity", *(["--kill-at", kill_at] if kill_at else [])]
    return subprocess.run(
        [sys.executable, str(HARNESS), *faults, "--", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def essentials(rows: list[dict[str, Any]]) -> list[tuple]:
    return [
        (r["step"], tuple(r["problem_ids"]), json.dumps(r["rewards"]), r["train/optimizer_stepped"])
        for r in rows
    ]


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run, also the end-to-end check of `retool train` (metrics, TensorBoard, checkpoints)."""
    run_dir = tmp_path_factory.mktemp("train") / "reference"
    proc = run_train(
        ["--config", "tiny", "--run-dir", str(run_dir), *_overrides(tiny_model_dir, "tensorboard")]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_tiny_preset_runs_end_to_end(reference_run: Path) -> None:
    rows = metrics(reference_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["train/optimizer_stepped"] for r in rows), "no optimizer step happened"
    assert all(r["tokens/completion"] > 0 for r in rows)
    assert list((reference_run / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = sorted(p.name for p in (reference_run / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{STEPS - 1:06d}", f"step_{STEPS:06d}"]  # keep_last=2
    assert (reference_run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:06d}"
    assert (reference_run / "config.toml").is_file()
    # Every problem of the first epoch is distinct (no repeats within an epoch).
    ids = [pid for r in rows for pid in r["problem_ids"]]
    assert len(ids) == len(set(ids))


def test_a_checkpoint_of_another_format_is_refused_in_one_line(reference_run: Path, tmp_path: Path) -> None:
    import shutil

    run_dir = tmp_path / "older"
    shutil.copytree(reference_run, run_dir)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((latest / "trainer_state.json").read_text())
    from retool.train.checkpoint import CHECKPOINT_FORMAT

    assert state.pop("format") == CHECKPOINT_FORMAT
    (latest / "trainer_state.json").write_text(json.dumps(state))
    proc = run_train(["--resume", str(run_dir), "--set", "logging.progress=false"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "a checkpoint of format None, written by another version of retool" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (latest / "trainer_state.json").read_text() == json.dumps(state)  # nothing rewritten


@pytest.mark.slow
def test_sigkill_at_any_point_then_resume_matches_uninterrupted_run(
    reference_run: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One run killed three times: mid-rollout of step 2, then (resumed) between the backward passes and
    the optimizer step of step 3, then (resumed again) inside the checkpoint of step 3; the last resume
    finishes. Data order, rewards and optimizer steps equal the uninterrupted run's."""
    run_dir = tmp_path / "run"
    first = ["--config", "tiny", "--run-dir", str(run_dir), *_overrides(tiny_model_dir)]
    resume = ["--resume", str(run_dir), "--set", "logging.progress=false"]
    for args, kill_at, done_before in (
        (first, "rollout:2", 1),
        (resume, "optim:3", 2),
        (resume, "checkpoint:3", 2),
    ):
        killed = run_train(args, kill_at=kill_at)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        rows = metrics(run_dir)
        # The killed step's line may or may not be there; the resume decides, from the checkpoint.
        assert [r["step"] for r in rows][:done_before] == list(range(1, done_before + 1))
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step_{done_before:06d}", kill_at
    finished = run_train(resume)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no duplicate, no gap
    assert essentials(rows) == essentials(metrics(reference_run))
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_train(["--config", "no-such-preset"])
    assert proc.returncode == 2 and "no config file or preset" in proc.stderr
    proc = run_train(["--resume", str(tmp_path / "nothing")])
    assert proc.returncode == 2 and "no run to resume" in proc.stderr


@pytest.mark.slow
def test_sigkill_with_a_full_queue_then_resume_matches_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """train.max_steps_off_policy = 1, 4 steps: batch t+1 is sampled while step t trains and every
    checkpoint holds it. Killed while batch 3 is sampled (during step 2: the latest checkpoint is step 1's,
    holding batch 2), then, resumed with that batch queued, between the backward passes and the optimizer
    step of step 4 (the latest checkpoint is step 3's, holding batch 4), then inside step 4's checkpoint;
    the resumed run trains on the same samples as an uninterrupted one, and no batch twice. (Step 3's
    group is degenerate at k = 1, so step 4 is the one with an optimizer step to be killed in.)"""
    steps = STEPS + 1
    k1 = ["--set", "train.max_steps_off_policy=1", "--set", f"train.steps={steps}"]
    reference = tmp_path / "reference"
    done = run_train(["--config", "tiny", "--run-dir", str(reference), *_overrides(tiny_model_dir), *k1])
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    first = ["--config", "tiny", "--run-dir", str(run_dir), *_overrides(tiny_model_dir), *k1]
    resume = ["--resume", str(run_dir), "--set", "logging.progress=false"]
    for args, kill_at, latest_step in (
        (first, "rollout:3", 1),
        (resume, "optim:4", 3),
        (resume, "checkpoint:4", 3),
    ):
        killed = run_train(args, kill_at=kill_at)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step_{latest_step:06d}", kill_at
        state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
        assert state["extra"]["pipeline"]["batches"] == [latest_step + 1]
    finished = run_train(resume)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert essentials(rows) == essentials(metrics(reference))
    assert [r["train/optimizer_stepped"] for r in rows] == [1.0, 1.0, 0.0, 1.0]
    assert [r["offpolicy/lag_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
