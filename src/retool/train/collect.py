"""One step's batch: which groups a step trains on, sampled round by round (``StepSampler``).

``StepSampler.sample(step, feed, policy)`` draws a round of questions from the feed, rolls each out as a
group with the policy (``retool.rollout.GroupSampler``: the last ``rollout.text_only_share`` of a round's
questions text-only, the rest with the tool) and keeps what the filters let through:

- one round (the chapter), every group kept (``build_step_data`` trains the informative ones); or DAPO's
  dynamic sampling: over-sample questions, drop the groups whose rewards are all equal (not
  ``retool.train.step.is_informative``: every advantage is zero, no gradient) and sample
  further rounds until ``questions_per_step`` informative groups are collected or ``max_extra_rounds``
  extra rounds are spent; then the step trains on what it has. Extra informative groups of the last
  round are dropped (in sampling order), so every step trains on at most ``questions_per_step`` groups,
  as in DAPO.
- with ``filters.roc`` (Resample-on-Correct, ``retool.train.roc``) every sampled group is oversampled and
  down-sampled to the group size before the informative check; ``sampled`` keeps the whole oversampled
  groups (the policy's picture), ``groups`` the down-sampled ones.

Every sampled group still counts in the step's task / tool / environment metrics: they describe the
policy, and the kept groups alone would be a biased sample of it. A round whose trajectories were all
lost to a dead sampler or sandbox stops the run (``raise_if_step_lost``) instead of burning steps.

Seeds: a step samples with ``rollout_seed(train.seed, step)``, round r with ``round_seed(that, r)``
(the text-only share with that seed ``^ 0x5EED``), so a redone or resumed step samples alike; rounds
draw their problems from the run's feed, so a resumed run draws the same ones.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace

from retool.config import FiltersConfig, RolloutConfig
from retool.data.problem import Problem
from retool.rollout import GroupSampler, Policy, Trajectory
from retool.train.datasource import ProblemFeed
from retool.train.metrics import raise_if_step_lost
from retool.train.roc import resample_on_correct, sampled_group_size, tool_error_metrics
from retool.train.step import is_informative


@dataclass
class Collected:
    """The outcome of one step's sampling."""

    groups: list[list[Trajectory]]  # the groups to train on (informative ones when dynamic sampling is on)
    sampled: list[list[Trajectory]] = field(default_factory=list)  # every group sampled this step, in order
    problems: list[Problem] = field(default_factory=list)  # the problem of each sampled group
    rounds: int = 1
    informative: int = 0  # sampled groups with differing rewards (before the cut to ``target``)
    roc_dropped: int = 0  # trajectories Resample-on-Correct left out (0 when it is off)

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

    def metrics(self) -> dict[str, float]:
        return {
            "sampling/rounds": float(self.rounds),
            "sampling/groups_sampled": float(len(self.sampled)),
            "sampling/groups_informative": float(self.informative),
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


def rollout_seed(base_seed: int, step: int) -> int:
    """The sampling seed of a step: fixed by the run seed and the step, so a redone step samples alike."""
    return (base_seed * 1_000_003 + step * 7919) % (2**31 - 1)


def round_seed(step_seed: int, round_index: int) -> int:
    """Round 0 keeps the step's seed (dynamic sampling off samples exactly as before); later rounds differ."""
    return step_seed if round_index == 0 else (step_seed + 1_000_033 * round_index) % (2**31 - 1)


def text_only_count(n_questions: int, share: float) -> int:
    """How many of a round's questions go text-only: ``share`` of them, rounded, at least one when
    ``share > 0`` and the round has two or more questions (a round of one stays in tool mode)."""
    if share <= 0.0 or n_questions < 2:
        return 0
    return min(n_questions - 1, max(1, round(share * n_questions)))


def questions_for_round(missing: int, oversample: float) -> int:
    return max(1, math.ceil(oversample * missing - 1e-9))


class StepSampler:
    """Samples one step's batch with a policy (module docstring): ``tools`` rolls out the tool-mode
    questions, ``text`` the text-only share (needed only when ``rollout.text_only_share > 0``)."""

    def __init__(
        self,
        tools: GroupSampler,
        text: GroupSampler | None,
        rollout: RolloutConfig,
        filters: FiltersConfig,
        *,
        seed: int,
    ) -> None:
        self.tools, self.text = tools, text
        self.rollout, self.filters, self.seed = rollout, filters, seed

    async def sample(self, step: int, feed: ProblemFeed, policy: Policy) -> Collected:
        """This step's groups, rewards final; with ``filters.dynamic_sampling`` only informative ones;
        with ``filters.roc`` each down-sampled to the group size."""
        target, group_size = self.rollout.questions_per_step, self.rollout.group_size
        if target < 1:
            raise ValueError(f"questions per step must be >= 1, got {target}")
        if self.filters.roc and group_size < 1:
            raise ValueError(f"filters.roc needs the group size to keep, got {group_size}")
        if self.filters.dynamic_sampling:
            return await self._dynamic_rounds(step, feed, policy)
        out = Collected(groups=[])
        problems = feed.next_batch(target)
        groups = await self._sample_round(step, 0, problems, policy)
        out.groups = self._down_sample(out, groups, step, 0)
        out.sampled, out.problems = list(groups), list(problems)
        out.informative = sum(is_informative(g) for g in out.groups)
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
            groups = await self._sample_round(step, round_index, problems, policy)
            out.rounds = round_index + 1
            out.sampled.extend(groups)
            out.problems.extend(problems)
            trained = self._down_sample(out, groups, step, round_index)
            good = [g for g in trained if is_informative(g)]
            out.informative += len(good)
            kept.extend(good)
        out.groups = kept[:target]
        return out

    async def _sample_round(
        self, step: int, round_index: int, problems: list[Problem], policy: Policy
    ) -> list[list[Trajectory]]:
        """One group per problem, in order: the round's last questions text-only under
        ``rollout.text_only_share``, the others with the tool (oversampled under RoC)."""
        seed = round_seed(rollout_seed(self.seed, step), round_index)
        split = len(problems) - text_only_count(len(problems), self.rollout.text_only_share)
        size = sampled_group_size(self.rollout.group_size, self.filters)
        if split < len(problems) and self.text is None:
            raise ValueError("rollout.text_only_share > 0 needs a text-only group sampler")
        text = self.text or self.tools  # with no text-only sampler the text part is empty
        tool_groups, text_groups = await asyncio.gather(
            self.tools.sample(problems[:split], policy, group_size=size, seed=seed),
            text.sample(problems[split:], policy, group_size=size, seed=seed ^ 0x5EED),
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
