"""Fault injection for training runs, from the test side: no production code reads a test switch or
offers a hook for one.

- ``ParityScoredSource`` wraps an environment and rewards an attempt +1 / -1 by the parity of its sampled
  tokens' sum, so an untrained tiny model (which solves nothing) still gets mixed groups and real
  optimizer steps, which is what makes a resumed run's samples depend on restored weights.
- ``PhaseSignals`` sends SIGKILL / SIGINT to this process at ``PHASE:STEP`` points, found from outside
  the trainer: ``step`` (a step starts), ``rollout`` (the first group sampled for a step's batch is done:
  the rollout function is wrapped, and the step read off the request's seed), ``optim`` (the backward
  passes are done, the optimizer step not yet taken: the training client is wrapped), ``checkpoint`` (the
  checkpoint is written but not yet moved into place), ``metrics`` (the step's metrics line is out).
  ``HarnessTrainer`` is a ``Trainer`` with those wrappers around its parts.
- Run as a script, it is ``retool`` itself with both injected into every ``Trainer`` the CLI builds::

      python tests/train_harness.py [--parity] [--kill-at PHASE:STEP] [--sigint-at PHASE:STEP] -- train ...
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from retool.backends.interface.types import AdamParams, OptimStepResult
from retool.config import Config
from retool.data.problem import Problem
from retool.env import Attempt, ProblemSource, Score, Split, VerifierLike
from retool.rollout import RolloutFn, RolloutRequest, Trajectory, run_rollout
from retool.train.checkpoint import CheckpointManager
from retool.train.loop import Trainer
from retool.train.sampling import rollout_seed, round_seed

logger = logging.getLogger("train_harness")

PHASES = ("step", "rollout", "optim", "checkpoint", "metrics")


def parity_reward(attempt: Attempt) -> float:
    total = sum(sum(turn.completion_tokens) for turn in attempt.turns)
    return 1.0 if total % 2 == 0 else -1.0


class ParityScoredSource(ProblemSource):
    """``inner``'s problems and scoring, with the reward replaced by the parity of the sampled tokens."""

    def __init__(self, inner: ProblemSource) -> None:
        self.inner = inner
        self.name, self.shuffle = inner.name, inner.shuffle

    @property
    def source(self) -> str:
        return self.inner.source

    def problems(self, split: Split) -> list[Problem]:
        return self.inner.problems(split)

    def epoch(self, seed: int, epoch: int) -> list[Problem]:
        return self.inner.epoch(seed, epoch)

    def category(self, problem: Problem) -> str:
        return self.inner.category(problem)

    async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
        score = await self.inner.score(attempt, verifier)
        return dataclasses.replace(score, reward=parity_reward(attempt))


def _points(items: Iterable[str]) -> set[tuple[str, int]]:
    out = set()
    for item in items:
        phase, _, step = item.partition(":")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (one of {', '.join(PHASES)})")
        out.add((phase, int(step)))
    return out


