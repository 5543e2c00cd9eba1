"""The ReTool environment: one trajectory of a problem with a tool the model calls in its turns.

``ReToolEnv.step`` owns the whole interaction (docs/spec.md §4, chapter 8.4.6): decode the sampled tokens, parse
them with the protocol's tool format, run a tool call, fit what came back into an observation, build the
next prompt token-exactly (``ChatProtocol.build_next_prompt``), enforce the budgets, and score the
attempt when it ends. Budgets (``Budgets``, from the ``[rollout]`` section):

- code calls (``max_code_calls``): a tool call past it ends the trajectory with ``max_code_calls``;
- assistant turns (``max_assistant_turns``): a tool call on the last allowed turn ends it with ``max_turns``;
- tokens per turn: ``max_tokens = min(max_tokens_per_turn, max_trajectory_tokens - len(prompt))``;
- tokens per observation (``max_observation_tokens``): trimmed from the front by the protocol so the
  traceback tail survives;
- tokens per trajectory (``max_trajectory_tokens``, the whole sequence, prompt included): a next prompt
  that leaves no room for one generated token ends the trajectory with ``context_full``.

The tool is anything with ``arun(code) -> ExecResult`` and ``format_tool_content(result)`` (a sandbox
``Executor`` is one; ``examples/`` has others). With no tool the environment is text-only: the protocol
registers none and the first turn is the answer. A tool that raises ends the trajectory with
``executor_error`` (an infrastructure failure); a failing program is an ordinary observation.

``ToolSetup`` is what every environment of one mode shares (protocol, tool, verifier, budgets) and makes
the groups (``ToolSetup.group_builder``): a problem source asks it for a problem's group, handing it its
scoring rule; the group (``ReToolGroupBuilder``) scores its attempts with that rule and the setup's
verifier (``score_attempt``). A finished
environment reports a ``ReToolOutcome``: the generic ``Outcome`` and the tool's calls, results and
observations.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from retool.config import RolloutConfig
from retool.data.problem import Problem
from retool.env.scoring import UNCHECKED, Attempt, Score, Scorer, ScoreRule, VerifierLike, score_final_answer
from retool.env.types import (
    Action,
    AssistantTurn,
    Env,
    EnvGroupBuilder,
    Interrupt,
    Observation,
    Outcome,
    StepResult,
    check_continuity,
)
from retool.protocol import ChatProtocol, parse_assistant
from retool.protocol.chat import Message
from retool.sandbox.base import ExecResult

logger = logging.getLogger(__name__)


class Tool(Protocol):
    """What the environment calls with the code of a tool call (``retool.sandbox.Executor`` has it)."""

    async def arun(self, code: str) -> ExecResult: ...

    def format_tool_content(self, result: ExecResult) -> str: ...


@dataclass(frozen=True)
class Budgets:
    """How far one trajectory may go (module docstring): code calls, assistant turns and tokens."""

    max_code_calls: int = 4
    max_assistant_turns: int = 6
    max_tokens_per_turn: int = 1024
    max_observation_tokens: int = 512
    max_trajectory_tokens: int = 8192

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> Budgets:
        """The budgets of the ``[rollout]`` section (its scheduler settings are the rollout engine's)."""
        return cls(
            max_code_calls=rollout.max_code_calls,
            max_assistant_turns=rollout.max_assistant_turns,
            max_tokens_per_turn=rollout.max_tokens_per_turn,
            max_observation_tokens=rollout.max_observation_tokens,
            max_trajectory_tokens=rollout.max_trajectory_tokens,
        )

    def check(self) -> None:
        """Refuse budgets that are not positive (no code calls at all is allowed)."""
        for name in ("max_code_calls", "max_assistant_turns", "max_tokens_per_turn", "max_trajectory_tokens"):
            value = getattr(self, name)
            if value < 1 and not (name == "max_code_calls" and value == 0):
                raise ValueError(f"rollout.{name} must be positive, got {value}")


@dataclass(frozen=True)
class ToolSetup:
    """What every environment of one mode shares: the chat protocol, the tool (None: text-only), the
    verifier and the budgets. ``protocol.use_tools`` must match whether there is a tool. It makes the
    groups of its mode (``group_builder``), so whoever holds a setup gets environments bound to it."""

    protocol: ChatProtocol
    tool: Tool | None
    verifier: VerifierLike
    budgets: Budgets

    def check(self) -> None:
        """Refuse a protocol that disagrees with the tool, and budgets that are not positive."""
        use_tools = self.tool is not None
        if bool(self.protocol.use_tools) != use_tools:
            raise ValueError(
                f"an environment {'with' if use_tools else 'without'} a tool needs a ChatProtocol built with "
                f"use_tools={use_tools} (this one has use_tools={self.protocol.use_tools}), otherwise the "
                f"prompt would {'not register' if use_tools else 'register'} the tool"
            )
        self.budgets.check()

    def group_builder(
        self, problem: Problem, group_size: int, problem_index: int = 0, score: ScoreRule | None = None
    ) -> ReToolGroupBuilder:
        """``group_size`` ReTool environments of ``problem`` with this setup, scored by ``score`` with this
        setup's verifier (default: the verifier's check of the final answer)."""
        return ReToolGroupBuilder(problem, self, group_size, problem_index=problem_index, score=score)

    @functools.cached_property
    def stop(self) -> tuple[str, ...] | tuple[int, ...]:
        """Stop on the template's end-of-turn ids; formats with extra stop strings (markdown) get strings
        only (``SamplingParams.stop`` does not mix kinds), the end-of-turn ids written as their text."""
        ids = tuple(int(i) for i in self.protocol.stop_token_ids)
        strings = tuple(self.protocol.stop_strings) if self.tool is not None else ()
        if not strings:
            return ids
        id_strings = tuple(self.protocol.tokenizer.convert_ids_to_tokens(i) for i in ids)
        return tuple(dict.fromkeys((*strings, *(s for s in id_strings if isinstance(s, str)))))

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.protocol.stop_token_ids)


