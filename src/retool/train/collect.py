"""Which groups a step trains on: one sampling round (the chapter), or DAPO's dynamic sampling.

Dynamic sampling over-samples questions, drops the groups whose rewards are all equal (every advantage
is zero, so they carry no gradient) and samples further rounds until ``target`` informative groups are
collected or ``max_extra_rounds`` extra rounds are spent; then the step trains on what it has. Extra
informative groups of the last round are dropped (in sampling order), so every step trains on at most
``target`` groups, as in DAPO.

Every sampled group still counts in the step's task / tool / environment metrics: they describe the
policy, and the kept groups alone would be a biased sample of it.

With ``filters.roc`` (Resample-on-Correct, ``retool.train.roc``) every sampled group is oversampled and
down-sampled to the group size before the informative check; ``sampled`` keeps the whole oversampled
groups (the policy's picture), ``groups`` the down-sampled ones.

Rounds draw their problems from the run's ``ProblemStream`` (so a resumed run draws the same ones) and
their sampling seed from ``(step seed, round)``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from retool.config import FiltersConfig
from retool.data.problem import Problem
from retool.rollout.types import Trajectory
from retool.train.roc import resample_on_correct, tool_error_metrics
from retool.train.step import is_degenerate

# (problems, round index) -> one group of trajectories per problem, rewards final.
SampleRound = Callable[[list[Problem], int], Awaitable[list[list[Trajectory]]]]
# how many problems -> the next problems of the run's stream
NextProblems = Callable[[int], list[Problem]]


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


def round_seed(step_seed: int, round_index: int) -> int:
    """Round 0 keeps the step's seed (dynamic sampling off samples exactly as before); later rounds differ."""
    return step_seed if round_index == 0 else (step_seed + 1_000_033 * round_index) % (2**31 - 1)


def questions_for_round(missing: int, oversample: float) -> int:
    return max(1, math.ceil(oversample * missing - 1e-9))


def _rewards(group: Sequence[Trajectory]) -> list[float]:
    return [float(t.reward) for t in group]


def _down_sample(
    out: Collected,
    groups: list[list[Trajectory]],
    filters: FiltersConfig,
    size: int,
    seed: int,
    round_index: int,
) -> list[list[Trajectory]]:
    """A round's groups as trained (down-sampled under RoC); counts what RoC left out in ``out``."""
    kept = resample_on_correct(groups, filters, size, seed, round_index)
    out.roc_dropped += sum(len(g) for g in groups) - sum(len(g) for g in kept)
    return kept


async def collect_groups(
    sample_round: SampleRound,
    next_problems: NextProblems,
    target: int,
    filters: FiltersConfig,
    *,
    group_size: int = 0,
    seed: int = 0,
) -> Collected:
    """Sample this step's groups; with ``filters.dynamic_sampling`` keep only informative ones; with
    ``filters.roc`` down-sample each group to ``group_size`` (draws seeded by ``seed`` and the round)."""
    if target < 1:
        raise ValueError(f"questions per step must be >= 1, got {target}")
    if filters.roc and group_size < 1:
        raise ValueError(f"filters.roc needs the group size to keep, got {group_size}")
    out = Collected(groups=[])
    if not filters.dynamic_sampling:
        problems = next_problems(target)
        groups = await sample_round(problems, 0)
        out.groups = _down_sample(out, groups, filters, group_size, seed, 0)
        out.sampled, out.problems = list(groups), list(problems)
        out.informative = sum(not is_degenerate(_rewards(g)) for g in out.groups)
        return out

    kept: list[list[Trajectory]] = []
    for round_index in range(1 + filters.max_extra_rounds):
        missing = target - len(kept)
        if missing <= 0:
            break
        problems = next_problems(questions_for_round(missing, filters.oversample))
        groups = await sample_round(problems, round_index)
        out.rounds = round_index + 1
        out.sampled.extend(groups)
        out.problems.extend(problems)
        trained = _down_sample(out, groups, filters, group_size, seed, round_index)
        good = [g for g in trained if not is_degenerate(_rewards(g))]
        out.informative += len(good)
        kept.extend(good)
    out.groups = kept[:target]
    return out
