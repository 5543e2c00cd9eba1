"""From problems to sampled groups: the one place where a problem source's environments meet a policy.

A ``GroupSampler`` binds a problem source to the setup of one mode (``retool.env.retool.ToolSetup``: the
tool on, or none for text-only) and to the rollout settings. ``sample(problems, policy, group_size=,
seed=)`` asks the source for the batch's groups (``ProblemSource.group_builders``: one builder per
problem, its index its position, each owning its environments and their scoring) and rolls them out in
one ``RolloutRequest`` with the rollout function (``retool.rollout.engine.run_rollout`` unless a caller
injects its own). The trainer (one sampler per
mode), the evaluator and ``run_group_rollouts`` (the default ReTool environments from loose parts, for
scripts and benchmarks) all sample through it; ``GroupSampler.from_parts`` builds the setup from a run's
components and config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retool.components import Components
from retool.config import Config, RolloutConfig, SamplingConfig
from retool.data.problem import Problem
from retool.env.retool import Budgets, Tool, ToolSetup
from retool.env.scoring import VerifierLike
from retool.env.source import EnvSetup, ProblemList, ProblemSource
from retool.protocol import ChatProtocol
from retool.rollout.engine import OnTrajectory, Policy, RolloutFn, RolloutRequest, run_rollout
from retool.rollout.types import Trajectory


@dataclass(frozen=True)
class GroupSampler:
    """The groups of ``source``'s problems in one mode (``setup``), sampled with ``sampling``'s settings
    through ``rollout_fn``."""

    source: ProblemSource
    setup: EnvSetup
    sampling: SamplingConfig
    max_inflight_samples: int = 64
    rollout_fn: RolloutFn = run_rollout

    @classmethod
    def from_parts(
        cls,
        source: ProblemSource,
        parts: Components,
        config: Config,
        *,
        tools: bool = True,
        rollout_fn: RolloutFn = run_rollout,
    ) -> GroupSampler:
        """ReTool environments of ``source`` with ``parts``' protocol and verifier, the executor as the tool
        (``tools``; otherwise none: text-only, and ``parts.protocol`` must register no tool), the budgets,
        sampling settings and in-flight cap of ``config``."""
        budgets = Budgets.from_config(config.rollout)
        setup = ToolSetup(parts.protocol, parts.executor if tools else None, parts.verifier, budgets)
        return cls(
            source,
            setup,
            config.sampling,
            config.rollout.max_inflight_samples,
            rollout_fn,
        )

    async def sample(
        self,
        problems: Sequence[Problem],
        policy: Policy,
        *,
        group_size: int,
        seed: int,
        on_trajectory: OnTrajectory | None = None,
    ) -> list[list[Trajectory]]:
        """One group of ``group_size`` trajectories per problem, in order (none for no problems)."""
        if not problems:
            return []
        request = RolloutRequest(
            self.source.group_builders(problems, self.setup, group_size),
            policy,
            self.sampling,
            seed=seed,
            max_inflight_samples=self.max_inflight_samples,
            on_trajectory=on_trajectory,
        )
        return await self.rollout_fn(request)


async def run_group_rollouts(
    problems: Sequence[Problem],
    *,
    sampler: Policy,
    protocol: ChatProtocol,
    executor: Tool | None,
    verifier: VerifierLike,
    rollout: RolloutConfig,
    sampling: SamplingConfig,
    group_size: int,
    seed: int = 0,
    use_tools: bool = True,
    on_trajectory: OnTrajectory | None = None,
    rollout_fn: RolloutFn = run_rollout,
) -> list[list[Trajectory]]:
    """The default ReTool environments of ``problems`` rolled out from loose parts (scripts, tests,
    benchmarks; the trainer and the evaluator hold a ``GroupSampler`` of their own), through
    ``rollout_fn`` (a benchmark passes another scheduling).

    ``executor`` is the tool (None only with ``use_tools=False``: text-only); attempts are scored by the
    verifier's check of the final answer.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if use_tools and executor is None:
        raise ValueError("run_group_rollouts(use_tools=True) needs an executor")
    setup = ToolSetup(protocol, executor if use_tools else None, verifier, Budgets.from_config(rollout))
    setup.check()
    source = ProblemList(problems, shuffle=False)
    groups = GroupSampler(source, setup, sampling, rollout.max_inflight_samples, rollout_fn)
    return await groups.sample(
        problems, sampler, group_size=group_size, seed=seed, on_trajectory=on_trajectory
    )