@dataclass(frozen=True)
class ReToolOutcome(Outcome):
    """A finished ReTool environment's report: the generic ``Outcome`` and its tool calls."""

    codes: tuple[str, ...] = ()  # the code of each tool call, in order
    exec_results: tuple[ExecResult, ...] = ()
    observations: tuple[str, ...] = ()  # tool content shown to the model (after trimming)
    observations_trimmed: tuple[bool, ...] = ()
    exec_seconds: float = 0.0  # wall time of the tool calls, as seen by the environment
    use_tools: bool = True

    @property
    def code_calls(self) -> int:
        """Tool calls made (executed, or attempted when the executor itself failed)."""
        return len(self.codes)

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


def retool_outcome(outcome: Outcome) -> ReToolOutcome:
    """``outcome`` with its tool calls: a ReTool environment's own, or (an environment with no tool, such
    as a caller's own ``Env``) the same outcome with none. What tool metrics and records read."""
    if isinstance(outcome, ReToolOutcome):
        return outcome
    generic = {f.name: getattr(outcome, f.name) for f in dataclasses.fields(Outcome)}
    return ReToolOutcome(**generic, use_tools=False)


@dataclass
class _Episode:
    """The mutable state of one trajectory while it runs (``Outcome`` is its frozen report)."""

    messages: list[Message]
    turns: list[AssistantTurn] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)
    exec_results: list[ExecResult] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    observations_trimmed: list[bool] = field(default_factory=list)
    exec_seconds: float = 0.0
    stop_reason: str = ""
    error: str | None = None
    score: Score | None = None


