"""Resample-on-Correct (``filters.roc``): the down-sampling rule, its settings, its metrics, and a run with
it on together with dynamic sampling and off-policy pipelining (fake backend)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retool.config import ConfigError, FiltersConfig, load_config
from retool.data.problem import Problem
from retool.env import ReToolOutcome
from retool.env.types import AssistantTurn
from retool.rollout.types import Trajectory, Transition
from retool.sandbox.base import ExecResult
from retool.train.metrics import rollout_metrics
from retool.train.roc import (
    downsample_group,
    format_problems,
    kept_failures,
    resample_on_correct,
    sampled_group_size,
    tool_errors,
)
from test_train_loop import as_rollout_fn, read_metrics, scripted_rollouts
from test_train_pipeline import config, trainer

PROBLEM = Problem("p1", "What is 1+1?", "2")
OK = ExecResult(True, "2\n", "", 0, False, 0.01)
FAIL = ExecResult(False, "", "Traceback ...", 1, False, 0.01)
TIMEOUT = ExecResult(False, "", "", None, True, 5.0)


def make(
    branch: int,
    correct: bool,
    results: tuple[ExecResult, ...] = (),
    *,
    invalid_turns: int = 0,
    stop: str = "answer",
    valid_format: bool | None = None,
    final_text: str = "\\boxed{2}",
) -> Trajectory:
    kinds = ["invalid"] * invalid_turns + ["tool"] * len(results) + ["answer"]
    turns = tuple(  # each prompt extends the last: prompt + 2 sampled tokens + 1 observation token
        Transition(
            AssistantTurn([1, *[2, 3, 9] * i], [2, 3], [-0.1, -0.1], "t", kind=k), 0.0, i == len(kinds) - 1
        )
        for i, k in enumerate(kinds)
    )
    return Trajectory(
        problem=PROBLEM,
        group_index=branch,
        transitions=turns,
        reward=1.0 if correct else -1.0,
        outcome=ReToolOutcome(
            stop_reason=stop,
            correct=correct,
            valid_format=correct if valid_format is None else valid_format,
            exec_results=results,
            codes=tuple("print(2)" for _ in results),
            final_text=final_text,
        ),
    )


# -- what counts ------------------------------------------------------------------------------------


def test_tool_errors_count_failed_and_timed_out_runs_dead_executors_and_unparsable_turns() -> None:
    assert tool_errors(make(0, True, (OK, OK))) == 0
    assert tool_errors(make(0, True, (FAIL, OK, TIMEOUT))) == 2
    assert tool_errors(make(0, False, (OK,), stop="executor_error")) == 1
    assert tool_errors(make(0, False, invalid_turns=1)) == 1
    assert format_problems(make(0, True)) == 0
    assert format_problems(make(0, True, final_text="\\boxed{2} or \\boxed{3}")) == 1
    assert format_problems(make(0, False, valid_format=False, final_text="2")) == 1


# -- the down-sampling rule -------------------------------------------------------------------------


def test_successes_with_fewest_tool_errors_then_format_problems_survive() -> None:
    group = [
        make(0, True, (FAIL, FAIL, OK)),  # 2 tool errors
        make(1, False, (OK,)),
        make(2, True, (OK,), final_text="\\boxed{2} \\boxed{2}"),  # clean calls, a format problem
        make(3, True, (TIMEOUT, OK)),  # 1 tool error
        make(4, True, (OK,)),  # clean
        make(5, False, (FAIL,)),
        make(6, True, (OK, OK)),  # clean
        make(7, True, (FAIL, OK)),  # 1 tool error
    ]
    # 2 failures of 8 -> 1 of 4 kept (the sampled share); 3 successes: the two clean ones, then the one
    # with a format problem before any with a tool error.
    for seed in range(20):
        kept = downsample_group(group, 4, 1, random.Random(seed))
        assert len(kept) == 4
        successes = [t.group_index for t in kept if t.outcome.correct]
        assert successes == [2, 4, 6]
        assert [t.group_index for t in kept] == sorted(t.group_index for t in kept)  # sampling order
        assert sum(not t.outcome.correct for t in kept) == 1


def test_failures_are_drawn_uniformly_and_reproducibly() -> None:
    group = [make(i, False, (FAIL,) * (i % 3)) for i in range(8)]
    picks = {tuple(t.group_index for t in downsample_group(group, 4, 1, random.Random(s))) for s in range(40)}
    assert len(picks) > 10  # a uniform draw, not the ones with fewest errors
    counts = [0] * 8
    for s in range(400):
        for t in downsample_group(group, 4, 1, random.Random(s)):
            counts[t.group_index] += 1
    assert all(150 < c < 250 for c in counts)  # each kept with probability 1/2 (200 of 400 expected)
    a = downsample_group(group, 4, 1, random.Random("roc:7:0:3"))
    b = downsample_group(group, 4, 1, random.Random("roc:7:0:3"))
    assert a == b


def test_minimum_failures_are_kept_when_successes_dominate() -> None:
    # 1 failure among 16: its share of 4 rounds to 0, the floor keeps it.
    group = [make(i, i != 9, (OK,)) for i in range(16)]
    kept = downsample_group(group, 4, 1, random.Random(0))
    assert [t.group_index for t in kept if not t.outcome.correct] == [9] and len(kept) == 4
    assert all(t.outcome.correct for t in downsample_group(group, 4, 0, random.Random(0)))  # floor 0: none
    # the floor asks for more failures than were sampled: all of them
    assert kept_failures(1, 15, 4, 3) == 1
    assert kept_failures(3, 13, 4, 3) == 3
    assert kept_failures(2, 6, 4, 0) == 1  # the sampled share
    assert kept_failures(3, 5, 4, 0) == 2  # 1.5 rounds half up
    assert kept_failures(7, 1, 4, 0) == 3  # the share rounds to 4; the one success sampled stays
    assert kept_failures(8, 0, 4, 0) == 4  # no successes: failures fill the group
    assert kept_failures(0, 8, 4, 2) == 0  # no failures: successes fill it


def test_group_size_and_off_switch() -> None:
    group = [make(i, i % 2 == 0, (FAIL,) * (i % 3)) for i in range(9)]
    on = FiltersConfig(roc=True, roc_oversample=2.25, roc_min_failures=2)
    assert sampled_group_size(4, on) == 9 and sampled_group_size(4, FiltersConfig()) == 4
    out = resample_on_correct([group, group[:4]], on, 4, seed=3, round_index=1)
    assert [len(g) for g in out] == [4, 4]
    assert out[1] == group[:4]  # nothing to drop
    assert out == resample_on_correct([group, group[:4]], on, 4, seed=3, round_index=1)
    groups = [group]
    assert resample_on_correct(groups, FiltersConfig(), 4, 3, 0)[0] is group


def test_roc_settings_are_validated() -> None:
    assert load_config(None, ["filters.roc=true"]).filters.roc_oversample == 2.0
    with pytest.raises(ConfigError, match=r"roc_oversample"):
        load_config(None, ["filters.roc=true", "filters.roc_oversample=1.0"])
    small = load_config(None, ["filters.roc=true", "rollout.group_size=8", "filters.roc_oversample=1.1"])
    assert sampled_group_size(8, small.filters) == 9  # any factor above 1 leaves one to drop
    with pytest.raises(ConfigError, match=r"roc_min_failures"):
        load_config(None, ["filters.roc=true", "rollout.group_size=4", "filters.roc_min_failures=5"])
    with pytest.raises(ConfigError, match=r"roc_min_failures"):
        load_config(None, ["filters.roc_min_failures=-1"])
    with pytest.raises(ConfigError, match=r"roc_oversample"):
        load_config(None, ["filters.roc_oversample=0.5"])


# -- metrics ----------------------------------------------------------------------------------------


def test_tool_error_rates_among_correct_and_wrong_trajectories() -> None:
    group = [
        make(0, True, (FAIL, OK)),
        make(1, True, (OK,)),
        make(2, True, (OK,)),
        make(3, True, ()),
        make(4, False, (TIMEOUT,)),
        make(5, False, (OK,)),
    ]
    m = rollout_metrics([group])
    assert m["tool/error_rate_correct"] == 0.25
    assert m["tool/error_rate_wrong"] == 0.5
    assert m["tool/errors_per_trajectory"] == pytest.approx(2 / 6)
    assert m["tool/mean_code_calls"] == pytest.approx(6 / 6)
    assert m["policy/response_length"] == pytest.approx(2 * (3 + 2 + 2 + 1 + 2 + 2) / 6)  # 2 a turn


# -- in training: with dynamic sampling and one step off-policy -----------------------------------


def noisy_rollouts() -> Any:
    """Scripted groups where some branches hit a failing execution, and which notes the group sizes asked."""
    sizes: list[int] = []

    async def rollouts(problems: Any, *, group_size: int, **kw: Any) -> Any:
        sizes.append(group_size)
        groups = await scripted_rollouts(problems, group_size=group_size, **kw)
        return [
            [
                replace(
                    t,
                    outcome=replace(t.outcome, exec_results=(FAIL, OK) if t.group_index % 3 == 0 else (OK,)),
                )
                for t in g
            ]
            for g in groups
        ]

    return as_rollout_fn(rollouts), sizes


def test_training_with_roc_dynamic_sampling_and_off_policy(tmp_path: Path) -> None:
    extra = ["filters.roc=true", "filters.dynamic_sampling=true", "filters.max_extra_rounds=2"]
    runs = []
    for name in ("a", "b"):
        rollout_fn, sizes = noisy_rollouts()
        trainer(config(1, 4, 2, *extra), tmp_path / name, rollout_fn=rollout_fn).run()
        assert set(sizes) == {8}  # group_size 4, oversampled x2
        runs.append(read_metrics(tmp_path / name))
    rows = runs[0]
    assert len(rows) == 4
    for r in rows:
        sampled, kept = r["sampling/groups_sampled"], r["sampling/groups_kept"]
        assert all(len(g) == 8 for g in r["rewards"]) and len(r["rewards"]) == sampled
        assert r["sampling/roc_dropped"] == 4 * sampled
        assert r["train/datums"] == 4 * kept  # kept groups hold the group size
        for key in ("tool/error_rate_correct", "tool/error_rate_wrong", "tool/mean_code_calls"):
            assert 0.0 <= r[key] <= 2.0
        assert r["policy/response_length"] > 0
    assert any(r["offpolicy/lag_max"] == 1.0 for r in rows)
    # With many clean successes to choose from, RoC keeps the erroring ones out.
    assert sum(r["roc/error_rate_correct_kept"] for r in rows) < sum(
        r["tool/error_rate_correct"] for r in rows
    )
    strip = ("time/", "pipeline/")
    assert [{k: v for k, v in r.items() if not k.startswith(strip)} for r in runs[0]] == [
        {k: v for k, v in r.items() if not k.startswith(strip)} for r in runs[1]
    ]


def test_roc_is_off_in_every_preset() -> None:
    from retool.config import preset_names

    names = preset_names()  # the general presets and every recipe's
    assert {"chapter", "demo-tiny", "demo-gsm8k"} <= set(names)
    for name in names:
        assert load_config(name).filters.roc is False, name
