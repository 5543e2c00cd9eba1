"""Sampling ahead of training (``train.max_steps_off_policy = k >= 1``): ``AheadBatches`` samples the
batches of steps t+1..t+k in a background task while step t trains. The synchronous loop (k = 0, the
default) never builds it: ``retool.train.loop`` samples each step's batch itself when the step starts.

The trainer calls it, it never calls the trainer: when step t starts, ``submit(t - 1, policy)`` hands it
the policy over the current weights, and ``await batch_for(t)`` takes the step's batch, sampled while
earlier steps trained. A checkpoint asks for the batches it holds (``drain``); ``aclose`` stops it. The
work of one batch is ``retool.train.sampling.StepBatchBuilder.batch``'s.

Policy versions. Version v is the weights after v optimizer steps (a resumed run starts at the version of
its checkpoint). The trainer submits version t - 1 (a sampler over those weights, frozen: see
``TrainingClient.frozen_sampling_client_async``) when step t starts, before it trains.

Batches. The batch of step t is everything sampling does for that step (``retool.train.sampling``: one
round, or the rounds of dynamic sampling) on one policy; every trajectory in it is tagged with the
policy's version (``Trajectory.policy_version``). One background task samples the batches in step order,
one after another, each one on the policy of version

    v(t) = max(t - 1 - k, v0)          k = train.max_steps_off_policy, v0 = the version the run started at

and puts it in a queue; the trainer takes batch t when it starts step t. Every version is therefore
trained on with lag ``t - 1 - v(t) = min(k, t - 1 - v0)``: k steps behind once the pipeline is full.
While step t trains, batches t+1..t+k are sampled (they need versions up to t - 1).

Staleness policy: pacing, not discarding. The sampler never samples a batch before its version exists
and never from a newer one, so in a run no batch is older than k versions, none is discarded and the run
is deterministic (the same samples whatever the timing). The one way to meet a batch older than k is a
resume with a smaller ``train.max_steps_off_policy`` than the checkpoint was written with: such restored
batches are *requeued*: their trajectories are dropped, every problem they drew goes back, in order, to
the front of the problem feed, and they are sampled again from the resumed weights (counted in
``offpolicy/requeued_groups``).

Problems. Batches draw their problems, in step order, from a ``ProblemFeed`` (``retool.train.datasource``):
the requeued problems first, then the run's ``ProblemStream``. With the same k a run trains on the same
problems in the same order as the synchronous loop does (they diverge only where rewards, and so dynamic
sampling's extra rounds, differ).

Resume. A checkpoint of step c first waits for batches c+1..c+k (all sampled by versions <= c - 1,
which exist) and stores them with the feed's position after them (``PipelineState``; with the pass-rate
order also its state after them, ``Batch.order``); a resume puts them
back in the queue and samples batch c+k+1 onwards from the checkpoint's weights (version c), exactly as the
uninterrupted run did. So a run killed at any moment and resumed trains on the same samples; the work in
flight when it died (batches c+k+1 and later) is lost and sampled again, and no batch is trained twice. A
batch that failed (its whole round lost to a dead sampler or sandbox) is not stored: the checkpoint keeps
the batches before it and the feed's position before it, and a resume samples it again from version c.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from retool.data.problem import Problem
from retool.rollout import Policy
from retool.train.datasource import DataPosition, OrderSnapshot, ProblemFeed
from retool.train.sampling import Batch, StepBatchBuilder

logger = logging.getLogger(__name__)


@dataclass
class PipelineState:
    """What a checkpoint stores of the pipeline: the sampled batches not yet trained, and requeued problems
    still waiting (the stream's own position is the checkpoint's ``data_position``)."""

    max_steps_off_policy: int
    batches: list[Batch]
    replay: list[Problem]


def requeue_stale(
    batches: Sequence[Batch], replay: Sequence[Problem], max_steps_off_policy: int
) -> tuple[list[Batch], list[Problem], int]:
    """Restored batches that the trainer may still use under ``max_steps_off_policy``, the problem feed's
    new replay list, and how many groups were requeued.

    Batch ``t`` is trained at version ``t - 1``. From the first batch older than the bound on, every batch
    is requeued (a later one cannot be kept: its problems were drawn after the requeued ones); their
    problems go first, in the order they were drawn, then the problems that were still waiting.
    """
    keep: list[Batch] = []
    for batch in batches:
        if batch.lag(batch.step - 1) > max_steps_off_policy:
            break
        keep.append(batch)
    stale = list(batches[len(keep) :])
    if not stale:
        return keep, list(replay), 0
    problems = [p for b in stale for p in b.collected.problems]
    groups = sum(len(b.collected.sampled) for b in stale)
    logger.warning(
        "requeued %d sampled batch(es) (steps %s) older than max_steps_off_policy = %d: their %d problems "
        "are sampled again from the resumed weights",
        len(stale),
        ", ".join(str(b.step) for b in stale),
        max_steps_off_policy,
        len(problems),
    )
    return keep, [*problems, *stale[-1].replay], groups


class AheadBatches:
    """Samples each step's batch on the policy version the schedule names, in a background task, and
    keeps the sampled batches until the trainer takes them (module docstring).

    ``steps`` samples one batch; batches ``first_step..last_step`` are sampled, minus the ``restored``
    ones a checkpoint held (consecutive, from ``first_step``).
    """

    def __init__(
        self,
        steps: StepBatchBuilder,
        feed: ProblemFeed,
        *,
        max_steps_off_policy: int,
        first_step: int,
        last_step: int,
        restored: Sequence[Batch] = (),
    ) -> None:
        self.steps = steps
        self.feed = feed
        self.k = max_steps_off_policy
        self.start_version = first_step - 1
        self.last_step = last_step
        self._batches: dict[int, Batch] = {b.step: b for b in restored}
        self._next = first_step + len(restored)  # the next step to sample
        # Where the feed stood after the last batch the trainer took: a checkpoint resumes from there when
        # none of the batches after it could be stored (checkpoints come after a step, so after a take).
        self._taken: tuple[DataPosition, list[Problem], OrderSnapshot | None] = (
            feed.position,
            list(feed.replay),
            feed.snapshot(),
        )
        self._policies: dict[int, Policy] = {}
        self._submitted = -1  # the newest version submitted
        self._error: BaseException | None = None  # what stopped the sampling, at step ``self._next``
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def version_for(self, step: int) -> int:
        """The policy version that samples the batch of ``step``."""
        return max(step - 1 - self.k, self.start_version)

    def start(self) -> None:
        """Start the background task that samples the batches in step order."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sample_ahead(), name="retool-rollouts")

    def submit(self, version: int, policy: Policy) -> None:
        """Make ``policy`` (over the weights of ``version``) available; forget versions no batch needs."""
        self._policies[version] = policy
        self._submitted = max(self._submitted, version)
        needed = self.version_for(self._next)
        for old in [v for v in self._policies if v < needed]:
            del self._policies[old]  # a frozen copy of old weights is freed with it
        self._notify()

    def ready(self) -> int:
        """Batches sampled and waiting."""
        return len(self._batches)

    def _notify(self) -> None:
        self._changed.set()

    async def _changes(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    async def _progress(self, what: str) -> None:
        """Wait for the sampling to move on; refuse to wait for a batch whose weights do not exist yet
        (only the trainer, which is the one waiting, would make them: a schedule bug, not a slow sampler)."""
        needed = self.version_for(self._next)
        if self._error is None and self._next <= self.last_step and needed > self._submitted:
            raise RuntimeError(
                f"waiting for {what}, but batch {self._next} needs policy version {needed} and only versions "
                f"up to {self._submitted} are submitted"
            )
        await self._changes()

    async def _sample_ahead(self) -> None:
        """The background task: each batch in step order, as soon as its policy version is submitted."""
        try:
            while self._next <= self.last_step:
                step = self._next
                version = self.version_for(step)
                while version not in self._policies:
                    await self._changes()
                self._batches[step] = await self.steps.batch(
                    step, self.feed, version, self._policies[version]
                )
                self._next += 1
                self._notify()
        except Exception as exc:  # kept for the trainer, which raises it when it reaches this step
            self._error = exc
            self._notify()

    async def batch_for(self, step: int) -> Batch:
        """Wait for the batch of ``step`` and remove it from the queue (raises what stopped its sampling)."""
        while step not in self._batches:
            if self._error is not None and step >= self._next:
                raise self._error
            if step < self._next or self._task is None:
                raise RuntimeError(f"no batch for step {step}: the sampler is at step {self._next}")
            await self._progress(f"the batch of step {step}")
        batch = self._batches.pop(step)
        self._taken = (batch.position, list(batch.replay), batch.order)
        return batch

    async def drain(self, through: int) -> tuple[PipelineState, DataPosition, OrderSnapshot | None]:
        """Wait until the batches up to step ``through`` are sampled (or one failed); return what a
        checkpoint stores (the batches sampled so far, not taken, and the replay list after the last of
        them), and the order's position and state to resume from (after that batch)."""
        through = min(through, self.last_step)
        while self._next <= through and self._error is None:
            await self._progress(f"the batches up to step {through}")
        kept = [self._batches[s] for s in sorted(self._batches) if s <= through]
        position, replay, order = (
            (kept[-1].position, kept[-1].replay, kept[-1].order) if kept else self._taken
        )
        return PipelineState(self.k, kept, list(replay)), DataPosition(**asdict(position)), order

    async def aclose(self) -> None:
        """Stop the sampling (a batch in flight is cancelled: lost, never half-stored)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._policies.clear()


def pipeline_metrics(batch: Batch, trainer_version: int, queued: int, requeued: int) -> dict[str, float]:
    """``offpolicy/*`` bookkeeping of one step: the lag of its trajectories (trainer version minus the
    version that sampled each), batches already waiting when it started, groups requeued since the run
    started."""
    lags = [
        trainer_version - t.policy_version
        for g in batch.collected.sampled
        for t in g
        if t.policy_version is not None
    ]
    return {
        "offpolicy/lag_mean": sum(lags) / len(lags) if lags else 0.0,
        "offpolicy/lag_max": float(max(lags, default=0)),
        "offpolicy/policy_version": float(batch.version),
        "offpolicy/queued_batches": float(queued),
        "offpolicy/requeued_groups": float(requeued),
    }
