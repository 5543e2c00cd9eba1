"""Sampling, groups and steps: the one module that turns problems into the groups a step trains on.

Groups. A ``GroupRollouts`` binds a problem source to the setup of one mode (``retool.env.retool.ToolSetup``:
the tool on, or none for text-only) and to the rollout settings. ``sample(problems, policy, group_size=,
seed=)`` asks the source for the batch's groups (``ProblemSource.group_builders``: one builder per
problem, its index its position, each owning its environments and their scoring) and rolls them out in
one ``RolloutRequest`` with the rollout function (``retool.rollout.engine.run_rollout`` unless a caller
injects its own). The trainer (one sampler per mode), the evaluator and ``run_group_rollouts`` (the
default ReTool environments from loose parts, for scripts and benchmarks) all sample through it;
``GroupRollouts.from_parts`` builds the setup from a run's components and config.

Steps. ``StepBatchBuilder.sample(step, feed, policy)`` draws a round of questions from the feed, rolls each out
as a group with the group samplers (the last ``rollout.text_only_share`` of a round's questions
text-only, the rest with the tool) and keeps what the filters let through:

- one round (the chapter), every group kept; or DAPO's dynamic sampling: over-sample questions, drop the
  groups whose rewards are all equal (not ``retool.train.step.is_informative``: every advantage is zero,
  no gradient) and sample further rounds until ``questions_per_step`` informative groups are collected or
  ``max_extra_rounds`` extra rounds are spent; then the step trains on what it has. Extra informative
  groups of the last round are dropped (in sampling order), so every step trains on at most
  ``questions_per_step`` groups, as in DAPO.
- with ``filters.roc`` (Resample-on-Correct, ``retool.train.roc``) every sampled group is oversampled and
  down-sampled to the group size before the informative check; ``sampled`` keeps the whole oversampled
  groups (the policy's picture), ``groups`` the down-sampled ones.

"All rewards equal" is decided here, once per trained group: ``Collected.group_informative`` holds the
verdict beside ``groups`` and ``build_step_data`` trains the groups it marks, without deciding again.
Without dynamic sampling the uninformative groups stay in ``groups`` (marked False): they still count in
``sampling/groups_kept`` and in the trained trajectories the ``filter/*`` rates divide by.

Every sampled group still counts in the step's task / tool / environment metrics: they describe the
policy, and the kept groups alone would be a biased sample of it. A round whose trajectories were all
lost to a dead sampler or sandbox stops the run (``raise_if_step_lost``) instead of burning steps.

Every sampled group, kept or not, is shown to the feed once its round is done (``ProblemFeed.observe``),
before the next round draws: the pass-rate order (``retool.train.selection``) learns from it.

Seeds: a step samples with ``rollout_seed(train.seed, step)``, round r with ``round_seed(that, r)``
(the text-only share with that seed ``^ 0x5EED``), so a redone or resumed step samples alike; rounds
draw their problems from the run's feed, so a resumed run draws the same ones.

Batches. ``StepBatchBuilder.batch(step, feed, version, policy)`` is one step's ``Batch``: its groups, every
trajectory tagged with the policy version that sampled it, and where the feed stood after it. The
synchronous loop (``retool.train.loop``) asks for it when the step starts; with
``train.max_steps_off_policy >= 1`` ``retool.train.ahead`` asks for the batches of later steps while
earlier ones train.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from retool.components import Components
from retool.config import Config, FiltersConfig, RolloutConfig, SamplingConfig
from retool.data.problem import Problem
from retool.env.retool import Budgets, Tool, ToolSetup
from retool.env.scoring import VerifierLike
from retool.env.source import EnvSetup, ProblemList, ProblemSource
from retool.protocol import ChatProtocol
from retool.rollout.engine import OnTrajectory, Policy, RolloutFn, RolloutRequest, run_rollout
from retool.rollout.types import Trajectory
from retool.train.datasource import DataPosition, OrderSnapshot, ProblemFeed
from retool.train.metrics import raise_if_step_lost
from retool.train.roc import resample_on_correct, sampled_group_size, tool_error_metrics
from retool.train.step import is_informative

# -- groups: one mode's groups of a batch of problems ---------------------------------------------------


@dataclass(frozen=True)
class GroupRollouts:
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
    ) -> GroupRollouts:
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
    benchmarks; the trainer and the evaluator hold a ``GroupRollouts`` of their own), through
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
    groups = GroupRollouts(source, setup, sampling, rollout.max_inflight_samples, rollout_fn)
    return await groups.sample(
        problems, sampler, group_size=group_size, seed=seed, on_trajectory=on_trajectory
    )


# -- steps: which groups one step trains on -------------------------------------------------------------


@dataclass
class Collected:
    """The outcome of one step's sampling.

    Checkpoints record it (``retool.train.ahead.PipelineState``, ``retool.train.state_json``): a change of
    its fields is a change of ``retool.train.checkpoint.CHECKPOINT_FORMAT``.
    """

    groups: list[list[Trajectory]]  # the groups to train on (informative ones when dynamic sampling is on)
    sampled: list[list[Trajectory]] = field(default_factory=list)  # every group sampled this step, in order
    problems: list[Problem] = field(default_factory=list)  # the problem of each sampled group
    rounds: int = 1
    informative: int = 0  # sampled groups with differing rewards (before the cut to ``target``)
    roc_dropped: int = 0  # trajectories Resample-on-Correct left out (0 when it is off)
    # Per group of ``groups``: its rewards differ (``is_informative``), decided when it was sampled. None
    # when the groups did not come through the step sampler (``build_step_data`` then decides).
    group_informative: tuple[bool, ...] | None = None
    # Per group of ``groups``, per trajectory: where it sits in ``sampled`` (group, branch). Empty when the
    # groups did not come through the step builder (they are then the sampled groups themselves).
    origin: list[list[tuple[int, int]]] = field(default_factory=list)

    def with_policy_version(self, version: int) -> Collected:
        """The same groups, every trajectory tagged with the policy version that sampled it (a trained
        group is one of the sampled groups, so both lists keep sharing their records)."""
        stamped = {id(traj): traj.with_policy_version(version) for group in self.sampled for traj in group}
        for group in self.groups:  # a caller may train on groups it did not list as sampled
            for traj in group:
                stamped.setdefault(id(traj), traj.with_policy_version(version))

        def restamp(groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
            return [[stamped[id(traj)] for traj in group] for group in groups]

        return replace(self, groups=restamp(self.groups), sampled=restamp(self.sampled))

    def tag_origins(self) -> None:
        """Record where each trained trajectory sits in ``sampled`` (RoC and dynamic sampling keep some
        trajectories of some groups), so the trajectory log writes the step's own map."""
        where = {id(t): (g, b) for g, group in enumerate(self.sampled) for b, t in enumerate(group)}
        self.origin = [[where[id(t)] for t in group] for group in self.groups]

    def metrics(self) -> dict[str, float]:
        return {
            "sampling/rounds": float(self.rounds),
            "sampling/groups_sampled": float(len(self.sampled)),
            "sampling/groups_informative": float(self.informative),
            # informative sampled groups over all sampled groups, every dynamic-sampling round counted
            "sampling/informative_share": self.informative / len(self.sampled) if self.sampled else 0.0,
            "sampling/groups_kept": float(len(self.groups)),
        }

    def roc_metrics(self) -> dict[str, float]:
        """What Resample-on-Correct left out, and the tool-error rates of the trajectories kept to train."""
        kept = [t for g in self.groups for t in g]
        trained = tool_error_metrics(kept)
        return {
            "sampling/roc_dropped": float(self.roc_dropped),
            "roc/error_rate_correct_kept": trained["tool/error_rate_correct"],
            "roc/error_rate_wrong_kept": trained["tool/error_rate_wrong"],
        }


