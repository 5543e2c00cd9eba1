"""The rollout scheduler: many environments sampled by one policy, each trajectory on its own.

Owns ``run_rollout(request)``, the one rollout function the trainer and the evaluator call. The engine knows
nothing of tools, parsing, budgets or rewards (it imports the environment seam, ``retool.env.types``, and no
environment kind): each trajectory is one ``retool.env.Env``, which shows an
``Observation`` (prompt tokens and stop condition), takes a sampled action in ``step`` and returns a
``StepResult`` (reward, done, next observation). The engine samples, steps, and records the transitions
into an immutable ``Trajectory``. A group's environments (``EnvGroupBuilder.make_envs``) that show the
same first observation are sampled in one request (``num_samples = group size``), so the sampler shares
the prompt prefix; after that each branch continues alone with ``num_samples = 1``.

Scheduling: every trajectory is its own asyncio task and goes back to sampling as soon as its own step
finishes, so sampling and tool execution overlap with no round barrier. (The chapter's round-synchronous
scheme, a barrier after every round, is a comparison kept in ``bench/_round_sync.py``, built on this
module's ``Scheduler`` steps; it samples the same requests.) An ``asyncio.Semaphore`` caps in-flight
sampling requests (``max_inflight_samples``). A sampler exception ends only that trajectory (the
environment is interrupted with ``sampler_error``); an observation with no room for one token is never
sampled (``context_full``). Request seeds derive from (run seed, problem index, branch, turn)
(``request_seed``), whatever the order requests are made in.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from retool.backends.interface.types import Sample, SamplingParams
from retool.config import SamplingConfig
from retool.env.types import Env, EnvGroupBuilder, Interrupt, Observation, StepResult
from retool.rollout.types import Trajectory, Transition

logger = logging.getLogger(__name__)

OnTrajectory = Callable[[Trajectory], None]
T = TypeVar("T")


class Policy(Protocol):
    """What the engine samples with: a sampling client over one snapshot of the weights
    (``retool.backends.SamplingClient`` is one; so is any object with this method)."""

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]: ...


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout: a group per builder, sampled by ``policy`` with ``sampling``'s temperature / top-p /
    top-k. ``seed``: the run's seed for this call (pass a different one for every training step, so requests
    never repeat); ``on_trajectory`` is called (synchronously) with each trajectory once its group is done,
    e.g. for progress."""

    groups: Sequence[EnvGroupBuilder]
    policy: Policy
    sampling: SamplingConfig
    seed: int = 0
    max_inflight_samples: int = 64
    on_trajectory: OnTrajectory | None = None


class RolloutFn(Protocol):
    """The rollout function's shape (``run_rollout``, or a caller's stand-in): one list (a group) per builder."""

    def __call__(self, request: RolloutRequest) -> Awaitable[list[list[Trajectory]]]: ...