class PhaseSignals:
    """SIGKILL at each ``kill_at`` point, SIGINT (once) at each ``sigint_at`` point of a run of ``config``."""

    def __init__(self, config: Config, kill_at: Iterable[str] = (), sigint_at: Iterable[str] = ()) -> None:
        self.kills, self.interrupts = _points(kill_at), _points(sigint_at)
        # Which step a rollout request samples for: its seed is the step's round seed (tool mode) or that
        # seed ^ 0x5EED (the text-only share), for every round dynamic sampling may take.
        base = config.train.seed
        self.step_of_seed: dict[int, int] = {}
        for step in range(1, config.train.steps + 1):
            for round_index in range(config.filters.max_extra_rounds + 1):
                seed = round_seed(rollout_seed(base, step), round_index)
                self.step_of_seed.setdefault(seed, step)
                self.step_of_seed.setdefault(seed ^ 0x5EED, step)

    def fire(self, phase: str, step: int) -> None:
        if (phase, step) in self.kills:
            logger.warning("harness: SIGKILL at %s:%d", phase, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if (phase, step) in self.interrupts:
            self.interrupts.discard((phase, step))
            logger.warning("harness: SIGINT at %s:%d", phase, step)
            os.kill(os.getpid(), signal.SIGINT)

    def rollouts(self, inner: RolloutFn) -> RolloutFn:
        """``inner`` with the ``rollout`` point: after the first group of a step's batch is done."""
        fired: set[int] = set()

        async def rollout_fn(request: RolloutRequest) -> list[list[Trajectory]]:
            step = self.step_of_seed.get(request.seed)
            previous = request.on_trajectory

            def on_trajectory(trajectory: Trajectory) -> None:
                if previous is not None:
                    previous(trajectory)
                if step is not None and step not in fired:
                    fired.add(step)
                    self.fire("rollout", step)

            return await inner(dataclasses.replace(request, on_trajectory=on_trajectory))

        return rollout_fn


class _OptimSignal:
    """A training client whose optimizer step first passes the ``optim`` point of the current step."""

    def __init__(self, inner: Any, trainer: HarnessTrainer) -> None:
        self._inner, self._trainer = inner, trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def optim_step_async(self, adam: AdamParams, **kw: Any) -> OptimStepResult:
        self._trainer.signals.fire("optim", self._trainer.current_step)
        result: OptimStepResult = await self._inner.optim_step_async(adam, **kw)
        return result


class _SignallingCheckpoints(CheckpointManager):
    def __init__(self, root: Path, keep_last: int, signals: PhaseSignals) -> None:
        super().__init__(root, keep_last=keep_last)
        self.signals = signals

    def publish(self, tmp: Path, step: int) -> Path:
        self.signals.fire("checkpoint", step)  # written, not yet moved into place
        return super().publish(tmp, step)


class HarnessTrainer(Trainer):
    """A ``Trainer`` whose parts pass ``signals``' points (see the module docstring)."""

    def __init__(self, config: Config, run_dir: Any, resume: bool = False, **parts: Any) -> None:
        self.signals: PhaseSignals = parts.pop("signals")
        self.current_step = 0
        parts["rollout_fn"] = self.signals.rollouts(parts.get("rollout_fn", run_rollout))
        on_step = parts.get("on_step")

        def step_done(step: int, metrics: dict[str, Any]) -> None:
            if on_step is not None:
                on_step(step, metrics)
            self.signals.fire("metrics", step)

        parts["on_step"] = step_done
        super().__init__(config, run_dir, resume, **parts)
        root = self.checkpoints.root.parent
        self.checkpoints = _SignallingCheckpoints(root, config.checkpoint.keep_last, self.signals)

    def _build_components(self) -> Any:
        parts = super()._build_components()
        self.components = dataclasses.replace(parts, backend=_OptimSignal(parts.backend, self))
        return self.components

    async def _one_step(self, step: int, tracker: Any) -> dict[str, Any]:
        self.current_step = step
        self.signals.fire("step", step)
        return await super()._one_step(step, tracker)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--kill-at", action="append", default=[])
    parser.add_argument("--sigint-at", action="append", default=[])
    parser.add_argument("retool_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    retool_args = args.retool_args[1:] if args.retool_args[:1] == ["--"] else args.retool_args

    from retool.env import source_from_config
    from retool.train import loop

    class CliTrainer(HarnessTrainer):
        def __init__(self, config: Config, run_dir: Any, resume: bool = False, **parts: Any) -> None:
            parts.setdefault("signals", PhaseSignals(config, args.kill_at, args.sigint_at))
            if args.parity:
                parts.setdefault("source", ParityScoredSource(source_from_config(config)))
            super().__init__(config, run_dir, resume, **parts)

    loop.Trainer = CliTrainer  # type: ignore[misc]  # run_training looks the class up at call time
    from retool.cli import app

    app(retool_args, prog_name="retool")


if __name__ == "__main__":
    main(sys.argv[1:])