@dataclass
class Batch:
    """One step's sampling, ready to train: which version sampled it and where the feed stood after it."""

    step: int
    version: int
    collected: Collected
    position: DataPosition  # the stream's position after this batch drew its problems
    replay: list[Problem] = field(default_factory=list)  # requeued problems still waiting after it
    seconds: float = 0.0  # wall time of its sampling
    order: OrderSnapshot | None = None  # an adaptive order's state after it (None: epoch order)

    def lag(self, trainer_version: int) -> int:
        return trainer_version - self.version


def rollout_seed(base_seed: int, step: int) -> int:
    """The sampling seed of a step: fixed by the run seed and the step, so a redone step samples alike."""
    return (base_seed * 1_000_003 + step * 7919) % (2**31 - 1)


def round_seed(step_seed: int, round_index: int) -> int:
    """Round 0 keeps the step's seed (dynamic sampling off samples exactly as before); later rounds differ."""
    return step_seed if round_index == 0 else (step_seed + 1_000_033 * round_index) % (2**31 - 1)


async def sample_by_size(
    groups: GroupRollouts, problems: list[Problem], sizes: list[int], policy: Policy, size: int, seed: int
) -> list[list[Trajectory]]:
    """One group per problem, in order, problem i's of ``sizes[i]`` trajectories: one rollout request per
    size. Problems of the usual ``size`` keep ``seed``, so a round where every group has it samples exactly
    as one request would; another size n samples with a seed of its own."""
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        by_size.setdefault(n, []).append(i)
    if set(by_size) <= {size}:
        return await groups.sample(problems, policy, group_size=size, seed=seed)
    sampled = await asyncio.gather(
        *(
            groups.sample(
                [problems[i] for i in where],
                policy,
                group_size=n,
                seed=seed if n == size else (seed + 7919 * n) % (2**31 - 1),
            )
            for n, where in by_size.items()
        )
    )
    out: dict[int, list[Trajectory]] = {}
    for where, result in zip(by_size.values(), sampled, strict=True):
        out.update(zip(where, result, strict=True))
    return [out[i] for i in range(len(problems))]


