"""One expert-iteration round (``retool.train.expert_iteration``) a chunk of problems at a time: a chunk's
sampling with a progress line while it runs, the round's files, and how a round stopped midway is taken up: after each chunk of problems the sample lines are flushed, the kept traces rewritten and
``progress.json`` written last, saying how much of both a resume takes; a resume checks that the files
hold that much (else the round is sampled from its start) and cuts the sample lines a stopped chunk wrote.
Every file is replaced whole (written beside, then renamed), so a kill mid-write leaves the last one."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from retool.backends.interface.types import Sample, SamplingParams
from retool.data.problem import Problem
from retool.jsonl import JsonObject
from retool.rollout.engine import Policy
from retool.rollout.types import Trajectory
from retool.train.sampling import GroupRollouts
from retool.train.sft import SFTExample, read_examples, write_examples

logger = logging.getLogger(__name__)

REPORT_FILE = "report.json"
KEPT_FILE = "kept.jsonl"
SAMPLES_FILE = "samples.jsonl"
PROGRESS_FILE = "progress.json"


@dataclass
class RoundProgress:
    """What a round's finished chunks did: how many chunks, its report's counts so far (``RoundReport``'s
    dict), the traces kept and the problems attempted."""

    chunks: int
    report: JsonObject
    kept: list[SFTExample]
    attempted: set[str]


def write_progress(folder: Path, progress: RoundProgress, samples: IO[str], chunk_problems: int) -> None:
    """After a chunk: ``samples`` flushed, the kept traces, then the counts that say how much of both."""
    samples.flush()
    write_kept(progress.kept, folder / KEPT_FILE)
    record: JsonObject = {
        "chunk_problems": chunk_problems,
        "chunks": progress.chunks,
        "samples_bytes": samples.tell(),
        "kept": len(progress.kept),
        "attempted": list(sorted(progress.attempted)),
        "report": progress.report,
    }
    write_json(folder / PROGRESS_FILE, record)


def read_progress(folder: Path, chunk_problems: int, problems: int) -> RoundProgress | None:
    """A round stopped midway, its sample lines cut back to what its progress counted. None (sample the
    round from its start): no progress, chunks of another size or another number of problems, or files
    that do not hold what the progress counted."""
    path = folder / PROGRESS_FILE
    if not path.is_file():
        return None
    samples = folder / SAMPLES_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        n_kept, size = int(record["kept"]), int(record["samples_bytes"])
        kept = read_examples(folder / KEPT_FILE) if n_kept else []
        usable = (
            int(record["chunk_problems"]) == chunk_problems
            and int(record["report"]["problems"]) == problems
            and len(kept) >= n_kept
            and samples.is_file()
            and samples.stat().st_size >= size
        )
        progress = RoundProgress(
            int(record["chunks"]),
            dict(record["report"]),
            kept[:n_kept],
            {str(a) for a in record["attempted"]},
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning(
            "expert iteration: %s is unreadable (%s); sampling the round from its start", path, exc
        )
        return None
    if not usable:
        logger.warning(
            "expert iteration: %s does not match the round's files; sampling it from its start", path
        )
        return None
    with samples.open("r+b") as fh:  # lines of a chunk stopped after the last progress: sampled again
        fh.truncate(size)
    return progress


def write_kept(examples: Sequence[SFTExample], path: Path) -> None:
    partial = path.with_suffix(".partial")
    write_examples(examples, partial)
    partial.replace(path)


def write_json(path: Path, record: JsonObject) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)


class ChunkTicker:
    """A progress line every ``every`` seconds while a chunk samples. Groups finish together late in a
    chunk (every group's turns interleave in the sampler), so it counts the turns sampled as they come
    back, not only the finished trajectories: a chunk of a few hundred problems takes minutes on a CPU,
    and a silent terminal for that long reads as a hang."""

    def __init__(self, policy: Policy, total: int, every: float = 30.0) -> None:
        self.policy, self.total, self.every = policy, total, every
        self.done = self.turns = self.tokens = 0
        self.started = time.perf_counter()

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        """The policy's ``sample_async``, counted."""
        samples = await self.policy.sample_async(prompt_tokens, num_samples, params)
        self.turns += len(samples)
        self.tokens += sum(len(s.tokens) for s in samples)
        return samples

    def __getattr__(self, name: str) -> object:  # anything else of the policy (its version...) as it is
        return getattr(self.policy, name)

    def __call__(self, traj: Trajectory) -> None:
        self.done += 1

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        return (
            f"expert iteration: {self.done}/{self.total} trajectories of this chunk finished, "
            f"{self.turns} turns ({self.tokens} tokens, {self.tokens / max(elapsed, 1e-9):.0f} tok/s) "
            f"sampled in {elapsed / 60:.1f} min"
        )

    async def report(self) -> None:
        """Log ``line`` every ``every`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.every)
            logger.info("%s", self.line())


async def sample_chunk(
    sampler: GroupRollouts,
    policy: Policy,
    problems: Sequence[Problem],
    size: int,
    room: int | None,
    seed: int,
) -> list[list[Trajectory]]:
    """``size`` attempts at each problem, as many as ``room`` trajectories allow (the last group smaller)."""
    whole = len(problems) if room is None else min(len(problems), room // size)
    ticker = ChunkTicker(policy, whole * size)
    reporter = asyncio.create_task(ticker.report())
    try:
        groups = await sampler.sample(
            problems[:whole], ticker, group_size=size, seed=seed, on_trajectory=ticker
        )
        rest = 0 if room is None else min(room - whole * size, size)
        if rest > 0 and whole < len(problems):
            last = problems[whole]
            # Its own seed: the problem is index 0 of this request, as the first whole group was.
            groups += await sampler.sample([last], ticker, group_size=rest, seed=seed ^ 0x7A11)
    finally:
        reporter.cancel()
    return groups
