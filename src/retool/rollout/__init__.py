"""retool.rollout: the scheduler that samples many environments with one policy (docs/spec.md §4).

Public names: ``run_rollout`` (the one rollout function; ``retool.rollout.engine``, which imports no
environment kind) with its ``RolloutRequest``, shape ``RolloutFn`` and the ``Policy`` it samples with;
``GroupSampler`` (``retool.rollout.groups``: a problem source's groups in one mode, the one assembly of
environments and request the trainer and the evaluator share) and ``run_group_rollouts`` (the default
ReTool environments from loose parts, for scripts and tests); ``request_seed``; the immutable records
``Trajectory`` / ``Transition`` (``AssistantTurn``, ``STOP_REASONS``, ``ContinuityError`` come from
``retool.env.types``); ``retool.rollout.records``: the trajectory record both training and evaluation
write.
"""

from retool.rollout.engine import Policy, RolloutFn, RolloutRequest, request_seed, run_rollout
from retool.rollout.groups import GroupSampler, run_group_rollouts
from retool.rollout.types import STOP_REASONS, AssistantTurn, ContinuityError, Trajectory, Transition

__all__ = [
    "STOP_REASONS",
    "AssistantTurn",
    "ContinuityError",
    "GroupSampler",
    "Policy",
    "RolloutFn",
    "RolloutRequest",
    "Trajectory",
    "Transition",
    "request_seed",
    "run_group_rollouts",
    "run_rollout",
]