def text_only_count(n_questions: int, share: float) -> int:
    """How many of a round's questions go text-only: ``share`` of them, rounded, at least one when
    ``share > 0`` and the round has two or more questions (a round of one stays in tool mode)."""
    if share <= 0.0 or n_questions < 2:
        return 0
    return min(n_questions - 1, max(1, round(share * n_questions)))


def questions_for_round(missing: int, oversample: float) -> int:
    return max(1, math.ceil(oversample * missing - 1e-9))


class StepBatchBuilder:
    """Samples one step's batch with a policy (module docstring): ``tools`` rolls out the tool-mode
    questions, ``text`` the text-only share (needed only when ``rollout.text_only_share > 0``)."""

    def __init__(
        self,
        tools: GroupRollouts,
        text: GroupRollouts | None,
        rollout: RolloutConfig,
        filters: FiltersConfig,
        *,
        seed: int,
    ) -> None:
        self.tools, self.text = tools, text
        self.rollout, self.filters, self.seed = rollout, filters, seed

    async def batch(self, step: int, feed: ProblemFeed, version: int, policy: Policy) -> Batch:
        """The batch of ``step`` sampled now with ``policy`` (the weights of ``version``), every trajectory
        tagged with that version, and where the feed stands after it."""
        t0 = time.perf_counter()
        collected = (await self.sample(step, feed, policy)).with_policy_version(version)
        seconds = time.perf_counter() - t0
        return Batch(step, version, collected, feed.position, list(feed.replay), seconds, feed.snapshot())

    async def sample(self, step: int, feed: ProblemFeed, policy: Policy) -> Collected:
        """This step's groups, rewards final, each with its verdict; with ``filters.dynamic_sampling``
        only informative ones; with ``filters.roc`` each down-sampled to the group size."""
        target, group_size = self.rollout.questions_per_step, self.rollout.group_size
        if target < 1:
            raise ValueError(f"questions per step must be >= 1, got {target}")
        if self.filters.roc and group_size < 1:
            raise ValueError(f"filters.roc needs the group size to keep, got {group_size}")
        if self.filters.dynamic_sampling:
            return await self._dynamic_rounds(step, feed, policy)
        out = Collected(groups=[])
        problems = feed.next_batch(target)
        groups = await self._sample_round(step, 0, problems, policy, feed)
        feed.observe(problems, groups)
        out.groups = self._down_sample(out, groups, step, 0)
        out.sampled, out.problems = list(groups), list(problems)
        out.group_informative = tuple(is_informative(g) for g in out.groups)
        out.informative = sum(out.group_informative)
        out.tag_origins()
        return out

    async def _dynamic_rounds(self, step: int, feed: ProblemFeed, policy: Policy) -> Collected:
        """DAPO's dynamic sampling: rounds until ``questions_per_step`` informative groups (or no rounds left)."""
        target, filters = self.rollout.questions_per_step, self.filters
        out = Collected(groups=[])
        kept: list[list[Trajectory]] = []
        for round_index in range(1 + filters.max_extra_rounds):
            missing = target - len(kept)
            if missing <= 0:
                break
            problems = feed.next_batch(questions_for_round(missing, filters.oversample))
            groups = await self._sample_round(step, round_index, problems, policy, feed)
            feed.observe(problems, groups)  # before the next round draws: a pass-rate order adapts
            out.rounds = round_index + 1
            out.sampled.extend(groups)
            out.problems.extend(problems)
            trained = self._down_sample(out, groups, step, round_index)
            good = [g for g in trained if is_informative(g)]
            out.informative += len(good)
            kept.extend(good)
        out.groups = kept[:target]
        out.group_informative = (True,) * len(out.groups)  # only informative groups were kept
        out.tag_origins()
        return out

    async def _sample_round(
        self, step: int, round_index: int, problems: list[Problem], policy: Policy, feed: ProblemFeed
    ) -> list[list[Trajectory]]:
        """One group per problem, in order: the round's last questions text-only under
        ``rollout.text_only_share``, the others with the tool (oversampled under RoC), each of the size
        the feed's order gives it (``rollout.group_size``, or the pass-rate order's rare-success size)."""
        seed = round_seed(rollout_seed(self.seed, step), round_index)
        split = len(problems) - text_only_count(len(problems), self.rollout.text_only_share)
        size = sampled_group_size(self.rollout.group_size, self.filters)
        sizes = [
            sampled_group_size(feed.group_size(p, self.rollout.group_size), self.filters) for p in problems
        ]
        if split < len(problems) and self.text is None:
            raise ValueError("rollout.text_only_share > 0 needs a text-only group sampler")
        text = self.text or self.tools  # with no text-only sampler the text part is empty
        tool_groups, text_groups = await asyncio.gather(
            sample_by_size(self.tools, problems[:split], sizes[:split], policy, size, seed),
            sample_by_size(text, problems[split:], sizes[split:], policy, size, seed ^ 0x5EED),
        )
        groups = [*tool_groups, *text_groups]
        raise_if_step_lost(groups, step)
        return groups

    def _down_sample(
        self, out: Collected, groups: list[list[Trajectory]], step: int, round_index: int
    ) -> list[list[Trajectory]]:
        """A round's groups as trained (down-sampled under RoC); counts what RoC left out in ``out``."""
        seed = rollout_seed(self.seed, step)
        kept = resample_on_correct(groups, self.filters, self.rollout.group_size, seed, round_index)
        out.roc_dropped += sum(len(g) for g in groups) - sum(len(g) for g in kept)
        return kept
