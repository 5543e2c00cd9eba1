"""Benchmark: does a refactor compute the same numbers? Two source trees, one deterministic workload, every
figure compared, in one run.

``retool demo``'s table is not reproducible bit for bit even from one source tree: its RL rollouts run
concurrently with the sandbox, so which sequences share a decode batch (and so the last bits of their
logits) depends on timing, and the run drifts from there (``tools/demo_speed.py --runs 2`` shows two runs of
one commit printing different RL rows). This bench removes that freedom and keeps everything else of the training path: the tiny
model, one torch thread, the two-stage cold-start SFT loop on synthetic tasks, then RL steps of the tiny
config in three schedules (synchronous; dynamic sampling with a text-only share; one step off-policy)
with a reward that depends on the sampled tokens only (their parity: every optimizer step moves). Each
source tree runs in a process of its own (``PYTHONPATH``); the bench compares every SFT loss and every
metric of every RL step except times, and the trajectories' rewards.

    python tools/same_results.py --src ../before/src            # the other tree against this checkout
    python tools/same_results.py --src ../before/src --write    # also docs/results/same_results.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benches' shared helpers

from _harness import REPO, revision
from _results import render_pages, user_paths, write_result

RL_BASE = [
    "train.steps=3",
    "checkpoint.every=2",
    "rollout.questions_per_step=2",
    "rollout.group_size=4",
    "rollout.max_tokens_per_turn=16",
    "rollout.max_assistant_turns=2",
    "rollout.max_trajectory_tokens=1400",
    "model.max_context=2048",
    "backend.sample_batch_size=8",
    "sandbox.workers=1",
    "sandbox.preimport=[]",
    "logging.tracker=none",
    "logging.progress=false",
    "lora.enabled=false",
]
SCHEDULES = {
    "synchronous": [],
    "dynamic sampling, half text-only": [
        "filters.dynamic_sampling=true",
        "rollout.text_only_share=0.5",
        "rollout.questions_per_step=3",
    ],
    "one step off-policy, dynamic sampling": [
        "train.max_steps_off_policy=1",
        "filters.dynamic_sampling=true",
    ],
}
SFT_STEPS = 14  # past the 10 warm-up steps into the cosine decay


def sft_losses(model: Path) -> list[float]:
    """The cold-start SFT loop's losses on the tiny model: 16 synthetic tasks, a fixed observation."""
    from transformers import AutoTokenizer

    from retool.backends.local.client import LocalTrainingClient
    from retool.data.synthetic import generate_tasks
    from retool.protocol import ChatProtocol
    from retool.train.sft import train_sft

    try:
        from retool.recipes.tiny.styles import build_sft_examples
    except (
        ImportError
    ):  # the other arm may predate the module's place (retool.pipeline.sft / retool.tasks.sft)
        try:
            from retool.pipeline.sft import build_sft_examples  # type: ignore[no-redef]
        except ImportError:
            from retool.tasks.sft import build_sft_examples  # type: ignore[no-redef]

    protocol = ChatProtocol(AutoTokenizer.from_pretrained(model))
    examples = build_sft_examples(generate_tasks(16, seed=0), protocol, lambda code: "42\n", seed=0)
    client = LocalTrainingClient(str(model), lora=None, device="cpu", dtype="float32", seed=0)
    return [float(x) for x in train_sft(client, examples, steps=SFT_STEPS, batch_size=4, lr=1e-2).losses]


