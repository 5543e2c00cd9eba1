"""The chapter's round-synchronous rollout scheduling, kept as a comparison (``bench/rollout.py``, the
``round-sync`` arm of ``bench/peers.py``): every active trajectory samples, then every environment steps
(runs its pending code), then a barrier; repeat.

The project rolls out per trajectory (``retool.rollout.run_rollout``: no barrier, sampling and tool
execution overlap). This is the same engine's steps (``retool.rollout.engine.Scheduler``) in rounds, so
it asks the sampler the same requests with the same seeds and, with a deterministic sampler and tool,
produces the same trajectories; only the wall time differs.
"""

from __future__ import annotations

from retool.rollout.engine import RolloutRequest, Scheduler, gather_all
from retool.rollout.types import Trajectory


class RoundSyncScheduler(Scheduler):
    """``Scheduler`` with a barrier after every round of sampling and stepping."""

    async def run_round_sync(self) -> list[list[Trajectory]]:
        """Every active trajectory samples, then every environment steps (the round barrier), repeat."""
        groups = [self._start(b) for b in self.request.groups]
        firsts = await gather_all([self._first_actions(runs) for runs in groups])
        pending = [
            (run, action)
            for runs, actions in zip(groups, firsts, strict=True)
            for run, action in zip(runs, actions, strict=True)
            if action is not None
        ]
        while pending:
            await gather_all([self._step(run, *action) for run, action in pending])
            active = [run for run, _ in pending if run.observation is not None]
            actions = await gather_all([self._sample_one(run) for run in active])
            pending = [(run, a) for run, a in zip(active, actions, strict=True) if a is not None]
        return [await self._finish(b, runs) for b, runs in zip(self.request.groups, groups, strict=True)]


async def run_round_sync(request: RolloutRequest) -> list[list[Trajectory]]:
    """A ``retool.rollout.RolloutFn`` rolling ``request`` out round by round (one list, a group, per builder)."""
    if not request.groups:
        return []
    return await RoundSyncScheduler(request).run_round_sync()
