"""The interaction seam: what an environment shows the policy, what it gets back, what a step returns.

Shaped after tinker-cookbook's ``rl/types.py`` (``Env.initial_observation``, ``Env.step(action) ->
StepResult``, ``EnvGroupBuilder``) and skyrl-gym's ``BaseTextEnv.step``: one ``Env`` per trajectory owns
the whole interaction (how the model's text is parsed, what a tool does with it, what comes back, the
budgets, the reward); the rollout engine (``retool.rollout``) only samples the observations it is shown and
schedules many environments at once.

Token-level contract (docs/spec.md §4): every observation after the first is the previous observation's prompt +
the sampled completion + new tokens (append-only), checked by ``check_continuity``; the engine never
re-encodes text.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from retool.backends.interface.types import Sample
from retool.data.problem import Problem
from retool.protocol.chat import Message

StopReasonName = Literal[
    "answer", "invalid", "max_turns", "max_code_calls", "context_full", "sampler_error", "executor_error"
]
# Why a trajectory ended. Only "answer" is scored by the verifier; every other reason gets reward -1.
# "executor_error" means the executor itself raised (infrastructure failure, not the model's code failing;
# a failing model program is an ordinary observation).
STOP_REASONS: tuple[str, ...] = (
    "answer",
    "invalid",
    "max_turns",
    "max_code_calls",
    "context_full",
    "sampler_error",
    "executor_error",
)

# Why the engine could not give an environment an action: its observation leaves no room for one token
# (``context_full``), or the sampler raised (``sampler_error``).
Interrupt = Literal["context_full", "sampler_error"]

# What the policy returns for one observation: the sampled tokens, their logprobs, the sampler's stop.
Action = Sample


class ContinuityError(RuntimeError):
    """A turn's prompt does not start with the previous turn's prompt + completion (a protocol bug)."""


@dataclass(frozen=True)
class AssistantTurn:
    """One sampled assistant action: the exact prompt it was sampled from and the exact tokens emitted."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    text: str
    # The sampler's own reason ("stop" or "length"); extra facts, defaulted so positional use still works.
    sampler_stop: str = "stop"
    kind: str = ""  # what the parser made of it: tool | answer | invalid ("" in text-only mode)


def check_continuity(turns: Sequence[AssistantTurn], where: str) -> None:
    """Raise ``ContinuityError`` unless each prompt starts with the previous prompt + completion."""
    for i in range(1, len(turns)):
        prev, cur = turns[i - 1], turns[i]
        n = len(prev.prompt_tokens) + len(prev.completion_tokens)
        if (
            len(cur.prompt_tokens) < n
            or cur.prompt_tokens[: len(prev.prompt_tokens)] != prev.prompt_tokens
            or cur.prompt_tokens[len(prev.prompt_tokens) : n] != prev.completion_tokens
        ):
            raise ContinuityError(
                f"{where}: the prompt of turn {i + 1} does not start with the prompt + completion of turn {i}"
            )


@dataclass(frozen=True)
class Observation:
    """What the policy samples from: the prompt tokens and the stop condition of this turn.

    ``stop``: stop sequences (all token ids or all strings); ``max_tokens``: the most tokens this turn
    may generate (0: no room left, the engine does not sample it and interrupts the environment).
    """

    prompt_tokens: tuple[int, ...]
    stop: tuple[str, ...] | tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class StepResult:
    """What one step returns: the reward of the step, whether the trajectory is done, the next observation
    (None when done), per-step metrics, and ``turn``: how the environment read the action (None for an
    interrupt, where no action was taken)."""

    reward: float
    done: bool
    next_observation: Observation | None
    metrics: Mapping[str, float] = field(default_factory=dict)
    turn: AssistantTurn | None = None


@dataclass(frozen=True)
class Outcome:
    """What a finished environment reports beyond its transitions: why it stopped and how its attempt
    was scored (the trajectory record keeps it). An environment with more to report (a tool's calls:
    ``retool.env.retool.ReToolOutcome``) returns a subclass."""

    stop_reason: str
    error: str | None = None  # the exception text for sampler_error / executor_error
    final_text: str = ""  # the text of the last assistant turn
    messages: tuple[Message, ...] = ()
    correct: bool = False
    valid_format: bool = False
    answer: str | None = None
    reward_status: str = ""  # the verifier's status (ok | timeout | error | no_answer), "" if not scored


class Env(abc.ABC):
    """One trajectory's environment. Used once: ``initial_observation``, then ``step`` until done."""

    @abc.abstractmethod
    def initial_observation(self) -> Observation:
        """The first prompt and its stop condition."""

    @abc.abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Take one sampled action: parse it, act on it, return the reward and what comes next."""

    @abc.abstractmethod
    async def interrupt(self, reason: Interrupt, error: str | None = None) -> StepResult:
        """End the trajectory without an action (``reason``: why the engine could not sample)."""

    @abc.abstractmethod
    def outcome(self) -> Outcome:
        """What the finished trajectory reports (valid once a step returned ``done``)."""


class EnvGroupBuilder(abc.ABC):
    """Makes the environments of one problem's group (the branches its advantages are centred over).

    Environments of one group with the same initial observation are sampled in one request
    (``num_samples = group size``), so the sampler shares the prompt prefix. ``group_rewards`` may add a
    reward per trajectory once the whole group is done (default: none).
    """

    problem: Problem
    problem_index: int
    group_size: int  # how many environments ``make_envs`` makes

    @abc.abstractmethod
    def make_envs(self) -> list[Env]:
        """Fresh environments, one per branch, in branch order."""

    async def group_rewards(self, outcomes: Sequence[Outcome]) -> list[float]:
        """Rewards added to each trajectory once the group is done; default 0 for all."""
        return [0.0] * len(outcomes)
