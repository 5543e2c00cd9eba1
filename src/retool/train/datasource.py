"""Where training problems come from, in a deterministic order with a resumable position.

A data source is a function ``(seed, epoch) -> Iterable[Problem]``: the problems of one epoch, in the
order to train on them. ``ProblemStream`` walks epochs one after another and remembers ``(epoch,
index)``; resuming rebuilds the epoch's iterable from the same seed and skips ``index`` problems, so
no problem is repeated or skipped across a restart. Built-in sources: a JSONL / parquet file (via
``retool.data.load_problems``), shuffled per epoch with ``random.Random(seed + epoch)``; and
``"tasks"``, the synthetic task family of ``retool.tasks``. Register more with ``register_source``.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from retool.config import Config, DataConfig
from retool.data.problem import Problem

logger = logging.getLogger(__name__)

DataSource = Callable[[int, int], Iterable[Problem]]
SourceFactory = Callable[[DataConfig], DataSource]

_FACTORIES: dict[str, SourceFactory] = {}


class DataSourceError(ValueError):
    """No data to train on, or an unknown source; the message says which."""


def register_source(name: str, factory: SourceFactory) -> None:
    """Make ``data.train_path = name`` build its source with ``factory(data_config)``."""
    _FACTORIES[name] = factory


def list_source(problems: Sequence[Problem], shuffle: bool = True) -> DataSource:
    """A source over a fixed list: every epoch is a permutation seeded by ``seed + epoch``."""
    items = list(problems)
    if not items:
        raise DataSourceError("the training set is empty")

    def epoch_order(seed: int, epoch: int) -> Iterable[Problem]:
        order = list(items)
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    return epoch_order


def _file_source(cfg: DataConfig) -> DataSource:
    from retool.data import DataError, load_problems  # owned by the data stage

    try:
        problems = load_problems(
            cfg.train_path, question_field=cfg.question_field, answer_field=cfg.answer_field
        )
    except DataError as exc:
        raise DataSourceError(str(exc)) from exc
    except (OSError, ValueError, LookupError) as exc:
        raise DataSourceError(f"cannot load training data {cfg.train_path!r}: {exc}") from exc
    logger.info("training set %s: %d problems", cfg.train_path, len(problems))
    return list_source(problems, shuffle=cfg.shuffle)


def _tasks_source(cfg: DataConfig) -> DataSource:
    """The synthetic task family (``retool.tasks``): its train split, reshuffled every epoch."""
    from retool.tasks.family import generate_problems  # owned by the tasks stage

    problems = generate_problems(
        cfg.task_count, seed=cfg.seed, hard_fraction=cfg.task_hard_fraction, split="train"
    )
    logger.info("synthetic tasks: %d training problems (seed %d)", len(problems), cfg.seed)
    return list_source(problems, shuffle=cfg.shuffle)


register_source("tasks", _tasks_source)


def make_source(config: Config | DataConfig) -> DataSource:
    cfg = config.data if isinstance(config, Config) else config
    if not cfg.train_path:
        raise DataSourceError("data.train_path is empty: set it to a JSONL file or to 'tasks'")
    factory = _FACTORIES.get(cfg.train_path)
    if factory is not None:
        return factory(cfg)
    return _file_source(cfg)


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0  # problems of `epoch` already handed out
    seed: int = 0  # the shuffle seed

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        return cls(epoch=int(d["epoch"]), index=int(d["index"]), seed=int(d["seed"]))


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
