"""How a finished attempt is scored: the default (the chapter's reward) and the shapes a custom one has.

A ReTool environment scores its trajectory when it ends (inside the step that ends it, so scoring
overlaps the other trajectories' sampling) and returns the reward; nothing writes it in afterwards. The
default, ``score_final_answer``, is the chapter's reward (docs/spec.md §5): only an attempt that stopped with an
answer is checked, by the verifier, on the text of its last assistant turn; every other stop is -1. A
problem source (``retool.env.ProblemSource.score``) may score differently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from retool.data.problem import Problem
from retool.env.types import AssistantTurn


class AnswerScore(Protocol):
    """What a verifier returns for one answer (``retool.reward.RewardResult`` has this shape)."""

    @property
    def reward(self) -> float: ...
    @property
    def correct(self) -> bool: ...
    @property
    def valid_format(self) -> bool: ...
    @property
    def answer(self) -> str | None: ...
    @property
    def status(self) -> str: ...


class VerifierLike(Protocol):
    """The part of ``retool.reward.Verifier`` an environment needs."""

    async def ascore(self, text: str, ref: str) -> AnswerScore: ...


@dataclass(frozen=True)
class Attempt:
    """A finished attempt as a scorer sees it: the problem, why it stopped, its turns and final text."""

    problem: Problem
    stop_reason: str
    final_text: str
    turns: tuple[AssistantTurn, ...] = ()


@dataclass(frozen=True)
class Score:
    """The reward of one attempt and what the check found (``status``: the verifier's, "" if unchecked)."""

    reward: float
    correct: bool = False
    valid_format: bool = False
    answer: str | None = None
    status: str = ""


# The reward of one finished attempt (what an environment calls when its trajectory ends).
Scorer = Callable[[Attempt], Awaitable[Score]]

# A source's scoring rule: the reward of an attempt checked by a verifier (``ProblemSource.score``,
# ``score_final_answer``). A group builder holds the rule and its setup's verifier.
ScoreRule = Callable[[Attempt, VerifierLike], Awaitable[Score]]

# The score of an attempt the verifier did not check (any stop other than an answer) or could not.
UNCHECKED = Score(-1.0)


async def score_final_answer(attempt: Attempt, verifier: VerifierLike, reference: str | None = None) -> Score:
    """+1 / -1 from the verifier's check of the final answer against ``reference`` (default: the problem's
    answer; a source with its own checker passes a typed reference); -1 for any stop other than ``answer``."""
    if attempt.stop_reason != "answer":
        return UNCHECKED
    ref = attempt.problem.answer if reference is None else reference
    result = await verifier.ascore(attempt.final_text, ref)
    return Score(
        float(result.reward),
        bool(result.correct),
        bool(result.valid_format),
        result.answer,
        str(result.status),
    )
