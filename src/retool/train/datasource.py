"""The order training sees its problems in, with a resumable position.

A data source is a function ``(seed, epoch) -> Iterable[Problem]``: the problems of one epoch, in the
order to train on them (a problem source's ``ProblemSource.epoch``, see ``retool.env``). ``ProblemStream``
walks epochs one after another and remembers ``(epoch, index)``; resuming rebuilds the epoch's iterable
from the same seed and skips ``index`` problems, so no problem is repeated or skipped across a restart.
``ProblemFeed`` is what a step's sampling draws from: problems sent back for sampling again first (see
``retool.train.ahead``), then the run's ``ProblemOrder``: the epoch stream, or the pass-rate selector
(``retool.train.selection``), which also sees every group sampled (``observe``) and hands a checkpoint its
state (``snapshot``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from retool.data.problem import Problem
from retool.errors import UserError
from retool.jsonl import JsonObject
from retool.rollout.types import Trajectory

DataSource = Callable[[int, int], Iterable[Problem]]


class DataSourceError(UserError, ValueError):
    """A stream that cannot continue (no problems, or a resume position past its epoch)."""


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0  # problems of `epoch` already handed out
    seed: int = 0  # the shuffle seed

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, int]) -> DataPosition:
        return cls(epoch=int(d["epoch"]), index=int(d["index"]), seed=int(d["seed"]))


@dataclass(frozen=True)
class OrderSnapshot:
    """An adaptive order's state after a batch drew its problems and saw its groups: what a checkpoint
    stores to resume it (plain JSON), and its ``selection/*`` metrics for the step's record."""

    state: JsonObject
    metrics: dict[str, float]


class ProblemOrder(Protocol):
    """Which problems training draws next: ``ProblemStream`` (epoch order) or
    ``retool.train.selection.PassRateSelector``."""

    @property
    def position(self) -> DataPosition: ...

    def next_batch(self, n: int) -> list[Problem]: ...

    def observe(self, problems: Sequence[Problem], groups: Sequence[Sequence[Trajectory]]) -> None: ...

    def group_size(self, problem: Problem, default: int) -> int: ...

    def snapshot(self) -> OrderSnapshot | None: ...


class ProblemStream:
    """Endless, deterministic stream of problems over the epochs of a source."""

    def __init__(self, source: DataSource, seed: int = 0, position: DataPosition | None = None) -> None:
        self._source = source
        self.position = DataPosition(seed=seed) if position is None else DataPosition(**asdict(position))
        self._iter: Iterator[Problem] | None = None

    def _open_epoch(self) -> None:
        pos = self.position
        self._iter = iter(self._source(pos.seed, pos.epoch))
        skipped = sum(1 for _ in itertools.islice(self._iter, pos.index))
        if skipped < pos.index:
            raise DataSourceError(
                f"cannot resume at epoch {pos.epoch} index {pos.index}: the epoch has only {skipped} problems"
            )

    def next_batch(self, n: int) -> list[Problem]:
        """The next ``n`` problems, rolling over into the next epoch when one runs out."""
        batch: list[Problem] = []
        empty_epochs = 0
        while len(batch) < n:
            if self._iter is None:
                self._open_epoch()
            assert self._iter is not None
            item = next(self._iter, None)
            if item is None:
                if self.position.index == 0:
                    empty_epochs += 1
                    if empty_epochs > 1:
                        raise DataSourceError("the data source yields no problems")
                self.position = DataPosition(epoch=self.position.epoch + 1, index=0, seed=self.position.seed)
                self._iter = None
                continue
            batch.append(item)
            self.position.index += 1
        return batch

    def observe(self, problems: Sequence[Problem], groups: Sequence[Sequence[Trajectory]]) -> None:
        """Epoch order does not depend on how the groups went."""

    def group_size(self, problem: Problem, default: int) -> int:
        """Every problem's group has the run's size."""
        return default

    def snapshot(self) -> OrderSnapshot | None:
        """None: the position alone resumes an epoch stream."""
        return None


class ProblemFeed:
    """The problems batches draw, in order: requeued problems first, then the run's order."""

    def __init__(self, order: ProblemOrder, replay: Sequence[Problem] = ()) -> None:
        self.order = order
        self.replay: collections.deque[Problem] = collections.deque(replay)

    def next_batch(self, n: int) -> list[Problem]:
        out: list[Problem] = []
        while self.replay and len(out) < n:
            out.append(self.replay.popleft())
        if len(out) < n:
            out.extend(self.order.next_batch(n - len(out)))
        return out

    def observe(self, problems: Sequence[Problem], groups: Sequence[Sequence[Trajectory]]) -> None:
        """Every group sampled from ``problems`` (one per problem, in order), for an order that adapts."""
        self.order.observe(problems, groups)

    def group_size(self, problem: Problem, default: int) -> int:
        """How many attempts ``problem``'s group gets (``default``: ``rollout.group_size``)."""
        return self.order.group_size(problem, default)

    @property
    def position(self) -> DataPosition:
        """The order's position (a copy)."""
        return DataPosition(**asdict(self.order.position))

    def snapshot(self) -> OrderSnapshot | None:
        """The order's state now (None for epoch order)."""
        return self.order.snapshot()
