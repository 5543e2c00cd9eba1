"""What a rollout produces: an immutable record of one trajectory's transitions and how it ended.

A ``Transition`` is one step of an environment (``retool.env.Env``): the assistant turn (exactly what
the sampler saw and emitted, never re-encoded text, so the training stage can rebuild the token
sequence), the step's reward and whether it ended the trajectory. A ``Trajectory`` adds the
environment's ``Outcome`` as the environment reported it (why it stopped, the verifier's check; a ReTool
environment's also its tool calls, results and observations), the total reward (the steps' rewards plus
the group's) and the sampling time. It is built once, by the engine, when the trajectory ends; nothing
writes into it afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from retool.data.problem import Problem
from retool.env.types import STOP_REASONS, AssistantTurn, ContinuityError, Outcome, check_continuity

__all__ = [
    "STOP_REASONS",
    "AssistantTurn",
    "ContinuityError",
    "NotAPrefixError",
    "Trajectory",
    "Transition",
    "trajectory_tokens",
]


@dataclass(frozen=True)
class Transition:
    """One step: the turn the policy took, the reward the environment returned for it, whether it ended."""

    turn: AssistantTurn
    reward: float
    done: bool
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One branch of one question, from the first prompt to its environment's outcome and reward.

    ``reward`` has no default: a trajectory is only ever built with the reward its environment returned.
    ``outcome`` is the environment's own report (``Env.outcome()``: why it stopped, how it was scored; a
    ReTool environment's carries its tool calls, ``retool.env.retool.ReToolOutcome``).
    """

    problem: Problem
    group_index: int
    problem_index: int = 0
    transitions: tuple[Transition, ...] = ()
    reward: float
    outcome: Outcome
    sample_seconds: float = 0.0  # time spent in sampler requests that produced this trajectory's turns
    # The policy version (optimizer steps taken) of the weights that sampled it; set by the trainer, which
    # may train on it a few versions later (``train.max_steps_off_policy``). None outside training.
    policy_version: int | None = None

    def with_policy_version(self, version: int | None) -> Trajectory:
        return dataclasses.replace(self, policy_version=version)

    @property
    def turns(self) -> tuple[AssistantTurn, ...]:
        return tuple(t.turn for t in self.transitions)

    # -- token views -------------------------------------------------------------------------------
    def full_tokens(self) -> list[int]:
        """The whole trainable sequence: the last turn's prompt followed by its completion.

        Every earlier turn is a prefix of it (checked by ``check_continuity``), so this is the sequence
        the trainer shifts by one. Empty when the trajectory never sampled (e.g. the prompt did not fit).
        """
        if not self.turns:
            return []
        last = self.turns[-1]
        return [*last.prompt_tokens, *last.completion_tokens]

    def check_continuity(self) -> None:
        """Raise ``ContinuityError`` unless each prompt starts with the previous prompt + completion."""
        check_continuity(self.turns, f"problem {self.problem.id!r} branch {self.group_index}")

    # -- metrics -----------------------------------------------------------------------------------
    @property
    def completion_token_count(self) -> int:
        """Tokens the model generated over all turns (the trainable tokens)."""
        return sum(len(t.completion_tokens) for t in self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)


class NotAPrefixError(ValueError):
    """A turn's prompt does not extend the tokens collected so far (the template rewrote history)."""


def trajectory_tokens(traj: Trajectory) -> tuple[list[int], list[float], list[bool]]:
    """The whole token sequence of a trajectory, its sampler logprobs and the sampled-token mask.

    Follows the prefix-extension rule of the chapter: each turn's prompt must start with everything
    collected so far; the new part (the question at turn 0; the end-of-turn, observation and next header
    later) is context, the completion tokens are the model's own.
    """
    tokens: list[int] = []
    logprobs: list[float] = []
    sampled: list[bool] = []
    for index, turn in enumerate(traj.turns):
        prompt = list(turn.prompt_tokens)
        if index > 0 and prompt[: len(tokens)] != tokens:
            raise NotAPrefixError(
                f"turn {index}: the prompt does not extend the trajectory collected so far "
                f"(first difference at position {_first_difference(prompt, tokens)})"
            )
        delta = prompt[len(tokens) :] if index > 0 else prompt
        completion = list(turn.completion_tokens)
        if len(turn.logprobs) != len(completion):
            raise ValueError(
                f"turn {index}: {len(completion)} completion tokens but {len(turn.logprobs)} logprobs"
            )
        tokens.extend(delta)
        logprobs.extend([0.0] * len(delta))
        sampled.extend([False] * len(delta))
        tokens.extend(completion)
        logprobs.extend(float(lp) for lp in turn.logprobs)
        sampled.extend([True] * len(completion))
    return tokens, logprobs, sampled


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