def rl_metrics(model: Path, extra: list[str], run: Path) -> dict[str, Any]:
    """A few RL steps of the tiny config, rewarded by the parity of the sampled tokens."""
    import dataclasses

    from retool.config import load_config
    from retool.env import ProblemSource, source_from_config
    from retool.train.loop import Trainer

    class ParityScored(ProblemSource):  # the inner source's problems; reward: token-sum parity
        def __init__(self, inner: ProblemSource) -> None:
            self.inner, self.name, self.shuffle = inner, inner.name, inner.shuffle

        @property
        def source(self) -> str:
            return self.inner.source

        def problems(self, split: Any) -> Any:
            return self.inner.problems(split)

        def epoch(self, seed: int, epoch: int) -> Any:
            return self.inner.epoch(seed, epoch)

        async def score(self, attempt: Any, verifier: Any) -> Any:
            total = sum(sum(turn.completion_tokens) for turn in attempt.turns)
            reward = 1.0 if total % 2 == 0 else -1.0
            return dataclasses.replace(await self.inner.score(attempt, verifier), reward=reward)

    from retool.config import DataConfig

    # The synthetic source's size: [data.options] since 2026-12-06, data.task_count before.
    sized = "data.options.count=40" if "options" in DataConfig.model_fields else "data.task_count=40"
    config = load_config("tiny", [*RL_BASE, sized, f"model.name={model}", *extra])
    Trainer(config, run, source=ParityScored(source_from_config(config))).run()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [json.loads(x).get("reward") for x in (run / "trajectories.jsonl").read_text().splitlines()]
    steps = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    return {"steps": steps, "rewards": rewards}


def child(out: Path, model: Path) -> None:
    """``--child``: the workload in this process (whose ``retool`` is the arm's), its figures to ``out``."""
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="same-results-"))
    figures: dict[str, Any] = {"sft losses": sft_losses(model)}
    for k, (name, extra) in enumerate(SCHEDULES.items()):
        figures[f"rl: {name}"] = rl_metrics(model, extra, work / f"rl{k}")
    out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


def run_arm(src: Path, out: Path, model: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", str(out), "--model", str(model)]
    subprocess.run(cmd, check=True, env=env)
    return dict(json.loads(out.read_text()))


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (a path of keys and indices), or None when they are identical."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b:
                return f"{where}/{key} (only in {'the first' if key in a else 'the second'})"
            found = first_difference(a[key], b[key], f"{where}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where} (length {len(a)} vs {len(b)})"
        return next(
            (
                d
                for i, (x, y) in enumerate(zip(a, b, strict=True))
                if (d := first_difference(x, y, f"{where}[{i}]"))
            ),
            None,
        )
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def leaves(value: Any) -> int:
    """How many numbers (and other scalars) ``value`` holds."""
    if isinstance(value, dict):
        return sum(leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(leaves(v) for v in value)
    return 1


def report(arms: dict[str, dict[str, Any]]) -> str:
    (first, a), (second, b) = arms.items()
    lines = ["| workload | figures compared | identical |", "|---|---|---|"]
    for part in a:
        count = leaves(a[part])
        diff = first_difference(a[part], b.get(part))
        lines.append(f"| {part} | {count} | {'yes' if diff is None else 'no: ' + diff} |")
    same = all(first_difference(a[p], b.get(p)) is None for p in a) and a.keys() == b.keys()
    lines += ["", f"{second} against {first}: {'every figure identical' if same else 'they differ'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="the other source tree (its src/ folder)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-same-results"))
    ap.add_argument("--write", action="store_true", help="write docs/results/same_results.md")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.model)
        return 0
    if args.src is None:
        ap.error("--src: the source tree to compare this checkout with")
    from retool.backends.local.tinymodel import build_tiny_model  # deferred: torch, the parent only

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "tiny_model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, size="test", seed=0)
    arms: dict[str, dict[str, Any]] = {}
    for where, src in ((f"`{user_paths(str(args.src))}`", args.src), ("this checkout", REPO / "src")):
        name = f"{where} ({revision(src.resolve())})"
        arms[name] = run_arm(src.resolve(), args.out / f"arm{len(arms)}.json", model.resolve())
    text = report(arms)
    print(text)
    if args.write:
        write_result(
            "same_results.md", "A refactor's numbers against its parent's: `tools/same_results.py`", text
        )
        render_pages()
    return 0 if "every figure identical" in text else 1


if __name__ == "__main__":
    raise SystemExit(main())
