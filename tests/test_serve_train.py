"""``retool train`` through the PyTRIO and Tinker adapters against ``retool serve``, against the local backend.

The same tiny run (same seed, same model, parity rewards so every group is mixed and the optimizer really
steps) goes three ways: in-process (``backend.kind=local``), and through each real SDK to a server whose
LoRA settings match. Tolerances: rewards (so every sampled token) identical at both steps; grad norm within
1e-4 relative; the PPO loss (on-policy it is a sum that cancels to ~1e-7) within 1e-5 absolute. The adapters'
startup reduction self-check runs against real computation here and must find Tinker's sum and PyTRIO's
active-token mean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from serve_harness import REPO, ServeProcess

RUN = [
    "--config", "tiny",
    "--set", "train.steps=2",
    "--set", "train.seed=0",
    "--set", "rollout.questions_per_step=2",
    "--set", "rollout.group_size=4",
    "--set", "rollout.max_tokens_per_turn=16",
    "--set", "rollout.max_assistant_turns=2",
    "--set", "rollout.max_trajectory_tokens=4000",
    "--set", "model.max_context=4096",
    "--set", "model.system_prompt=compact",
    "--set", "logging.tracker=none",
    "--set", "logging.progress=false",
    "--set", "backend.cpu_threads=1",
]  # fmt: skip


def train(
    kind: str, model: Path, run_dir: Path, home: Path, base_url: str | None = None
) -> list[dict[str, Any]]:
    args = [*RUN, "--set", f"model.name={model}", "--set", f"backend.kind={kind}", "--run-dir", str(run_dir)]
    if base_url:
        args += ["--set", f"backend.base_url={base_url}"]
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO / 'tests'}",
        "HOME": str(home),
        "PYTRIO_API_KEY": "local",
        "TINKER_API_KEY": "tml-local",
        "TINKER_TELEMETRY": "0",
    }
    harness = REPO / "tests" / "train_harness.py"
    done = subprocess.run(
        [sys.executable, str(harness), "--parity", "--", "train", *args],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    if kind != "local":
        expected = "sum" if kind == "tinker" else "active_tokens"
        assert f"{kind}: the service normalises ppo by {expected}" in done.stderr
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_retool_train_through_both_adapters_matches_the_local_backend(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    local = train("local", tiny_model_dir, tmp_path / "local", home)
    server_args = ("--config", "tiny", "--set", "model.max_context=4096")
    with ServeProcess(tiny_model_dir, tmp_path / "root", *server_args) as server:
        remote = {
            kind: train(kind, tiny_model_dir, tmp_path / kind, home, server.url)
            for kind in ("pytrio", "tinker")
        }
    assert any(r != local[0]["rewards"][0][0] for r in local[0]["rewards"][0])  # a mixed group: a real step
    assert local[0]["policy/grad_norm"] > 0
    for kind, rows in remote.items():
        assert len(rows) == len(local) == 2, kind
        for mine, theirs in zip(local, rows, strict=True):
            assert theirs["rewards"] == mine["rewards"], kind
            assert theirs["tokens/completion"] == mine["tokens/completion"], kind
            assert theirs["policy/grad_norm"] == pytest.approx(mine["policy/grad_norm"], rel=1e-4), kind
            assert theirs["policy/loss"] == pytest.approx(mine["policy/loss"], abs=1e-5), kind
