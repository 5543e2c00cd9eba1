"""The multi-turn rollout state machine: sample -> parse -> execute -> observe -> sample, per trajectory.

Owns ``run_group_rollouts``. For each question the first turn samples ``group_size`` branches in one
request (``num_samples=group_size``); each branch then continues alone with ``num_samples=1`` until it
answers or runs out of a budget (SPEC §4):

- code calls (``max_code_calls``): a tool call past it ends the trajectory with ``max_code_calls``;
- assistant turns (``max_assistant_turns``): a tool call on the last allowed turn ends it with ``max_turns``;
- tokens per turn: ``max_tokens = min(max_tokens_per_turn, max_trajectory_tokens - len(prompt))``;
- tokens per observation (``max_observation_tokens``): trimmed from the front by the protocol so the
  traceback tail survives;
- tokens per trajectory (``max_trajectory_tokens``, counted over the whole sequence, prompt included): a
  trajectory whose next prompt (previous tokens + observation + assistant header) leaves no room for one
  generated token ends with ``context_full``.

Scheduling (``rollout.scheduling``):

- ``per_trajectory`` (default): every trajectory is its own asyncio task and goes back to sampling as
  soon as its own execution finishes, so sampling and execution overlap with no round barrier;
- ``round_sync``: the chapter's scheme - every active trajectory samples, then all pending code runs,
  then a barrier; kept for the benchmark and comparisons.

In both, an ``asyncio.Semaphore`` caps in-flight sampling requests (``rollout.max_inflight_samples``);
the executor caps concurrent executions itself. A sampler or executor exception ends only that
trajectory (``sampler_error`` / ``executor_error``, reward -1); a template that rewrites history
(``TemplateNotAppendOnlyError``) is a setup bug and is raised.

Rewards come only from model-generated text: by default ``verifier.ascore(final_text, problem.answer)``
where ``final_text`` is the text of the last assistant turn, and only for trajectories that stopped with
``answer`` (``retool.rollout.scoring``); a caller may pass its own ``scorer`` (an environment's).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from retool.backends.base import SamplingClient
from retool.backends.types import Sample, SamplingParams
from retool.config import RolloutConfig, SamplingConfig
from retool.data.problem import Problem
from retool.protocol import ChatProtocol, parse_assistant
from retool.rollout.scoring import TrajectoryScorer, VerifierLike, score_final_answer
from retool.rollout.types import AssistantTurn, Trajectory
from retool.sandbox.base import Executor

logger = logging.getLogger(__name__)


OnTrajectory = Callable[[Trajectory], None]


def request_seed(seed: int, problem_index: int, branch: int, turn: int) -> int:
    """A per-request sampling seed derived from (run seed, problem index, branch, turn).

    ``branch`` is -1 for the first-turn group request. Stable across processes (no ``hash()``), and the
    same under both schedulers, so a rerun with the same seed asks the sampler the same questions.
    """
    digest = hashlib.blake2b(f"{seed}:{problem_index}:{branch}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class _Pending:
    """A tool call the model made that still has to run."""

    traj: Trajectory
    code: str
    messages_before_assistant: list[dict[str, Any]]


class _Rollout:
    """One call of ``run_group_rollouts``: the shared state of its trajectories."""

    def __init__(
        self,
        problems: Sequence[Problem],
        *,
        sampler: SamplingClient,
        protocol: ChatProtocol,
        executor: Executor | None,
        verifier: VerifierLike,
        rollout: RolloutConfig,
        sampling: SamplingConfig,
        group_size: int,
        seed: int,
        use_tools: bool,
        on_trajectory: OnTrajectory | None,
        scorer: TrajectoryScorer | None,
    ) -> None:
        self.problems = list(problems)
        self.sampler = sampler
        self.protocol = protocol
        self.executor = executor
        self.verifier = verifier
        self.cfg = rollout
        self.sampling = sampling
        self.group_size = group_size
        self.seed = seed
        self.use_tools = use_tools
        self.on_trajectory = on_trajectory
        self.scorer = scorer
        self.semaphore = asyncio.Semaphore(max(1, rollout.max_inflight_samples))
        self.stop = self._stop_sequences()
        self.stop_ids = {int(i) for i in protocol.stop_token_ids}

    # -- sampling ----------------------------------------------------------------------------------
    def _stop_sequences(self) -> tuple[str, ...] | tuple[int, ...]:
        """Stop on the template's end-of-turn ids; formats with extra stop strings (markdown) get strings
        only (``SamplingParams.stop`` does not mix kinds), the end-of-turn ids written as their text."""
        ids = tuple(int(i) for i in self.protocol.stop_token_ids)
        strings = tuple(getattr(self.protocol, "stop_strings", ()) or ()) if self.use_tools else ()
        if not strings:
            return ids
        tokenizer = self.protocol.tokenizer
        id_strings = tuple(tokenizer.convert_ids_to_tokens(i) for i in ids)
        return tuple(dict.fromkeys((*strings, *(s for s in id_strings if isinstance(s, str)))))

    def _params(self, prompt_len: int, seed: int) -> SamplingParams | None:
        room = self.cfg.max_trajectory_tokens - prompt_len
        if room <= 0:
            return None
        return SamplingParams(
            max_tokens=min(self.cfg.max_tokens_per_turn, room),
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            seed=seed,
            stop=self.stop,
        )

    async def _sample(
        self, prompt: list[int], num_samples: int, params: SamplingParams
    ) -> tuple[list[Sample], float]:
        async with self.semaphore:
            start = time.perf_counter()
            samples = await self.sampler.sample_async(prompt, num_samples, params)
            elapsed = time.perf_counter() - start
        if len(samples) != num_samples:
            raise RuntimeError(f"sampler returned {len(samples)} samples for num_samples={num_samples}")
        for s in samples:
            if len(s.logprobs) != len(s.tokens):
                raise RuntimeError(f"sampler returned {len(s.tokens)} tokens but {len(s.logprobs)} logprobs")
        return samples, elapsed

    def _decode(self, tokens: list[int]) -> str:
        # The text the parser and verifier see: the completion without its trailing end-of-turn ids.
        end = len(tokens)
        while end > 0 and tokens[end - 1] in self.stop_ids:
            end -= 1
        return self.protocol.decode(tokens[:end])

    def _token_count(self, text: str) -> int:
        return len(self.protocol.encode(text))

    # -- the state machine -------------------------------------------------------------------------
    def _new_root(self, problem_index: int) -> tuple[Trajectory, list[int]]:
        problem = self.problems[problem_index]
        root = Trajectory(
            problem=problem,
            group_index=0,
            problem_index=problem_index,
            messages=self.protocol.initial_messages(problem.question),
            use_tools=self.use_tools,
        )
        return root, list(self.protocol.build_prompt(root.messages))

    def _branches(self, root: Trajectory) -> list[Trajectory]:
        # Each branch owns its messages (deep copies, as the chapter's copy.deepcopy(root)); the problem
        # is shared, immutable.
        return [
            Trajectory(
                problem=root.problem,
                group_index=b,
                problem_index=root.problem_index,
                messages=copy.deepcopy(root.messages),
                use_tools=root.use_tools,
            )
            for b in range(self.group_size)
        ]

    def _end(self, traj: Trajectory, reason: str, error: str | None = None) -> None:
        traj.stop_reason = reason
        traj.error = error
        if traj.turns:
            traj.final_text = traj.turns[-1].text

    def _consume(
        self, traj: Trajectory, prompt: list[int], sample: Sample, seconds: float
    ) -> _Pending | None:
        """Record one sampled turn; return the tool call to run, or None if the trajectory ended."""
        text = self._decode(list(sample.tokens))
        turn = AssistantTurn(
            list(prompt), list(sample.tokens), list(sample.logprobs), text, sample.stop_reason
        )
        traj.turns.append(turn)
        traj.sample_seconds += seconds
        traj.check_continuity()
        messages_before_assistant = list(traj.messages)
        traj.messages.append(self.protocol.assistant_message(text))
        if not self.use_tools:
            self._end(traj, "answer")
            return None
        parsed = parse_assistant(text, self.protocol.fmt)
        turn.kind = parsed.kind
        if parsed.kind == "answer":
            self._end(traj, "answer")
            return None
        if parsed.kind != "tool":
            self._end(traj, "invalid", parsed.reason)
            return None
        if traj.code_calls >= self.cfg.max_code_calls:
            self._end(traj, "max_code_calls")
            return None
        if len(traj.turns) >= self.cfg.max_assistant_turns:
            self._end(traj, "max_turns")
            return None
        return _Pending(traj, parsed.code or "", messages_before_assistant)

    async def _execute(self, pending: _Pending) -> list[int] | None:
        """Run the call and build the next prompt; None if the trajectory ended."""
        traj = pending.traj
        assert self.executor is not None
        traj.code_calls += 1
        traj.codes.append(pending.code)
        start = time.perf_counter()
        try:
            result = await self.executor.arun(pending.code)
        except Exception as exc:  # an infrastructure failure ends this trajectory only
            traj.exec_seconds += time.perf_counter() - start
            logger.warning(
                "executor failed on problem %s branch %d: %r", traj.problem.id, traj.group_index, exc
            )
            self._end(traj, "executor_error", f"{type(exc).__name__}: {exc}")
            return None
        traj.exec_seconds += time.perf_counter() - start
        traj.exec_results.append(result)
        return self._observe(pending, self.executor.format_tool_content(result))

    def _observe(self, pending: _Pending, content: str) -> list[int] | None:
        traj = pending.traj
        fitted = self.protocol.fit_observation(content, self.cfg.max_observation_tokens)
        traj.observations.append(fitted)
        traj.observations_trimmed.append(self._token_count(content) > self.cfg.max_observation_tokens)
        tool_message = self.protocol.tool_message(fitted)
        last = traj.turns[-1]
        next_prompt = list(
            self.protocol.build_next_prompt(
                pending.messages_before_assistant, last.prompt_tokens, last.completion_tokens, tool_message
            )
        )
        traj.messages.append(tool_message)
        if len(next_prompt) >= self.cfg.max_trajectory_tokens:
            self._end(traj, "context_full")
            return None
        return next_prompt

    async def _score(self, traj: Trajectory) -> None:
        try:
            if self.scorer is not None:
                await self.scorer(traj)
            else:
                await score_final_answer(traj, self.verifier)
        except Exception as exc:  # the verifier is bounded, but a crash must not kill the step
            logger.warning("scoring failed on problem %s: %r", traj.problem.id, exc)
            traj.reward, traj.correct, traj.valid_format, traj.reward_status = -1.0, False, False, "error"
        if self.on_trajectory is not None:
            self.on_trajectory(traj)

    # -- per-trajectory scheduling -----------------------------------------------------------------
    async def _run_branch(self, traj: Trajectory, prompt: list[int], sample: Sample, seconds: float) -> None:
        turn = 0
        while True:
            pending = self._consume(traj, prompt, sample, seconds)
            if pending is None:
                break
            next_prompt = await self._execute(pending)
            if next_prompt is None:
                break
            turn += 1
            params = self._params(
                len(next_prompt), request_seed(self.seed, traj.problem_index, traj.group_index, turn)
            )
            if params is None:  # unreachable after the context check, kept for safety
                self._end(traj, "context_full")
                break
            try:
                (sample,), seconds = await self._sample(next_prompt, 1, params)
            except Exception as exc:
                logger.warning(
                    "sampler failed on problem %s branch %d: %r", traj.problem.id, traj.group_index, exc
                )
                self._end(traj, "sampler_error", f"{type(exc).__name__}: {exc}")
                break
            prompt = next_prompt
        await self._score(traj)

    async def _run_question(self, problem_index: int) -> list[Trajectory]:
        root, prompt = self._new_root(problem_index)
        branches = self._branches(root)
        params = self._params(len(prompt), request_seed(self.seed, problem_index, -1, 0))
        if params is None:
            for t in branches:
                self._end(t, "context_full")
            await asyncio.gather(*(self._score(t) for t in branches))
            return branches
        try:
            samples, seconds = await self._sample(prompt, self.group_size, params)
        except Exception as exc:
            logger.warning("sampler failed on problem %s (group request): %r", root.problem.id, exc)
            for t in branches:
                self._end(t, "sampler_error", f"{type(exc).__name__}: {exc}")
            await asyncio.gather(*(self._score(t) for t in branches))
            return branches
        await _gather_all(
            [self._run_branch(t, prompt, s, seconds) for t, s in zip(branches, samples, strict=True)]
        )
        return branches

    async def run_per_trajectory(self) -> list[list[Trajectory]]:
        return await _gather_all([self._run_question(i) for i in range(len(self.problems))])

    # -- round-synchronous scheduling (the chapter's scheme) -----------------------------------------
    async def run_round_sync(self) -> list[list[Trajectory]]:
        """The chapter's scheme: every active trajectory samples, all pending code runs, then a barrier.

        Long because one round is one loop over shared lists (active branches, their pending calls, the
        next round's requests); kept whole as the benchmark's reference for ``run_per_trajectory``.
        """
        groups: list[list[Trajectory]] = []
        # Each active entry: (trajectory, prompt, turn index).
        active: list[tuple[Trajectory, list[int], int]] = []
        first_requests: list[tuple[int, list[int], SamplingParams]] = []
        for i in range(len(self.problems)):
            root, prompt = self._new_root(i)
            branches = self._branches(root)
            groups.append(branches)
            params = self._params(len(prompt), request_seed(self.seed, i, -1, 0))
            if params is None:
                for t in branches:
                    self._end(t, "context_full")
            else:
                first_requests.append((i, prompt, params))

        done: list[Trajectory] = [t for g in groups for t in g if t.stop_reason]
        # Round 0: one group request per question.
        results = await asyncio.gather(
            *(self._sample(p, self.group_size, params) for _, p, params in first_requests),
            return_exceptions=True,
        )
        pendings: list[_Pending] = []
        for (i, prompt, _), res in zip(first_requests, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                for t in groups[i]:
                    self._end(t, "sampler_error", f"{type(res).__name__}: {res}")
                    done.append(t)
                continue
            samples, seconds = res
            for t, s in zip(groups[i], samples, strict=True):
                pending = self._consume(t, prompt, s, seconds)
                if pending is None:
                    done.append(t)
                else:
                    pendings.append(pending)

        turn = 0
        while pendings:
            # Execute every pending call, then wait for all of them (the round barrier).
            next_prompts = await _gather_all([self._execute(p) for p in pendings])
            turn += 1
            active = []
            for p, nxt in zip(pendings, next_prompts, strict=True):
                if nxt is None:
                    done.append(p.traj)
                else:
                    active.append((p.traj, nxt, turn))
            requests = []
            for t, nxt, k in active:
                params = self._params(len(nxt), request_seed(self.seed, t.problem_index, t.group_index, k))
                if params is None:
                    self._end(t, "context_full")
                    done.append(t)
                else:
                    requests.append((t, nxt, params))
            results = await asyncio.gather(
                *(self._sample(nxt, 1, params) for _, nxt, params in requests), return_exceptions=True
            )
            pendings = []
            for (t, nxt, _), res in zip(requests, results, strict=True):
                if isinstance(res, BaseException):
                    if not isinstance(res, Exception):
                        raise res
                    self._end(t, "sampler_error", f"{type(res).__name__}: {res}")
                    done.append(t)
                    continue
                (s,), seconds = res
                pending = self._consume(t, nxt, s, seconds)
                if pending is None:
                    done.append(t)
                else:
                    pendings.append(pending)
        # As in the chapter, scoring happens once every trajectory has finished.
        await _gather_all([self._score(t) for t in done])
        return groups


async def _gather_all(coros: list[Any]) -> list[Any]:
    """Run coroutines as tasks; if one raises, cancel the rest (and wait for them) before re-raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_group_rollouts(
    problems: Sequence[Problem],
    *,
    sampler: SamplingClient,
    protocol: ChatProtocol,
    executor: Executor | None,
    verifier: VerifierLike,
    rollout: RolloutConfig,
    sampling: SamplingConfig,
    group_size: int,
    seed: int = 0,
    use_tools: bool = True,
    on_trajectory: OnTrajectory | None = None,
    scorer: TrajectoryScorer | None = None,
) -> list[list[Trajectory]]:
    """Roll out ``group_size`` trajectories for each problem; returns one list (a group) per problem.

    ``protocol`` is a ``retool.protocol.ChatProtocol`` built with the same ``use_tools``; ``executor`` may
    be None only when ``use_tools`` is False (text-only mode: one turn, no tool registered, scored as is).
    ``scorer`` sets each finished trajectory's reward (default: ``score_final_answer`` with ``verifier``);
    ``on_trajectory`` is called (synchronously) with each trajectory once it is scored, e.g. for progress.
    Pass a different ``seed`` for every training step so requests never repeat across steps.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    protocol_tools = getattr(protocol, "use_tools", use_tools)
    if bool(protocol_tools) != bool(use_tools):
        raise ValueError(
            f"run_group_rollouts(use_tools={use_tools}) needs a ChatProtocol built with use_tools={use_tools} "
            f"(this one has use_tools={protocol_tools}), otherwise the prompt would "
            f"{'register' if protocol_tools else 'not register'} the tool"
        )
    if use_tools and executor is None:
        raise ValueError("run_group_rollouts(use_tools=True) needs an executor")
    for name in ("max_code_calls", "max_assistant_turns", "max_tokens_per_turn", "max_trajectory_tokens"):
        if getattr(rollout, name) < 1 and not (name == "max_code_calls" and getattr(rollout, name) == 0):
            raise ValueError(f"rollout.{name} must be positive, got {getattr(rollout, name)}")
    if not problems:
        return []
    state = _Rollout(
        problems,
        sampler=sampler,
        protocol=protocol,
        executor=executor,
        verifier=verifier,
        rollout=rollout,
        sampling=sampling,
        group_size=group_size,
        seed=seed,
        use_tools=use_tools,
        on_trajectory=on_trajectory,
        scorer=scorer,
    )
    if rollout.scheduling == "round_sync":
        return await state.run_round_sync()
    return await state.run_per_trajectory()
