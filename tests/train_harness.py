"""Fault injection for training runs, from the test side: no production code reads a test switch.

- ``ParityScoredEnv`` wraps an environment and rewards a trajectory +1 / -1 by the parity of its sampled
  tokens' sum, so an untrained tiny model (which solves nothing) still gets mixed groups and real
  optimizer steps, which is what makes a resumed run's samples depend on restored weights.
- ``phase_signals`` builds a ``Trainer(on_phase=...)`` hook that sends SIGKILL / SIGINT to this process
  at ``PHASE:STEP`` points.
- Run as a script, it is ``retool`` itself with both injected into every ``Trainer`` the CLI builds::

      python tests/train_harness.py [--parity] [--kill-at PHASE:STEP] [--sigint-at PHASE:STEP] -- train ...
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from retool.env import ProblemEnv, Split
from retool.rollout import Trajectory, VerifierLike

logger = logging.getLogger("train_harness")


def parity_reward(traj: Trajectory) -> float:
    total = sum(sum(turn.completion_tokens) for turn in traj.turns)
    return 1.0 if total % 2 == 0 else -1.0


class ParityScoredEnv(ProblemEnv):
    """``inner``'s problems and scoring, with the reward replaced by the parity of the sampled tokens."""

    def __init__(self, inner: ProblemEnv) -> None:
        self.inner = inner
        self.name, self.shuffle = inner.name, inner.shuffle

    @property
    def source(self) -> str:
        return self.inner.source

    def problems(self, split: Split) -> list[Any]:
        return self.inner.problems(split)

    def epoch(self, seed: int, epoch: int) -> list[Any]:
        return self.inner.epoch(seed, epoch)

    async def score(self, trajectory: Trajectory, verifier: VerifierLike) -> None:
        await self.inner.score(trajectory, verifier)
        trajectory.reward = parity_reward(trajectory)


def _points(items: list[str]) -> set[tuple[str, int]]:
    out = set()
    for item in items:
        phase, _, step = item.partition(":")
        out.add((phase, int(step)))
    return out


def phase_signals(kill_at: list[str] = (), sigint_at: list[str] = ()) -> Callable[[str, int], None]:
    """An ``on_phase`` hook: SIGKILL at each ``kill_at`` point, SIGINT (once) at each ``sigint_at``."""
    kills, interrupts = _points(list(kill_at)), _points(list(sigint_at))

    def hook(phase: str, step: int) -> None:
        if (phase, step) in kills:
            logger.warning("harness: SIGKILL at %s:%d", phase, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if (phase, step) in interrupts:
            interrupts.discard((phase, step))
            logger.warning("harness: SIGINT at %s:%d", phase, step)
            os.kill(os.getpid(), signal.SIGINT)

    return hook


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--kill-at", action="append", default=[])
    parser.add_argument("--sigint-at", action="append", default=[])
    parser.add_argument("retool_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    retool_args = args.retool_args[1:] if args.retool_args[:1] == ["--"] else args.retool_args

    from retool.env import env_from_config
    from retool.train import loop

    class HarnessTrainer(loop.Trainer):
        def __init__(self, config: Any, run_dir: Any, resume: bool = False, **parts: Any) -> None:
            parts.setdefault("on_phase", phase_signals(args.kill_at, args.sigint_at))
            if args.parity:
                parts.setdefault("env", ParityScoredEnv(env_from_config(config)))
            super().__init__(config, run_dir, resume, **parts)

    loop.Trainer = HarnessTrainer  # type: ignore[misc]  # run_training looks the class up at call time
    from retool.cli import app

    app(retool_args, prog_name="retool")


if __name__ == "__main__":
    main(sys.argv[1:])