class ReToolEnv(Env):
    """One branch of one problem: sample -> parse -> execute -> observe, until an answer or a budget."""

    def __init__(
        self,
        problem: Problem,
        setup: ToolSetup,
        scorer: Scorer,
        branch: int = 0,
        start: tuple[list[Message], list[int]] | None = None,
    ) -> None:
        """``start``: the first messages and their prompt tokens, when the group built them once."""
        self.problem = problem
        self.setup = setup
        self.scorer = scorer
        self.branch = branch
        self.protocol = setup.protocol
        self.budgets = setup.budgets
        if start is None:
            messages = self.protocol.initial_messages(problem.question)
            start = messages, list(self.protocol.build_prompt(messages))
        # Each branch owns its messages (deep copies, as the chapter's copy.deepcopy(root)).
        self._state = _Episode(messages=copy.deepcopy(start[0]))
        self._prompt: list[int] = list(start[1])  # the prompt of the observation the next action answers

    # -- observations --------------------------------------------------------------------------------
    def _observation(self, prompt: list[int]) -> Observation:
        room = self.budgets.max_trajectory_tokens - len(prompt)
        max_tokens = min(self.budgets.max_tokens_per_turn, room) if room > 0 else 0
        return Observation(tuple(prompt), self.setup.stop, max_tokens)

    def initial_observation(self) -> Observation:
        return self._observation(self._prompt)

    def _decode(self, tokens: list[int]) -> str:
        # The text the parser and verifier see: the completion without its trailing end-of-turn ids.
        end = len(tokens)
        while end > 0 and tokens[end - 1] in self.setup.stop_ids:
            end -= 1
        return self.protocol.decode(tokens[:end])

    # -- the step ------------------------------------------------------------------------------------
    async def step(self, action: Action) -> StepResult:
        """Record the sampled turn, then end (answer, invalid, a budget) or run the tool call."""
        state = self._state
        text = self._decode(list(action.tokens))
        messages_before_assistant = list(state.messages)
        state.messages.append(self.protocol.assistant_message(text))
        if self.setup.tool is None:
            turn = self._record(action, text, "")
            return await self._finish("answer", None, turn)
        parsed = parse_assistant(text, self.protocol.fmt)
        turn = self._record(action, text, parsed.kind)
        if parsed.kind == "answer":
            return await self._finish("answer", None, turn)
        if parsed.kind != "tool":
            return await self._finish("invalid", parsed.reason, turn)
        if len(state.codes) >= self.budgets.max_code_calls:
            return await self._finish("max_code_calls", None, turn)
        if len(state.turns) >= self.budgets.max_assistant_turns:
            return await self._finish("max_turns", None, turn)
        return await self._call_tool(parsed.code or "", messages_before_assistant, turn)

    def _record(self, action: Action, text: str, kind: str) -> AssistantTurn:
        turn = AssistantTurn(
            list(self._prompt), list(action.tokens), list(action.logprobs), text, action.stop_reason, kind
        )
        self._state.turns.append(turn)
        check_continuity(self._state.turns, f"problem {self.problem.id!r} branch {self.branch}")
        return turn

    async def _call_tool(
        self, code: str, messages_before_assistant: list[Message], turn: AssistantTurn
    ) -> StepResult:
        """Run the call and build the next prompt from what came back."""
        state, tool = self._state, self.setup.tool
        assert tool is not None
        state.codes.append(code)
        start = time.perf_counter()
        try:
            result = await tool.arun(code)
        except Exception as exc:  # an infrastructure failure ends this trajectory only
            state.exec_seconds += time.perf_counter() - start
            logger.warning("executor failed on problem %s branch %d: %r", self.problem.id, self.branch, exc)
            return await self._finish("executor_error", f"{type(exc).__name__}: {exc}", turn)
        state.exec_seconds += time.perf_counter() - start
        state.exec_results.append(result)
        return await self._observe(tool.format_tool_content(result), messages_before_assistant, turn)

    async def _observe(
        self, content: str, messages_before_assistant: list[Message], turn: AssistantTurn
    ) -> StepResult:
        state, limit = self._state, self.budgets.max_observation_tokens
        fitted = self.protocol.fit_observation(content, limit)
        state.observations.append(fitted)
        state.observations_trimmed.append(len(self.protocol.encode(content)) > limit)
        tool_message = self.protocol.tool_message(fitted)
        next_prompt = list(
            self.protocol.build_next_prompt(
                messages_before_assistant, turn.prompt_tokens, turn.completion_tokens, tool_message
            )
        )
        state.messages.append(tool_message)
        if len(next_prompt) >= self.budgets.max_trajectory_tokens:
            return await self._finish("context_full", None, turn)
        self._prompt = next_prompt
        return StepResult(0.0, False, self._observation(next_prompt), turn=turn)

    async def _finish(self, reason: str, error: str | None, turn: AssistantTurn | None) -> StepResult:
        """End the trajectory and score it; the reward is this last step's."""
        state = self._state
        state.stop_reason, state.error = reason, error
        final_text = state.turns[-1].text if state.turns else ""
        attempt = Attempt(self.problem, reason, final_text, tuple(state.turns))
        try:
            state.score = await self.scorer(attempt)
        except Exception as exc:  # the verifier is bounded, but a crash must not kill the step
            logger.warning("scoring failed on problem %s: %r", self.problem.id, exc)
            state.score = Score(-1.0, status="error")
        return StepResult(state.score.reward, True, None, turn=turn)

    async def interrupt(self, reason: Interrupt, error: str | None = None) -> StepResult:
        return await self._finish(reason, error, None)

    def outcome(self) -> ReToolOutcome:
        state, score = self._state, self._state.score or UNCHECKED
        return ReToolOutcome(
            stop_reason=state.stop_reason,
            error=state.error,
            final_text=state.turns[-1].text if state.turns else "",
            messages=tuple(state.messages),
            codes=tuple(state.codes),
            exec_results=tuple(state.exec_results),
            observations=tuple(state.observations),
            observations_trimmed=tuple(state.observations_trimmed),
            correct=score.correct,
            valid_format=score.valid_format,
            answer=score.answer,
            reward_status=score.status,
            exec_seconds=state.exec_seconds,
            use_tools=self.setup.tool is not None,
        )


class ReToolGroupBuilder(EnvGroupBuilder):
    """``group_size`` ReTool environments of one problem with ``setup`` (they share their first prompt, so
    the engine asks for the whole group in one request), scored by ``score`` (a source's rule; default:
    the verifier's check of the final answer) with the setup's verifier."""

    def __init__(
        self,
        problem: Problem,
        setup: ToolSetup,
        group_size: int,
        *,
        problem_index: int = 0,
        score: ScoreRule | None = None,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.problem, self.problem_index = problem, problem_index
        self.setup, self.group_size = setup, group_size
        self.score: ScoreRule = score or score_final_answer

    async def score_attempt(self, attempt: Attempt) -> Score:
        """The reward of one of this group's finished attempts (what its environments call when they end)."""
        return await self.score(attempt, self.setup.verifier)

    def make_envs(self) -> list[Env]:
        self.setup.check()
        messages = self.setup.protocol.initial_messages(self.problem.question)
        start = messages, list(self.setup.protocol.build_prompt(messages))  # rendered once per group
        scorer: Scorer = self.score_attempt
        return [ReToolEnv(self.problem, self.setup, scorer, b, start) for b in range(self.group_size)]
