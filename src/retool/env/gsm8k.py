"""GSM8K as a problem source (``gsm8k``): the train split for RL and SFT, the test split for evaluation only.

Both splits are read from the local files (``retool.data.gsm8k``). The train split is checked against the
test split when it is first read: a train problem whose normalised question is a test question is never
trained on, and with ``strict`` the source refuses to start instead of filtering it out.
"""

from __future__ import annotations

import logging
from pathlib import Path

from retool.data.gsm8k import check_no_test_leak, gsm8k_split, overlapping_ids
from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.env.source import ProblemSource, SourceError, Split

logger = logging.getLogger(__name__)


class Gsm8kSource(ProblemSource):
    """GSM8K's two files: ``train`` (7,473 problems) to train on, ``test`` (1,319) to evaluate on."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        shuffle: bool = True,
        strict: bool = False,
        name: str = "gsm8k",
    ) -> None:
        self.name = name
        self.data_dir = data_dir
        self.shuffle = shuffle
        self.strict = strict
        self._splits: dict[Split, list[Problem]] = {}
        self.leaked: list[str] = []  # ids of train problems dropped as test questions

    @property
    def source(self) -> str:
        return f"gsm8k ({self.data_dir or 'default data dir'})"

    def _read(self, split: Split) -> list[Problem]:
        try:
            problems = gsm8k_split(split, self.data_dir)
        except DataError as exc:
            raise SourceError(str(exc)) from None
        if split == "train":
            test = self.problems("test")
            if self.strict:
                check_no_test_leak(problems, test)
            self.leaked = overlapping_ids(problems, test)
            if self.leaked:
                logger.warning("gsm8k: %d train problems are test questions, dropped", len(self.leaked))
                drop = set(self.leaked)
                problems = [p for p in problems if p.id not in drop]
        return problems

    def problems(self, split: Split) -> list[Problem]:
        if split not in self._splits:
            self._splits[split] = self._read(split)
            logger.info("gsm8k: %d %s problems", len(self._splits[split]), split)
        if not self._splits[split]:
            raise SourceError(f"gsm8k: no {split} problems")
        return list(self._splits[split])
