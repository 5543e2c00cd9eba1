"""retool.reward: the outcome reward of a final answer (chapter 8.4.4).

Owns answer extraction (:func:`extract_last_boxed`), math-verify equivalence (:func:`answers_equivalent`,
in-process) and the bounded :class:`Verifier` (worker processes, hard per-check timeout) that training and
evaluation use, plus :func:`score_answer` (+1 / -1 on the last 300 characters).
"""

from retool.reward.equivalence import answers_equivalent, check_equivalence
from retool.reward.extract import extract_last_boxed
from retool.reward.verifier import (
    ANSWER_WINDOW_CHARS,
    RewardResult,
    Verifier,
    VerifierStats,
    VerifyOutcome,
    score_answer,
)

__all__ = [
    "ANSWER_WINDOW_CHARS",
    "RewardResult",
    "Verifier",
    "VerifierStats",
    "VerifyOutcome",
    "answers_equivalent",
    "check_equivalence",
    "extract_last_boxed",
    "score_answer",
]
