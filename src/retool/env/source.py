"""The problem source (the dataset role): which problems there are, in which order, how an attempt is scored.

Shaped after tinker-cookbook's ``RLDataset``: a ``ProblemSource`` says *which* problems there are
(``problems(split)``), in which order training sees them (``epoch(seed, epoch)``, a pure function so a
resumed run draws the same ones), which category each belongs to (``category``: what per-category pass
rates and the pass-rate selection group by) and how a finished attempt is scored (``score``; by default the
chapter's +1 / -1 check of the final ``\\boxed{}`` answer). It hands out the groups of a batch of
problems (``group_builders(problems, setup, n)``, the shape of ``RLDataset.get_batch``): one
``EnvGroupBuilder`` per problem, made by the run's ``EnvSetup`` (what every environment of one mode
shares; ``retool.env.retool.ToolSetup`` makes ReTool environments with its tool) and given the source's
scoring rule, so each builder owns its environments and their scoring and nothing calls back into the
source. A source overrides ``score`` for another reward and ``group_builder`` (one problem's group) to
wrap or replace the environments.

This module knows no environment kind: it imports the seam (``retool.env.types``) and the scoring shapes
only. ``retool.env.registry`` builds sources by name; the trainer and the evaluator each take one.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Literal, Protocol

from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.env.scoring import Attempt, Score, ScoreRule, VerifierLike, score_final_answer
from retool.env.types import EnvGroupBuilder

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")


class SourceError(DataError):
    """A source that cannot give problems: unknown name, empty split, unreadable file."""


class EnvSetup(Protocol):
    """What the environments of one mode share, and the kind of environment they are: a setup makes a
    problem's group bound to itself and scored by ``score`` with its verifier (``retool.env.retool.ToolSetup``:
    ReTool environments)."""

    @property
    def verifier(self) -> VerifierLike: ...

    def group_builder(
        self, problem: Problem, group_size: int, problem_index: int = 0, score: ScoreRule | None = None
    ) -> EnvGroupBuilder: ...


class ProblemSource(abc.ABC):
    """A source of problems and how a finished attempt is scored.

    ``name`` is what the user called it (a registered name or a path); ``source`` where its problems were
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
        """Every problem of ``split`` in a fixed order; raises ``SourceError`` when there are none."""

    def epoch(self, seed: int, epoch: int) -> list[Problem]:
        """The training problems of one epoch, in training order: a pure function of ``(seed, epoch)``."""
        order = list(self.problems("train"))
        if self.shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    def category(self, problem: Problem) -> str:
        """The category of ``problem``, for per-category pass rates and the pass-rate selection
        (``data.selection``): by default its ``data_source``, ``"all"`` when it has none."""
        return problem.data_source or "all"

    async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
        """The reward of a finished attempt (and ``correct``, ``valid_format``, ``answer``); default: the
        verifier's check of the final answer, -1 for any stop other than an answer."""
        return await score_final_answer(attempt, verifier)

    def group_builders(
        self, problems: Sequence[Problem], setup: EnvSetup, group_size: int
    ) -> list[EnvGroupBuilder]:
        """The groups of one batch of problems (tinker-cookbook's ``RLDataset.get_batch``): one builder per
        problem, in order, its index its position in the batch (``group_builder``)."""
        return [self.group_builder(problem, setup, group_size, i) for i, problem in enumerate(problems)]

    def group_builder(
        self, problem: Problem, setup: EnvSetup, group_size: int, problem_index: int = 0
    ) -> EnvGroupBuilder:
        """The environments of ``problem``'s group: ``setup``'s kind (ReTool environments with its tool,
        none: text-only), holding this source's rule ``score`` and the setup's verifier. Override it to
        wrap or replace them."""
        return setup.group_builder(problem, group_size, problem_index, self.score)


class ProblemList(ProblemSource):
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
            raise SourceError(f"{self.name}: no problems")
        return list(self._problems)
