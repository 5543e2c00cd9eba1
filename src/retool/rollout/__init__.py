"""retool.rollout: the multi-turn sample -> execute -> observe state machine (SPEC §4, chapter 8.4.6).

Public names: ``AssistantTurn``, ``Trajectory``, ``STOP_REASONS``, ``ContinuityError``,
``run_group_rollouts``, ``request_seed``; ``score_final_answer`` (the default reward of a finished
trajectory) with its shapes ``TrajectoryScorer`` and ``VerifierLike``.
"""

from retool.rollout.engine import request_seed, run_group_rollouts
from retool.rollout.scoring import TrajectoryScorer, VerifierLike, score_final_answer
from retool.rollout.types import STOP_REASONS, AssistantTurn, ContinuityError, Trajectory

__all__ = [
    "STOP_REASONS",
    "AssistantTurn",
    "ContinuityError",
    "Trajectory",
    "TrajectoryScorer",
    "VerifierLike",
    "request_seed",
    "run_group_rollouts",
    "score_final_answer",
]
