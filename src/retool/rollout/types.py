"""What a rollout produces: the trainable assistant turns and the full record of one trajectory.

``AssistantTurn`` holds exactly what the sampler saw and emitted (never re-encoded text), so the training
stage can rebuild the token sequence; ``Trajectory`` adds everything the metrics need (code calls,
execution results and latencies, observations, why it stopped, the reward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from retool.data.problem import Problem
from retool.sandbox.base import ExecResult

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


class ContinuityError(RuntimeError):
    """A turn's prompt does not start with the previous turn's prompt + completion (a protocol bug)."""


@dataclass
class AssistantTurn:
    """One sampled assistant action: the exact prompt it was sampled from and the exact tokens emitted."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    text: str
    # The sampler's own reason ("stop" or "length"); extra facts, defaulted so positional use still works.
    sampler_stop: str = "stop"
    kind: str = ""  # what the parser made of it: tool | answer | invalid ("" in text-only mode)


@dataclass
class Trajectory:
    """One branch of one question, from the first prompt to its stop reason and reward."""

    problem: Problem
    group_index: int
    problem_index: int = 0
    turns: list[AssistantTurn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    code_calls: int = 0
    codes: list[str] = field(default_factory=list)  # the code of each call, in order
    exec_results: list[ExecResult] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # tool content shown to the model (after trimming)
    observations_trimmed: list[bool] = field(default_factory=list)
    final_text: str = ""
    reward: float = -1.0
    correct: bool = False
    valid_format: bool = False
    answer: str | None = None
    reward_status: str = ""  # the verifier's status (ok | timeout | error | no_answer), "" if not scored
    stop_reason: str = ""
    error: str | None = None  # the exception text for sampler_error / executor_error
    sample_seconds: float = 0.0  # time spent in sampler requests that produced this trajectory's turns
    exec_seconds: float = 0.0  # wall time of this trajectory's executions, as seen by the rollout
    use_tools: bool = True
    # The policy version (optimizer steps taken) of the weights that sampled it; set by the trainer, which
    # may train on it a few versions later (``train.max_steps_off_policy``). None outside training.
    policy_version: int | None = None

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
        for i in range(1, len(self.turns)):
            prev, cur = self.turns[i - 1], self.turns[i]
            n = len(prev.prompt_tokens) + len(prev.completion_tokens)
            if (
                len(cur.prompt_tokens) < n
                or cur.prompt_tokens[: len(prev.prompt_tokens)] != prev.prompt_tokens
                or cur.prompt_tokens[len(prev.prompt_tokens) : n] != prev.completion_tokens
            ):
                raise ContinuityError(
                    f"problem {self.problem.id!r} branch {self.group_index}: the prompt of turn {i + 1} does "
                    f"not start with the prompt + completion of turn {i}"
                )

    # -- metrics -----------------------------------------------------------------------------------
    @property
    def completion_token_count(self) -> int:
        """Tokens the model generated over all turns (the trainable tokens)."""
        return sum(len(t.completion_tokens) for t in self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def exec_errors(self) -> int:
        """Executions that failed (error or timeout)."""
        return sum(1 for r in self.exec_results if not r.ok or r.timed_out)

    @property
    def had_exec_error(self) -> bool:
        return self.exec_errors > 0

    @property
    def exec_latencies(self) -> list[float]:
        return [r.latency for r in self.exec_results]

    @property
    def had_error_then_correct(self) -> bool:
        """Self-correction: an execution failed, the model called the tool again, and the answer is correct."""
        if not self.correct:
            return False
        for i, result in enumerate(self.exec_results):
            if (not result.ok or result.timed_out) and i + 1 < self.code_calls:
                return True
        return False

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly digest (for logs and per-problem eval records)."""
        return {
            "problem_id": self.problem.id,
            "problem_index": self.problem_index,
            "group_index": self.group_index,
            "stop_reason": self.stop_reason,
            "reward": self.reward,
            "correct": self.correct,
            "valid_format": self.valid_format,
            "answer": self.answer,
            "turns": self.num_turns,
            "code_calls": self.code_calls,
            "exec_errors": self.exec_errors,
            "completion_tokens": self.completion_token_count,
            "total_tokens": len(self.full_tokens()),
            "sample_seconds": self.sample_seconds,
            "exec_seconds": self.exec_seconds,
            "error": self.error,
        }
