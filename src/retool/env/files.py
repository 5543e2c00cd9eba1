"""Problem sources over stored problems: a local file or Hub dataset, the named evaluation sets, and DAPO.

Every one reads through ``retool.data`` (which strips, validates and counts rows) and keeps what it read,
so a split is loaded once per run. Scoring is the default check of the final answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from retool.data.dapo import DAPO_HUB_ID, load_dapo, split_dev
from retool.data.evalsets import load_problems
from retool.data.paths import data_dir as resolve_data_dir
from retool.data.problem import Problem
from retool.env.source import ProblemSource, SourceError, Split

logger = logging.getLogger(__name__)

# Files `retool prepare dapo` writes into its output folder.
PREPARED_TRAIN, PREPARED_DEV = "train.jsonl", "dev.jsonl"


def data_dir_of(data_dir: str | Path | None) -> Path:
    """The folder named sets are looked for in first: the given one, else ``$RETOOL_DATA_DIR``, else the
    user cache (``retool.data.paths``: where ``retool data fetch`` writes)."""
    return resolve_data_dir(data_dir)


def _load(source: str, fields: Mapping[str, str]) -> list[Problem]:
    try:
        problems = load_problems(source, **fields)
    except (OSError, ValueError, LookupError) as exc:  # a DataError (missing file, bad name) passes as is
        raise SourceError(f"cannot load problems from {source!r}: {exc}") from exc
    if not problems:
        raise SourceError(f"{source}: no problems")
    return problems


class FileSource(ProblemSource):
    """A JSONL / JSON / parquet file or a Hub dataset id (``retool.data.load_problems``); one split:
    train and test are the same problems. ``fields`` names the question / answer / id columns."""

    def __init__(
        self, path: str, fields: Mapping[str, str] | None = None, *, shuffle: bool = True, name: str = ""
    ) -> None:
        self.name = name or path
        self.path = path
        self.fields = dict(fields or {})
        self.shuffle = shuffle
        self._problems: list[Problem] | None = None

    @property
    def source(self) -> str:
        return self.path

    def problems(self, split: Split) -> list[Problem]:
        if self._problems is None:
            self._problems = _load(self.path, self.fields)
            logger.info("%s: %d problems", self.path, len(self._problems))
        return list(self._problems)


# MATH-500's own column names, for a local copy of the raw file.
_LOCAL_FIELDS = {"math500": {"question_field": "problem", "id_field": "unique_id"}}


def named_set_source(
    name: str, data_dir: str | Path | None, fields: Mapping[str, str] | None = None, *, shuffle: bool = True
) -> FileSource:
    """An evaluation set by name (aime2025, aime2024, math500): ``<data_dir>/<name>.jsonl`` (or
    ``.parquet``) when present, else the Hub. Explicit ``fields`` override the set's own column names."""
    folder = data_dir_of(data_dir)
    path, own = name, {}
    for ext in ("jsonl", "parquet"):
        candidate = folder / f"{name}.{ext}"
        if candidate.is_file():
            path, own = str(candidate), dict(_LOCAL_FIELDS.get(name, {}))
            break
    return FileSource(path, {**own, **(fields or {})}, shuffle=shuffle, name=name)


class DapoSource(ProblemSource):
    """DAPO-Math-17k with its dev split: a folder ``retool prepare dapo`` wrote (``train.jsonl`` /
    ``dev.jsonl``), or the raw dataset (a local file or Hub id), split in memory by the same rule."""

    def __init__(self, source: str, *, shuffle: bool = True, name: str = "dapo") -> None:
        self.name = name
        self._source = source
        self.shuffle = shuffle
        self._splits: dict[Split, list[Problem]] | None = None

    @property
    def source(self) -> str:
        return self._source

    @staticmethod
    def is_prepared(folder: str | Path) -> bool:
        return (Path(folder) / PREPARED_TRAIN).is_file() and (Path(folder) / PREPARED_DEV).is_file()

    def _read(self) -> dict[Split, list[Problem]]:
        if self.is_prepared(self._source):
            folder = Path(self._source)
            return {
                "train": _load(str(folder / PREPARED_TRAIN), {}),
                "test": _load(str(folder / PREPARED_DEV), {}),
            }
        problems, report = load_dapo(self._source)
        # Held out by the same rule as `retool prepare dapo` (its default size and seed).
        train, dev = split_dev(problems, source=report.source)
        return {"train": train, "test": dev}

    def problems(self, split: Split) -> list[Problem]:
        if self._splits is None:
            self._splits = self._read()
            logger.info(
                "DAPO from %s: %d train, %d dev problems",
                self._source,
                len(self._splits["train"]),
                len(self._splits["test"]),
            )
        if not self._splits[split]:
            raise SourceError(f"DAPO from {self._source}: no {split} problems")
        return list(self._splits[split])


def dapo_source(data_dir: str | Path | None, *, shuffle: bool = True) -> DapoSource:
    """DAPO by name: ``<data_dir>/dapo`` when ``retool data fetch dapo`` (or ``retool prepare dapo``) wrote
    it there, else the Hub."""
    folder = data_dir_of(data_dir)
    if DapoSource.is_prepared(folder / "dapo"):
        return DapoSource(str(folder / "dapo"), shuffle=shuffle)
    return DapoSource(DAPO_HUB_ID, shuffle=shuffle)
