"""The synthetic task family as a problem source (``synthetic``): seeded train and held-out test splits,
sized by its options (``[data.options]``: ``SyntheticSourceOptions``).

Problems come from ``retool.data.synthetic``; the demo's cold-start SFT also needs each problem's kind
and canonical code, which ``tasks(split)`` keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from retool.data.problem import Problem
from retool.data.synthetic import Task, generate_tasks
from retool.env.source import ProblemSource, SourceError, Split

logger = logging.getLogger(__name__)


class SyntheticSourceOptions(BaseModel):
    """The synthetic source's options (``[data.options]``): problems per split, the share of hard ones,
    the kinds drawn (empty: all)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(default=2000, ge=1)
    test_count: int = Field(default=200, ge=1)
    hard_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    kinds: list[str] = Field(default_factory=list)


class TaskFamilySource(ProblemSource):
    """``count`` train and ``test_count`` held-out test problems of the family, seeded by ``seed``."""

    def __init__(
        self,
        *,
        count: int,
        test_count: int,
        seed: int = 0,
        hard_fraction: float = 0.5,
        kinds: Sequence[str] = (),
        shuffle: bool = True,
        name: str = "synthetic",
    ) -> None:
        self.name = name
        self.counts: dict[Split, int] = {"train": count, "test": test_count}
        self.seed = seed
        self.hard_fraction = hard_fraction
        self.kinds = tuple(kinds)
        self.shuffle = shuffle
        self._tasks: dict[Split, list[Task]] = {}

    @property
    def source(self) -> str:
        return self.name

    def tasks(self, split: Split) -> list[Task]:
        """The generated tasks of ``split`` (with kind, difficulty and canonical code)."""
        if split not in self._tasks:
            try:
                self._tasks[split] = generate_tasks(
                    self.counts[split],
                    seed=self.seed,
                    hard_fraction=self.hard_fraction,
                    kinds=self.kinds or None,
                    split=split,
                )
            except ValueError as exc:  # unknown kinds, bad fractions
                raise SourceError(f"synthetic tasks: {exc}") from exc
            logger.info("synthetic tasks: %d %s problems (seed %d)", self.counts[split], split, self.seed)
        return list(self._tasks[split])

    def problems(self, split: Split) -> list[Problem]:
        return [t.to_problem() for t in self.tasks(split)]
