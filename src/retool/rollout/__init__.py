"""retool.rollout: the scheduler that samples many environments with one policy (docs/spec.md §4).

Public names: ``run_rollout`` (the one rollout function; ``retool.rollout.engine``, which imports no
environment kind) with its ``RolloutRequest``, shape ``RolloutFn`` and the ``Policy`` it samples with;
``request_seed``; the immutable records ``Trajectory`` / ``Transition`` (``AssistantTurn``,
``STOP_REASONS``, ``ContinuityError`` come from ``retool.env.types``); ``retool.rollout.records``: the
trajectory record both training and evaluation write. A problem source's groups in one mode
(``GroupRollouts``, ``run_group_rollouts``) are sampled through ``run_rollout`` by
``retool.train.sampling``, the one module for groups and steps.
"""

from retool.rollout.engine import Policy, RolloutFn, RolloutRequest, request_seed, run_rollout
from retool.rollout.types import STOP_REASONS, AssistantTurn, ContinuityError, Trajectory, Transition

__all__ = [
    "STOP_REASONS",
    "AssistantTurn",
    "ContinuityError",
    "Policy",
    "RolloutFn",
    "RolloutRequest",
    "Trajectory",
    "Transition",
    "request_seed",
    "run_rollout",
]