def request_seed(seed: int, problem_index: int, branch: int, turn: int) -> int:
    """A per-request sampling seed derived from (run seed, problem index, branch, turn).

    ``branch`` is -1 for the first-turn group request. Stable across processes (no ``hash()``), and
    independent of the order requests are made in, so a rerun with the same seed asks the sampler the same questions.
    """
    digest = hashlib.blake2b(f"{seed}:{problem_index}:{branch}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class _Run:
    """One environment while it runs: its transitions, summed reward and sampling time so far."""

    env: Env
    branch: int
    problem_index: int
    problem_id: str
    transitions: list[Transition] = field(default_factory=list)
    reward: float = 0.0
    sample_seconds: float = 0.0
    turn: int = 0  # steps taken: the turn index of the next request's seed
    observation: Observation | None = None  # what to sample next; None once done

    def record(self, result: StepResult) -> None:
        if not result.done and result.next_observation is None:
            raise RuntimeError(
                f"problem {self.problem_id!r} branch {self.branch}: the environment's step is not done "
                "but gave no next observation"
            )
        self.reward += result.reward
        if result.turn is not None:
            self.transitions.append(Transition(result.turn, result.reward, result.done, result.metrics))
        self.observation = None if result.done else result.next_observation


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Scheduler:
    """One call of ``run_rollout``: the policy, the sampling settings and the in-flight cap. Its steps
    (``_start``, ``_first_actions``, ``_step``, ``_sample_one``, ``_finish``) are what any scheduling is made
    of; ``run_per_trajectory`` is the one this project rolls out with."""

    def __init__(self, request: RolloutRequest) -> None:
        self.request = request
        self.semaphore = asyncio.Semaphore(max(1, request.max_inflight_samples))

    # -- sampling ----------------------------------------------------------------------------------
    def _params(self, observation: Observation, seed: int) -> SamplingParams:
        sampling = self.request.sampling
        return SamplingParams(
            max_tokens=observation.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=seed,
            stop=observation.stop,
            stop_at_boxed=sampling.stop_at_boxed,
        )

    async def _sample(
        self, observation: Observation, num_samples: int, seed: int
    ) -> tuple[list[Sample], float]:
        params = self._params(observation, seed)
        async with self.semaphore:
            start = time.perf_counter()
            samples = await self.request.policy.sample_async(
                list(observation.prompt_tokens), num_samples, params
            )
            elapsed = time.perf_counter() - start
        if len(samples) != num_samples:
            raise RuntimeError(f"sampler returned {len(samples)} samples for num_samples={num_samples}")
        for s in samples:
            if len(s.logprobs) != len(s.tokens):
                raise RuntimeError(f"sampler returned {len(s.tokens)} tokens but {len(s.logprobs)} logprobs")
        return samples, elapsed

    def _seed(self, run: _Run) -> int:
        return request_seed(self.request.seed, run.problem_index, run.branch, run.turn)

    # -- one step of one environment ----------------------------------------------------------------
    async def _interrupt(self, run: _Run, reason: Interrupt, error: str | None = None) -> None:
        run.record(await run.env.interrupt(reason, error))

    async def _step(self, run: _Run, action: Sample, seconds: float) -> None:
        run.sample_seconds += seconds
        run.record(await run.env.step(action))
        run.turn += 1
        if run.observation is not None and run.observation.max_tokens < 1:
            await self._interrupt(run, "context_full")

    async def _sample_one(self, run: _Run) -> tuple[Sample, float] | None:
        """The next action of ``run``; None (and the environment interrupted) when the sampler failed."""
        assert run.observation is not None
        try:
            (sample,), seconds = await self._sample(run.observation, 1, self._seed(run))
        except Exception as exc:
            logger.warning("sampler failed on problem %s branch %d: %r", run.problem_id, run.branch, exc)
            await self._interrupt(run, "sampler_error", _error_text(exc))
            return None
        return sample, seconds

    # -- the first turn of a group ------------------------------------------------------------------
    async def _first_actions(self, runs: list[_Run]) -> list[tuple[Sample, float] | None]:
        """Each run's first action: one request for the group when every first observation is the same
        (the sampler shares the prefix), else one request per run. None: the run already ended."""
        firsts = [run.observation for run in runs]
        if any(o != firsts[0] for o in firsts):
            return await gather_all([self._first_alone(run) for run in runs])
        observation = firsts[0]
        assert observation is not None
        if observation.max_tokens < 1:
            await gather_all([self._interrupt(run, "context_full") for run in runs])
            return [None] * len(runs)
        seed = request_seed(self.request.seed, runs[0].problem_index, -1, 0)
        try:
            samples, seconds = await self._sample(observation, len(runs), seed)
        except Exception as exc:
            logger.warning("sampler failed on problem %s (group request): %r", runs[0].problem_id, exc)
            await gather_all([self._interrupt(run, "sampler_error", _error_text(exc)) for run in runs])
            return [None] * len(runs)
        return [(s, seconds) for s in samples]

    async def _first_alone(self, run: _Run) -> tuple[Sample, float] | None:
        assert run.observation is not None
        if run.observation.max_tokens < 1:
            await self._interrupt(run, "context_full")
            return None
        return await self._sample_one(run)

    # -- groups --------------------------------------------------------------------------------------
    @staticmethod
    def _start(builder: EnvGroupBuilder) -> list[_Run]:
        runs = [
            _Run(env, b, builder.problem_index, builder.problem.id)
            for b, env in enumerate(builder.make_envs())
        ]
        for run in runs:
            run.observation = run.env.initial_observation()
        return runs

    async def _finish(self, builder: EnvGroupBuilder, runs: list[_Run]) -> list[Trajectory]:
        """The group's records: every run's transitions and outcome, with the group's rewards added."""
        outcomes = [run.env.outcome() for run in runs]
        extra = await builder.group_rewards(outcomes)
        group = [
            Trajectory(
                problem=builder.problem,
                group_index=run.branch,
                problem_index=builder.problem_index,
                transitions=tuple(run.transitions),
                reward=run.reward + bonus,
                outcome=outcome,
                sample_seconds=run.sample_seconds,
            )
            for run, outcome, bonus in zip(runs, outcomes, extra, strict=True)
        ]
        if self.request.on_trajectory is not None:
            for trajectory in group:
                self.request.on_trajectory(trajectory)
        return group

    # -- per-trajectory scheduling -----------------------------------------------------------------
    async def _run_alone(self, run: _Run, first: tuple[Sample, float] | None) -> None:
        action = first
        while action is not None:
            await self._step(run, *action)
            action = await self._sample_one(run) if run.observation is not None else None

    async def _group_per_trajectory(self, builder: EnvGroupBuilder) -> list[Trajectory]:
        runs = self._start(builder)
        firsts = await self._first_actions(runs)
        await gather_all([self._run_alone(run, first) for run, first in zip(runs, firsts, strict=True)])
        return await self._finish(builder, runs)

    async def run_per_trajectory(self) -> list[list[Trajectory]]:
        return await gather_all([self._group_per_trajectory(b) for b in self.request.groups])


async def gather_all(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run coroutines as tasks; if one raises, cancel the rest (and wait for them) before re-raising."""
    tasks: list[asyncio.Future[T]] = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_rollout(request: RolloutRequest) -> list[list[Trajectory]]:
    """Roll out every group of ``request``: the one rollout function; returns one list of trajectories (a group) per builder."""
    if not request.groups:
        return []
    return await Scheduler(request).run_per_trajectory()
