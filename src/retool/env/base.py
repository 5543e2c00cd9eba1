"""The problem source: which problems there are, in which order, and the environments of a problem.

Shaped after tinker-cookbook's ``RLDataset`` / ``ProblemGroupBuilder``: a ``ProblemEnv`` says *which*
problems there are (``problems(split)``), in which order training sees them (``epoch(seed, epoch)``, a
pure function so a resumed run draws the same ones), how a finished attempt is scored (``score``; by
default the chapter's +1 / -1 check of the final ``\\boxed{}`` answer), and builds the per-trajectory
environments of one problem's group (``group_builder``; by default ReTool environments with the run's
tool, ``retool.env.retool``). The trainer and the evaluator each take one; ``retool.env.registry``
builds them by name.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Literal

from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.env.retool import ReToolGroupBuilder, ToolSetup
from retool.env.scoring import Attempt, Score, VerifierLike, score_final_answer
from retool.env.types import EnvGroupBuilder

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

    async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
        """The reward of a finished attempt (and ``correct``, ``valid_format``, ``answer``); default: the
        verifier's check of the final answer, -1 for any stop other than an answer."""
        return await score_final_answer(attempt, verifier)

    def group_builder(
        self, problem: Problem, setup: ToolSetup, group_size: int, problem_index: int = 0
    ) -> EnvGroupBuilder:
        """The environments of ``problem``'s group: ReTool environments with ``setup``'s tool (none:
        text-only), scored by ``score``. Override it for another tool or another interaction."""

        async def scorer(attempt: Attempt) -> Score:
            return await self.score(attempt, setup.verifier)

        return ReToolGroupBuilder(problem, setup, group_size, problem_index=problem_index, scorer=scorer)


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
