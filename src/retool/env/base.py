"""The environment seam: a source of problems and how a finished trajectory is scored.

Shaped after tinker-cookbook's ``ProblemEnv`` / ``RLDataset``, cut to what this system varies: the
multi-turn tool loop itself is the rollout engine's (it is the same for every problem), so an
environment only says *which* problems there are (``problems(split)``), in which order training sees
them (``epoch(seed, epoch)``, a pure function so a resumed run draws the same ones), and how a finished
trajectory is scored (``score``; by default the chapter's +1 / -1 check of the final ``\\boxed{}``
answer). The trainer and the evaluator each take one; ``retool.env.registry`` builds them by name.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Literal

from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.rollout.scoring import VerifierLike, score_final_answer
from retool.rollout.types import Trajectory

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")


class EnvError(DataError):
    """An environment that cannot give problems: unknown name, empty split, unreadable source."""


class ProblemEnv(abc.ABC):
    """A source of problems and how a finished trajectory is scored.

    ``name`` is what the user called it (an env name or a path); ``source`` where its problems were
    read from (a resolved file, a Hub id), as an eval summary records it. ``shuffle``: whether each
    training epoch is a fresh permutation of the train split.
    """

    name: str = ""
    shuffle: bool = True

    @property
    @abc.abstractmethod
    def source(self) -> str: ...

    @abc.abstractmethod
    def problems(self, split: Split) -> list[Problem]:
        """Every problem of ``split`` in a fixed order; raises ``EnvError`` when there are none."""

    def epoch(self, seed: int, epoch: int) -> list[Problem]:
        """The training problems of one epoch, in training order: a pure function of ``(seed, epoch)``."""
        order = list(self.problems("train"))
        if self.shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    async def score(self, trajectory: Trajectory, verifier: VerifierLike) -> None:
        """Set the trajectory's reward (and ``correct``, ``valid_format``, ``answer``); default: the
        verifier's check of the final answer, -1 for any stop other than an answer."""
        await score_final_answer(trajectory, verifier)


class ProblemListEnv(ProblemEnv):
    """A fixed list of problems, the same for every split (tests, scripts, a caller's own data)."""

    def __init__(self, problems: Sequence[Problem], *, shuffle: bool = True, name: str = "list") -> None:
        self._problems = list(problems)
        self.shuffle = shuffle
        self.name = name

    @property
    def source(self) -> str:
        return self.name

    def problems(self, split: Split) -> list[Problem]:
        if not self._problems:
            raise EnvError(f"{self.name}: no problems")
        return list(self._problems)
