"""Benchmark: step wall time of the training loop at train.max_steps_off_policy = 0, 1, 2, side by side.

The trainer (``retool.train.Trainer``, unchanged) runs against a fake *remote* backend whose calls take
the configured latencies, as a service's do: ``sample`` (concurrent requests overlap, as on a batching
server), ``forward_backward`` (one call per step here), ``optim_step`` and the sampler refresh
(``save_weights_and_get_sampling_client``). Everything else is real: the task environment, the chat
protocol and tokenizer (the tiny model's), the fork-server sandbox that runs every code call, and the
verifier. The fake policy answers in two turns: a code call (a small computation, executed in the
sandbox), then a boxed answer that is right for half the branches (seeded), so groups are mixed and
every step trains.

The fake trainer's logprob of a token sampled by version v is the sampler's minus 0.01 * (trainer
version - v), so the ``offpolicy/*`` metrics show the lag as a mismatch (0.01 per version).

    python bench/pipeline.py                  # PyTRIO-like shapes: 3 s per sample call, 5 s per forward_backward
    python bench/pipeline.py --scale 0.4      # every latency x 0.4: the same shape in about two minutes
    python bench/pipeline.py --sample 2 --fb 8  # training twice as long as sampling

With the defaults a step samples for about two sample calls (the code turn, then the answer turn) plus the
sandbox, and trains for one forward_backward, one optim_step and one sampler refresh: sampling and training
take similar time, the case where k = 1 can at best halve the step.

Prints one row per k: mean step wall time over the steady steps (after the first k + 1, which fill the
pipeline), the speedup over k = 0, the time the trainer waited for its batch, the batch's own sampling
time, the training time, the mean lag and mismatch; with the machine and its load average. ``--write``
also writes what it printed to docs/results/pipeline.md (``--scale`` other than 1: pipeline_scaleS.md) and
refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _machine import machine  # bench/, on sys.path when run as a script
from _results import recording, write_printed
from retool.backends.interface.clients import SamplingClient, TrainingClient
from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    Sample,
    SamplingParams,
)
from retool.backends.training.losses import LossTally, token_loss

DRIFT_PER_VERSION = 0.01


class Latencies:
    def __init__(self, sample: float, fb: float, optim: float, refresh: float) -> None:
        self.sample, self.fb, self.optim, self.refresh = sample, fb, optim, refresh


class FakeRemoteSampler(SamplingClient):
    """Turn 1 (the group request): a code call; later turns: a boxed answer, right for half the seeds."""

    def __init__(self, owner: FakeRemoteClient, version: int) -> None:
        self.owner, self.version = owner, version

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        await asyncio.sleep(self.owner.latency.sample)
        protocol, tokenizer = self.owner.protocol, self.owner.tokenizer
        end = next(iter(protocol.stop_token_ids))
        question = tokenizer.decode(list(prompt_tokens))
        answer = next((a for q, a in self.owner.answers.items() if q in question), "0")
        out = []
        for i in range(num_samples):
            coin = hashlib.blake2b(f"{params.seed}:{i}".encode(), digest_size=2).digest()[0] % 2
            if num_samples > 1:  # the first turn of a group
                n = 40 + i
                text = "Let me compute.\n" + protocol.fmt.render_call(
                    f"print(sum(k * k for k in range({n})) % 97)"
                )
            else:
                text = f"The answer is \\boxed{{{answer if coin == 0 else answer + '1'}}}."
            tokens = [*tokenizer.encode(text, add_special_tokens=False), end]
            lp = -0.5 - DRIFT_PER_VERSION * self.version
            out.append(Sample(tokens, [lp] * len(tokens), "stop"))
        return out


class FakeRemoteClient(TrainingClient):
    """A remote service in miniature: latencies instead of work; the version is its optimizer steps."""

    def __init__(self, tokenizer: Any, protocol: Any, answers: dict[str, str], latency: Latencies) -> None:
        self.tokenizer, self.protocol, self.answers, self.latency = tokenizer, protocol, answers, latency
        self.step = 0

    async def sampling_client_async(self) -> SamplingClient:
        await asyncio.sleep(self.latency.refresh)
        return FakeRemoteSampler(self, self.step)

    async def forward_backward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        import torch

        await asyncio.sleep(self.latency.fb)
        tally = LossTally()
        for d in datums:
            mu = torch.tensor(d.logprobs, dtype=torch.float64)
            trained = torch.tensor(d.weights) != 0
            sampler_version = torch.round((-0.5 - mu) / DRIFT_PER_VERSION)
            lp = torch.where(trained, mu - DRIFT_PER_VERSION * (self.step - sampler_version), mu)
            adv = torch.tensor(d.advantages, dtype=torch.float64)
            tally.add(
                token_loss(loss_fn, lp, torch.tensor(d.weights, dtype=torch.float64), mu, adv, loss_config)
            )
        return tally.result()

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        await asyncio.sleep(self.latency.optim)
        self.step += 1
        return OptimStepResult(grad_norm=0.0, lr=adam.lr)

    async def save_state_async(self, name: str) -> str:
        Path(name).mkdir(parents=True, exist_ok=True)
        (Path(name) / "state.json").write_text(json.dumps({"step": self.step}))
        return name

    async def load_state_async(self, path: str) -> None:
        self.step = json.loads((Path(path) / "state.json").read_text())["step"]


def run_arm(k: int, args: argparse.Namespace, parts: dict[str, Any], out: Path) -> dict[str, Any]:
    from retool.components import Components
    from retool.config import override_config
    from retool.train.loop import Trainer

    cfg = override_config(parts["config"], [f"train.max_steps_off_policy={k}"])
    client = FakeRemoteClient(parts["tokenizer"], parts["protocol"], parts["answers"], parts["latency"])
    components = Components(client, parts["protocol"], parts["verifier"], parts["executor"])
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    Trainer(cfg, out / f"k{k}", source=parts["source"], components=components).run()
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / f"k{k}" / "metrics.jsonl").read_text().splitlines()]
    steady = rows[k + 1 :] or rows

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in steady)

    return {
        "k": k,
        "steps": len(rows),
        "wall": wall,
        "step": mean("time/step"),
        "wait": mean("time/wait"),
        "rollout": mean("time/rollout"),
        "train": mean("time/train"),
        "refresh": mean("time/refresh"),
        "lag": mean("offpolicy/lag_mean"),
        "diff": mean("offpolicy/logprob_diff_mean"),
        "reward": statistics.fmean(float(r["task/reward_mean"]) for r in rows),
        "exec_calls": sum(float(r["env/exec_calls"]) for r in rows),
        "load": (load_before, os.getloadavg()[0]),
    }


def build_parts(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tokenizer, protocol, environment, real sandbox and verifier, and the config of every arm."""
    from transformers import AutoTokenizer

    from retool.backends.local.tinymodel import build_tiny_model
    from retool.config import load_config
    from retool.env import source_from_config
    from retool.protocol import ChatProtocol
    from retool.reward import Verifier
    from retool.sandbox import make_executor

    config = load_config(
        "tiny",
        [
            "data.source=synthetic",
            "data.options.count=400",
            f"train.steps={args.steps}",
            "checkpoint.every=0",
            f"rollout.questions_per_step={args.questions}",
            f"rollout.group_size={args.group}",
            "rollout.max_trajectory_tokens=1400",
            "model.max_context=2048",
            "backend.micro_batch_tokens=1000000",  # one forward_backward per step
            "sandbox.preimport=[]",
            "logging.tracker='none'",
            "logging.progress=false",
        ],
    )
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(work / "tiny_model", size="test", seed=0))
    source = source_from_config(config)
    return {
        "config": config,
        "tokenizer": tokenizer,
        "protocol": ChatProtocol.from_config(tokenizer, config),
        "source": source,
        "answers": {p.question: p.answer for p in source.problems("train")},
        "executor": make_executor(config.sandbox),
        "verifier": Verifier.from_config(config.reward),
        "latency": Latencies(args.sample, args.fb, args.optim, args.refresh),
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["step"] if rows and rows[0]["k"] == 0 else None
    head = "| k | steps | step s (steady) | speedup | wait s | rollout s | train s | refresh s | lag | mismatch | load 1m |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        speed = f"{base / r['step']:.2f}x" if base else "-"
        lines.append(
            f"| {r['k']} | {r['steps']} | {r['step']:.2f} | {speed} | {r['wait']:.2f} | {r['rollout']:.2f} "
            f"| {r['train']:.2f} | {r['refresh']:.2f} | {r['lag']:.2f} | {r['diff']:.3f} "
            f"| {r['load'][0]:.1f} -> {r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="0,1,2", help="values of train.max_steps_off_policy (default 0,1,2)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8, help="questions per step")
    ap.add_argument("--group", type=int, default=8, help="branches per question")
    ap.add_argument("--sample", type=float, default=3.0, help="seconds per sample call (default 3.0)")
    ap.add_argument("--fb", type=float, default=5.0, help="seconds per forward_backward call (default 5.0)")
    ap.add_argument("--optim", type=float, default=0.5, help="seconds per optim_step (default 0.5)")
    ap.add_argument("--refresh", type=float, default=0.5, help="seconds per sampler refresh (default 0.5)")
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiply every latency (e.g. 0.4 for a quick run)"
    )
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    ap.add_argument("--write", action="store_true", help="also write docs/results/pipeline.md")
    args = ap.parse_args(argv)
    with recording(args.write) as rec:
        rc = run(args)
    if args.write:
        name = "pipeline.md" if args.scale == 1 else f"pipeline_scale{args.scale:g}.md"
        write_printed(name, "Off-policy pipelining: `bench/pipeline.py`", rec)
    return rc


def run(args: argparse.Namespace) -> int:
    """Every k's arm against the fake remote backend; prints the machine, the latencies and the table."""
    for name in ("sample", "fb", "optim", "refresh"):
        setattr(args, name, getattr(args, name) * args.scale)
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        parts = build_parts(args, Path(tmp))
        try:
            rows = [run_arm(k, args, parts, out) for k in ks]
        finally:
            parts["executor"].close()
            parts["verifier"].close()
    print(f"machine: {machine(with_torch=False)}")
    print(
        f"latencies (scale {args.scale:g}): sample {args.sample:.2f} s, forward_backward {args.fb:.2f} s, "
        f"optim {args.optim:.2f} s, refresh {args.refresh:.2f} s; {args.questions} questions x {args.group} per step, {args.steps} steps"
    )
    print(table(rows))
    calls = [int(r["exec_calls"]) for r in rows]
    print(
        f"sandbox executions per arm: {calls}; mean reward per arm: {[round(r['reward'], 2) for r in rows]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
