"""Counting what a load kept and what it dropped, with line numbers, for logs and the CLI."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from retool.jsonl import JsonObject, JsonValue

logger = logging.getLogger(__name__)

# Each dropped row is logged on its own up to this many; the rest only in the summary (all numbers kept).
LOG_EACH_DROP = 20


@dataclass
class LoadReport:
    """What happened to every row of a source. ``dropped_lines`` maps a reason to 1-based line/row numbers."""

    source: str
    read: int = 0
    kept: int = 0
    duplicates: int = 0
    duplicate_answer_conflicts: int = 0
    renamed_ids: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    dropped_lines: dict[str, list[int]] = field(default_factory=dict)

    def drop(self, number: int, reason: str, detail: str = "") -> None:
        self.dropped[reason] += 1
        self.dropped_lines.setdefault(reason, []).append(number)
        total = sum(self.dropped.values())
        if total <= LOG_EACH_DROP:
            logger.warning(
                "%s: row %d skipped (%s)%s", self.source, number, reason, f": {detail}" if detail else ""
            )
        elif total == LOG_EACH_DROP + 1:
            logger.warning("%s: more rows skipped; the summary lists their numbers", self.source)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def log_summary(self) -> None:
        logger.info(
            "%s: read %d, kept %d, duplicates %d, dropped %d",
            self.source,
            self.read,
            self.kept,
            self.duplicates,
            self.dropped_total,
        )
        for reason, numbers in sorted(self.dropped_lines.items()):
            shown = ", ".join(map(str, numbers[:50])) + (" ..." if len(numbers) > 50 else "")
            logger.warning("%s: dropped %d (%s) at rows %s", self.source, len(numbers), reason, shown)

    def as_dict(self) -> JsonObject:
        return {
            "source": self.source,
            "read": self.read,
            "kept": self.kept,
            "duplicates": self.duplicates,
            "duplicate_answer_conflicts": self.duplicate_answer_conflicts,
            "renamed_ids": self.renamed_ids,
            "dropped": dict(sorted(self.dropped.items())),
            "dropped_lines": {k: list[JsonValue](v) for k, v in sorted(self.dropped_lines.items())},
        }


@dataclass
class PrepareReport:
    """Result of :func:`retool.data.prepare_dapo`: the load counts plus the split written to disk."""

    load: LoadReport
    train: int
    dev: int
    train_file: Path
    dev_file: Path

    # Shortcuts so callers need not reach into ``load``.
    @property
    def read(self) -> int:
        return self.load.read

    @property
    def kept(self) -> int:
        return self.load.kept

    @property
    def duplicates(self) -> int:
        return self.load.duplicates

    @property
    def dropped(self) -> dict[str, int]:
        return dict(self.load.dropped)

    def as_dict(self) -> JsonObject:
        return {
            **self.load.as_dict(),
            "train": self.train,
            "dev": self.dev,
            "train_file": str(self.train_file),
            "dev_file": str(self.dev_file),
        }
