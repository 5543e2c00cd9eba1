"""Resample-on-Correct (GRPO-RoC, rStar2-Agent, arXiv 2508.20722): which of an oversampled group train.

With ``filters.roc`` each question is rolled out ``ceil(roc_oversample x group_size)`` times
(``sampled_group_size``) and ``downsample_group`` keeps ``group_size`` of them:

- failures (trajectories not ``correct``) uniformly at random: their errors are diverse signal;
- successes ranked by fewest tool errors (``tool_errors``: failed or timed-out executions, an executor
  that died, unparsable turns), then fewest answer-format problems (``format_problems``), ties broken by
  the same seeded random order, so a correct answer reached through tracebacks is the first one dropped;
- the kept share of failures follows the sampled one (rounded), so the group's baseline still estimates
  the policy's success rate, but never below ``min(failures sampled, roc_min_failures)`` (a group keeps
  a negative signal) and never so many that no success is left when one was sampled; failures fill in
  when there are not enough successes (or the reverse).

Every choice draws from ``random.Random`` seeded by (step seed, round, group), so a rerun or a resumed
run keeps the same trajectories. Kept trajectories stay in sampling order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from retool.config import FiltersConfig
from retool.env.retool import retool_outcome
from retool.reward.extract import BOXED_MARKER
from retool.rollout.types import Trajectory


def sampled_group_size(group_size: int, filters: FiltersConfig) -> int:
    """Trajectories rolled out per question: the group size, oversampled when RoC is on."""
    if not filters.roc:
        return group_size
    return math.ceil(group_size * filters.roc_oversample - 1e-9)


def tool_errors(traj: Trajectory) -> int:
    """Tool errors of one trajectory: executions that failed or timed out, an executor that died on a
    call (``executor_error``), and turns the parser could not read as a call or an answer."""
    outcome = retool_outcome(traj.outcome)
    failed = sum(1 for r in outcome.exec_results if not r.ok or r.timed_out)
    died = int(outcome.stop_reason == "executor_error")
    unparsable = sum(1 for turn in traj.turns if turn.kind == "invalid")
    return failed + died + unparsable


def format_problems(traj: Trajectory) -> int:
    """Answer-format problems: no answer in a valid format, and more than one ``\\boxed{}`` in the final
    text (the prompt asks for exactly one)."""
    outcome = traj.outcome
    return int(not outcome.valid_format) + int(outcome.final_text.count(BOXED_MARKER) > 1)


def kept_failures(n_failures: int, n_successes: int, size: int, min_failures: int) -> int:
    """How many failures a down-sampled group of ``size`` keeps (see the module docstring)."""
    total = n_failures + n_successes
    share = math.floor(size * n_failures / total + 0.5) if total else 0  # half up, not to even
    keep = max(share, min(n_failures, min_failures))
    keep = min(keep, size - min(n_successes, 1))  # a sampled success keeps the group informative too
    keep = max(keep, size - n_successes)  # too few successes: failures fill the group
    return min(keep, n_failures, size)


def downsample_group(
    group: Sequence[Trajectory], size: int, min_failures: int, rng: random.Random
) -> list[Trajectory]:
    """``size`` trajectories of an oversampled ``group``, in sampling order (a group no larger is kept)."""
    if len(group) <= size:
        return list(group)
    order = list(range(len(group)))
    rng.shuffle(order)  # the uniform draw of failures, and the tie-break among equal successes
    failures = [i for i in order if not group[i].outcome.correct]
    successes = [i for i in order if group[i].outcome.correct]
    n_fail = kept_failures(len(failures), len(successes), size, min_failures)
    # sorted() is stable: equally clean successes keep their shuffled order
    successes.sort(key=lambda i: (tool_errors(group[i]), format_problems(group[i])))
    chosen = set(failures[:n_fail]) | set(successes[: size - n_fail])
    return [group[i] for i in sorted(chosen)]


def resample_on_correct(
    groups: list[list[Trajectory]], filters: FiltersConfig, size: int, seed: int, round_index: int
) -> list[list[Trajectory]]:
    """Each group down-sampled to ``size`` (the very same group lists when RoC is off)."""
    if not filters.roc:
        return list(groups)
    return [
        downsample_group(g, size, filters.roc_min_failures, random.Random(f"roc:{seed}:{round_index}:{i}"))
        for i, g in enumerate(groups)
    ]


def tool_error_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Share of correct / wrong trajectories with at least one tool error, and tool errors per trajectory."""
    correct = [t for t in trajs if t.outcome.correct]
    wrong = [t for t in trajs if not t.outcome.correct]

    def share(ts: list[Trajectory]) -> float:
        return sum(tool_errors(t) > 0 for t in ts) / len(ts) if ts else 0.0

    return {
        "tool/error_rate_correct": share(correct),
        "tool/error_rate_wrong": share(wrong),
        "tool/errors_per_trajectory": sum(tool_errors(t) for t in trajs) / len(trajs) if trajs else 0.0,
    }
