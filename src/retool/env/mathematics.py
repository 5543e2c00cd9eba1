"""DeepMind Mathematics as a problem source (``mathematics``): train to train on, interpolate + extrapolate to
evaluate on, each answer checked as the benchmark means it.

The files are what ``retool data mathematics`` wrote (``retool.data.mathematics``). The train split is
checked against both test splits when first read (no train question is a test question; ``strict`` refuses
to start instead of filtering). A finished attempt is scored by the mathematics checker
(``retool.reward.mathematics``) in the verifier's worker processes: the reference it sends is a typed
reference naming the problem's module, so ``True`` / ``False``, choice letters, lists in any order and
factorised polynomials are judged by their form, not by math-verify's reading of LaTeX.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from retool.data.mathematics import TEST_SPLITS, MathSplit, module_of, normalise_question, read_split
from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.env.scoring import Attempt, Score, VerifierLike, score_final_answer
from retool.env.source import ProblemList, ProblemSource, SourceError, Split
from retool.reward.equivalence import typed_reference
from retool.reward.mathematics import KIND

logger = logging.getLogger(__name__)


def mathematics_reference(problem: Problem) -> str:
    """The reference a verifier checks ``problem``'s answers against: its module's form, its answer."""
    module = module_of(problem)
    if not module:
        raise SourceError(
            f"{problem.id}: not a DeepMind Mathematics problem (data_source {problem.data_source!r})"
        )
    return typed_reference(KIND, module, problem.answer)


def mathematics_category(problem: Problem) -> str:
    """A mathematics problem's category: its module (another problem's: its ``data_source``, or "all")."""
    return module_of(problem) or problem.data_source or "all"


async def score_mathematics(attempt: Attempt, verifier: VerifierLike) -> Score:
    """+1 / -1 from the mathematics checker; -1 for any stop other than an answer."""
    return await score_final_answer(attempt, verifier, mathematics_reference(attempt.problem))


class MathematicsSource(ProblemSource):
    """Generated DeepMind Mathematics: ``train`` to train on, ``test`` = ``test_splits`` (interpolate, then
    extrapolate) to evaluate on; ``modules`` keeps only those modules (every split)."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        shuffle: bool = True,
        strict: bool = True,
        modules: Sequence[str] = (),
        test_splits: Sequence[MathSplit] = TEST_SPLITS,
        name: str = "mathematics",
    ) -> None:
        self.name = name
        self.data_dir = data_dir
        self.shuffle = shuffle
        self.strict = strict
        self.modules = tuple(modules)
        self.test_splits = tuple(test_splits)
        self._splits: dict[Split, list[Problem]] = {}
        self.leaked: list[str] = []

    @property
    def source(self) -> str:
        return f"mathematics ({self.data_dir or 'default data dir'})"

    def _keep(self, problems: list[Problem]) -> list[Problem]:
        return [p for p in problems if module_of(p) in self.modules] if self.modules else problems

    def _read(self, split: Split) -> list[Problem]:
        try:
            if split == "test":
                return self._keep([p for s in self.test_splits for p in read_split(s, self.data_dir)])
            train = self._keep(read_split("train", self.data_dir))
        except DataError as exc:
            raise SourceError(str(exc)) from None
        if "test" not in self._splits:  # read (and kept) without problems()'s emptiness check
            self._splits["test"] = self._read("test")
        test = {normalise_question(p.question) for p in self._splits["test"]}
        self.leaked = [p.id for p in train if normalise_question(p.question) in test]
        if self.leaked and self.strict:
            raise SourceError(
                f"mathematics: {len(self.leaked)} train questions are test questions (first: {self.leaked[0]}); "
                "regenerate the data with `retool data mathematics`"
            )
        if self.leaked:
            logger.warning("mathematics: %d train problems are test questions, dropped", len(self.leaked))
            drop = set(self.leaked)
            train = [p for p in train if p.id not in drop]
        return train

    def problems(self, split: Split) -> list[Problem]:
        if split not in self._splits:
            self._splits[split] = self._read(split)
            logger.info("mathematics: %d %s problems", len(self._splits[split]), split)
        if not self._splits[split]:
            raise SourceError(f"mathematics: no {split} problems")
        return list(self._splits[split])

    def category(self, problem: Problem) -> str:
        return mathematics_category(problem)

    async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
        return await score_mathematics(attempt, verifier)


class MathematicsList(ProblemList):
    """A fixed list of DeepMind Mathematics problems (a held-out slice), scored by the mathematics checker."""

    def category(self, problem: Problem) -> str:
        return mathematics_category(problem)

    async def score(self, attempt: Attempt, verifier: VerifierLike) -> Score:
        return await score_mathematics(attempt, verifier)
