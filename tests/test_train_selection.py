"""The pass-rate selection (``data.selection = "pass_rate"``, ``retool.train.selection``): the estimates,
the band and its exploration share, the category weighting, determinism, the state in checkpoints (a
resumed run draws the same problems), per-category metrics, and a short fake run where it makes more of
the sampled groups informative than epoch order does on a source with many hopeless problems."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retool.config import ConfigError, PassRateConfig, load_config, override_config
from retool.data.problem import Problem
from retool.env import ProblemList, ReToolOutcome
from retool.env.mathematics import MathematicsSource
from retool.rollout import Trajectory
from retool.train.checkpoint import SELECTION_FILE, CheckpointManager
from retool.train.metrics import category_pass_rates
from retool.train.selection import (
    CATEGORY_PRIOR,
    PassCount,
    PassRateEstimates,
    PassRateSelector,
    mixed_group_probability,
)
from test_train_loop import (
    FakeClient,
    as_rollout_fn,
    fake_components,
    fake_config,
    read_metrics,
    scripted_trajectory,
)
from test_train_pipeline import VersionedClient


def problems(n: int, category: str = "", start: int = 0) -> list[Problem]:
    return [
        Problem(f"{category or 'p'}{i:03d}", f"What is {i}?", str(i), category)
        for i in range(start, start + n)
    ]


def group(problem: Problem, passed: int, size: int = 8, lost: int = 0) -> list[Trajectory]:
    """``size`` trajectories of ``problem``: ``passed`` correct, ``lost`` to a dead sampler, the rest wrong."""

    def one(i: int) -> Trajectory:
        stop = "sampler_error" if i >= size - lost else "answer"
        correct = i < passed
        outcome = ReToolOutcome(correct=correct, valid_format=True, stop_reason=stop)
        return Trajectory(problem=problem, group_index=i, reward=1.0 if correct else -1.0, outcome=outcome)

    return [one(i) for i in range(size)]


def selector(pool: list[Problem], seed: int = 0, state: Any = None, **settings: Any) -> PassRateSelector:
    return PassRateSelector(
        pool, ProblemList(pool).category, PassRateConfig(**settings), group_size=8, seed=seed, state=state
    )


# -- the estimates ---------------------------------------------------------------------------------


def test_counts_fade_and_the_prior_smooths() -> None:
    count = PassCount()
    count.add(8, 8, window=32.0)
    assert (count.passed, count.attempts) == (8.0, 8.0)
    count.add(0, 8, window=32.0)  # the earlier group fades by exp(-8 / 32)
    fade = math.exp(-0.25)
    assert count.passed == pytest.approx(8 * fade) and count.attempts == pytest.approx(8 * fade + 8)
    assert count.rate(0.5, 4.0) == pytest.approx((8 * fade + 2) / (8 * fade + 12))
    for _ in range(200):  # a long run of failures: the estimate follows it, the early passes forgotten
        count.add(0, 8, window=32.0)
    assert count.rate(0.5, 4.0) < 0.06 and count.attempts == pytest.approx(8 / (1 - math.exp(-0.25)))


def test_estimates_per_problem_and_category_with_the_category_as_prior() -> None:
    est = PassRateEstimates(PassRateConfig(prior_attempts=4.0))
    assert est.category_rate("algebra") == CATEGORY_PRIOR  # never seen
    assert est.problem_rate("a1", "algebra") == CATEGORY_PRIOR
    est.observe("a1", "algebra", 0, 8)
    est.observe("a2", "algebra", 8, 8)
    est.observe("a3", "algebra", 0, 0)  # a group with nothing counted is no evidence
    assert "a3" not in est.problems
    category = est.category_rate("algebra")
    assert category == pytest.approx(
        (est.categories["algebra"].passed + 2.0) / (est.categories["algebra"].attempts + 4.0)
    )
    assert est.problem_rate("a1", "algebra") == pytest.approx(4 * category / 12)  # 0 of 8, the prior 4
    assert est.problem_rate("a9", "algebra") == category  # never sampled: its category's estimate
    assert est.problem_rate("g1", "geometry") == CATEGORY_PRIOR


def test_observe_counts_every_attempt_but_those_lost_to_the_infrastructure() -> None:
    pool = problems(2)
    sel = selector(pool)
    sel.observe(pool, [group(pool[0], passed=3, lost=2), group(pool[1], passed=0, size=4)])
    assert (sel.estimates.problems["p000"].passed, sel.estimates.problems["p000"].attempts) == (3.0, 6.0)
    assert sel.estimates.problems["p001"].attempts == 4.0
    assert mixed_group_probability(0.5, 8) == pytest.approx(1 - 2 * 0.5**8)
    assert mixed_group_probability(0.0, 8) == mixed_group_probability(1.0, 8) == 0.0


# -- the rule --------------------------------------------------------------------------------------


def teach(sel: PassRateSelector, pool: list[Problem], passed: int, times: int = 10) -> None:
    for _ in range(times):
        sel.observe(pool, [group(p, passed) for p in pool])


def test_the_band_retires_the_solved_and_the_hopeless_and_explores_the_given_share() -> None:
    hopeless, solved, mixed = problems(30, "h"), problems(30, "s"), problems(40, "m")
    pool = hopeless + solved + mixed
    for explore in (0.0, 0.1, 0.3):
        sel = selector([replace(p, data_source="all") for p in pool], explore=explore)
        teach(sel, hopeless, 0)
        teach(sel, solved, 8)
        teach(sel, mixed, 4)
        summary = sel.summary()
        assert (summary["selection/in_band"], summary["selection/retired_hopeless"]) == (40.0, 30.0)
        assert summary["selection/retired_solved"] == 30.0 and summary["selection/never_sampled"] == 0.0
        drawn = [p.id[0] for _ in range(200) for p in sel.next_batch(10)]
        retired = sum(kind != "m" for kind in drawn) / len(drawn)
        assert retired == pytest.approx(explore, abs=0.03), explore
        if explore:  # exploration covers both kinds of retired problem
            assert {"h", "s"} <= set(drawn)


def test_with_nothing_in_the_band_the_retired_are_drawn_and_a_batch_never_repeats_a_problem() -> None:
    pool = problems(12, "all")
    sel = selector(pool, explore=0.0)
    teach(sel, pool, 0)
    batch = sel.next_batch(12)
    assert sorted(p.id for p in batch) == sorted(p.id for p in pool)  # all retired: still every one, once
    bigger = sel.next_batch(30)  # more than the source holds: repeats only then
    assert len(bigger) == 30 and len({p.id for p in bigger[:12]}) == 12


def test_categories_are_weighted_by_the_chance_of_a_mixed_group() -> None:
    """Band [0, 1] and no exploration: the draw between categories is the weighting alone."""
    near, far, unseen = problems(50, "near"), problems(50, "far"), problems(50, "new")
    sel = selector(near + far + unseen, band_low=0.0, band_high=1.0, explore=0.0)
    teach(sel, near[:10], 4)  # about 0.5
    teach(sel, far[:10], 0)  # near 0
    p_near, p_far = sel.estimates.category_rate("near"), sel.estimates.category_rate("far")
    assert abs(p_near - 0.5) < 0.05 and p_far < 0.05
    weights = {c: mixed_group_probability(p, 8) for c, p in (("near", p_near), ("far", p_far), ("new", 0.5))}
    drawn = Counter(p.data_source for _ in range(300) for p in sel.next_batch(10))
    total = sum(weights.values())
    for category, weight in weights.items():
        assert drawn[category] / 3000 == pytest.approx(weight / total, abs=0.03), category
    assert drawn["near"] > 3 * drawn["far"]


def test_within_a_category_every_in_band_problem_comes_before_any_comes_twice() -> None:
    pool = problems(20, "c")
    sel = selector(pool, explore=0.0)
    first = [p.id for _ in range(4) for p in sel.next_batch(5)]
    assert sorted(first) == sorted(p.id for p in pool)


def test_draws_are_deterministic_given_the_seed() -> None:
    pool = problems(30, "a") + problems(30, "b")

    def run(seed: int) -> list[str]:
        sel = selector(pool, seed=seed)
        out: list[str] = []
        for step in range(8):
            batch = sel.next_batch(6)
            sel.observe(batch, [group(p, passed=(step + i) % 3) for i, p in enumerate(batch)])
            out += [p.id for p in batch]
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_the_state_is_plain_json_and_restores_the_same_next_draws() -> None:
    pool = problems(25, "a") + problems(25, "b")
    outcomes = {p.id: i % 4 for i, p in enumerate(pool)}

    def step(sel: PassRateSelector) -> list[str]:
        batch = sel.next_batch(7)
        sel.observe(batch, [group(p, outcomes[p.id] * 2) for p in batch])
        return [p.id for p in batch]

    original = selector(pool, seed=5)
    for _ in range(6):
        step(original)
    saved = json.loads(json.dumps(original.state()))
    assert saved == original.state()
    resumed = selector(pool, seed=999, state=saved)  # the state's seed wins, as a stream position's
    assert resumed.summary() == original.summary()
    assert [step(resumed) for _ in range(5)] == [step(original) for _ in range(5)]


def test_config_default_is_epoch_order_and_the_band_is_checked() -> None:
    assert load_config(None).data.selection == "epoch"
    assert load_config("chapter").data.selection == "epoch"
    with pytest.raises(ConfigError, match="band_low"):
        load_config(None, ["data.pass_rate.band_low=0.6", "data.pass_rate.band_high=0.4"])


def test_a_mathematics_problem_s_category_is_its_module() -> None:
    source = MathematicsSource(None)
    problem = Problem("mathematics-train-1", "q", "1", "mathematics/algebra__linear_1d")
    assert source.category(problem) == "algebra__linear_1d"
    assert ProblemList([problem]).category(problem) == "mathematics/algebra__linear_1d"  # the default
    assert ProblemList([]).category(Problem("x", "q", "1")) == "all"


def test_category_pass_rates_count_every_group() -> None:
    a, b = problems(2, "a"), problems(1, "b")
    groups = [group(a[0], 2, size=4), group(a[1], 1, size=4), group(b[0], 0, size=4)]
    rates = category_pass_rates([*a, *b], groups, ProblemList([]).category)
    assert rates == {"category/a/pass_rate": 3 / 8, "category/b/pass_rate": 0.0}


# -- in the trainer --------------------------------------------------------------------------------

# Four categories of ten: c0 and c1 hopeless (never correct), c2 half hopeless, the rest scripted (correct
# with probability 1/3: a group of 8 is mixed but for about one time in twenty).
CATEGORY_POOL = [p for c in range(4) for p in problems(10, f"c{c}", start=10 * c)]
HOPELESS = {p.id for p in CATEGORY_POOL if p.data_source in ("c0", "c1")} | {
    p.id for p in CATEGORY_POOL if p.data_source == "c2" and int(p.id[2:]) % 2 == 0
}


async def hopeless_half(
    problems: list[Problem], *, sampler: Any, group_size: int, seed: int, **_: Any
) -> Any:
    def one(problem: Problem, pi: int, b: int) -> Trajectory:
        traj = scripted_trajectory(problem, pi, b, seed, sampler)
        if problem.id not in HOPELESS:
            return traj
        wrong = ReToolOutcome(correct=False, valid_format=True, stop_reason="answer")
        return replace(traj, reward=-1.0, outcome=wrong)

    return [[one(p, pi, b) for b in range(group_size)] for pi, p in enumerate(problems)]


def selection_trainer(cfg: Any, run_dir: Path, client: Any = None, resume: bool = False) -> Any:
    from retool.train.loop import Trainer

    return Trainer(
        cfg,
        run_dir,
        resume=resume,
        source=ProblemList(CATEGORY_POOL, shuffle=True),
        components=fake_components(client or FakeClient()),
        rollout_fn=as_rollout_fn(hopeless_half),
    )


def selection_config(selection: str, *extra: str, steps: int = 30) -> Any:
    return override_config(
        fake_config(steps=steps, every=0),
        ["rollout.questions_per_step=4", f"data.selection={selection}", *extra],
    )


def test_selection_makes_more_sampled_groups_informative_than_epoch_order(tmp_path: Path) -> None:
    """Over half the problems always wrong (two whole categories and half of a third): epoch order samples
    them as often as the rest, so about a third of its groups are mixed; the pass-rate selection retires
    them and leans away from their categories. 30 steps of 4 questions x group 8."""
    share = {}
    for selection in ("epoch", "pass_rate"):
        selection_trainer(selection_config(selection, "rollout.group_size=8"), tmp_path / selection).run()
        rows = read_metrics(tmp_path / selection)
        assert all(0.0 <= r["sampling/informative_share"] <= 1.0 for r in rows)
        informative = sum(r["sampling/groups_informative"] for r in rows)
        assert sum(
            r["sampling/informative_share"] * r["sampling/groups_sampled"] for r in rows
        ) == pytest.approx(informative)
        share[selection] = informative / sum(r["sampling/groups_sampled"] for r in rows)
    assert share["epoch"] < 0.45 and share["pass_rate"] > share["epoch"] + 0.25, share
    last = read_metrics(tmp_path / "pass_rate")[-1]
    assert last["selection/retired_hopeless"] >= 10  # the whole hopeless categories at least
    assert (
        last["selection/in_band"] + last["selection/retired_hopeless"] + last["selection/retired_solved"]
        == 40
    )
    # Per category, over the step's sampled groups: the hopeless ones pass nothing.
    rates = {
        k: v for r in read_metrics(tmp_path / "epoch") for k, v in r.items() if k.startswith("category/")
    }
    assert rates["category/c0/pass_rate"] == rates["category/c1/pass_rate"] == 0.0
    assert "selection/in_band" not in read_metrics(tmp_path / "epoch")[-1]


@pytest.mark.parametrize("crash_at_optim", [3, 5])
def test_a_resumed_run_draws_the_same_problems(tmp_path: Path, crash_at_optim: int) -> None:
    cfg = override_config(selection_config("pass_rate", steps=8), ["checkpoint.every=2"])
    selection_trainer(cfg, tmp_path / "ref").run()
    reference = read_metrics(tmp_path / "ref")
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        selection_trainer(cfg, crashed, FakeClient(fail_at_optim=crash_at_optim)).run()
    latest = CheckpointManager(crashed).latest()
    assert latest is not None
    state = json.loads((latest / SELECTION_FILE).read_text())  # plain JSON
    assert set(state) == {"seed", "calls", "drawn", "retired_cursor", "cursors", "problems", "categories"}
    selection_trainer(cfg, crashed, resume=True).run()
    resumed = read_metrics(crashed)
    keys = ("problem_ids", "rewards", "selection/in_band", "selection/retired_hopeless")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in reference]


@pytest.mark.parametrize("k", [1, 2])
def test_a_resumed_run_with_batches_sampled_ahead_draws_the_same_problems(tmp_path: Path, k: int) -> None:
    """k >= 1: the state stored is the one after the last batch the checkpoint holds."""
    cfg = selection_config(
        "pass_rate",
        f"train.max_steps_off_policy={k}",
        "checkpoint.every=2",
        "filters.dynamic_sampling=true",
        steps=7,
    )
    selection_trainer(cfg, tmp_path / "ref", VersionedClient()).run()
    reference = read_metrics(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="simulated crash"):
        selection_trainer(cfg, tmp_path / "run", VersionedClient(fail_at_optim=4)).run()
    selection_trainer(cfg, tmp_path / "run", VersionedClient(), resume=True).run()
    resumed = read_metrics(tmp_path / "run")
    assert [(r["problem_ids"], r["rewards"]) for r in resumed] == [
        (r["problem_ids"], r["rewards"]) for r in reference
    ]


def test_a_failed_batch_s_draws_are_not_in_the_stored_state(tmp_path: Path) -> None:
    """k = 2: batch 4 fails while step 2 trains, after the selector drew its problems; the checkpoint of
    step 2 stores the state after batch 3, so a resume draws batch 4's problems again, as the run that
    never failed did (then sampled from version 2, not 1: later draws follow other rewards)."""
    calls: list[int] = []

    async def failing(problems: list[Problem], **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 4:
            raise ConnectionError("sampler unreachable")
        return await hopeless_half(problems, **kw)

    cfg = selection_config("pass_rate", "train.max_steps_off_policy=2", "checkpoint.every=2", steps=6)
    selection_trainer(cfg, tmp_path / "ref", VersionedClient()).run()
    run = tmp_path / "run"
    broken = selection_trainer(cfg, run, VersionedClient())
    broken._rollout_fn = as_rollout_fn(failing)
    with pytest.raises(ConnectionError, match="unreachable"):
        broken.run()
    latest = CheckpointManager(run).latest()
    assert latest is not None and latest.name == "step_000002"
    assert json.loads((latest / SELECTION_FILE).read_text())["calls"] == 3  # batches 1-3, not batch 4
    selection_trainer(cfg, run, VersionedClient(), resume=True).run()
    rows, reference = read_metrics(run), read_metrics(tmp_path / "ref")
    assert [r["problem_ids"] for r in rows[:4]] == [r["problem_ids"] for r in reference[:4]]


def test_epoch_order_checkpoints_store_no_selection_state(tmp_path: Path) -> None:
    selection_trainer(
        override_config(selection_config("epoch", steps=2), ["checkpoint.every=1"]), tmp_path / "run"
    ).run()
    latest = CheckpointManager(tmp_path / "run").latest()
    assert latest is not None and not (latest / SELECTION_FILE).exists()


def test_a_problem_estimated_below_rare_below_gets_the_larger_group() -> None:
    pool = problems(4, "a") + problems(4, "b")
    sel = selector(pool, group_size_rare=16, rare_below=0.15)
    assert sel.group_size(pool[0], 8) == 8  # never sampled: its category's 0.5
    teach(sel, pool[:4], 0)
    assert sel.group_size(pool[0], 8) == 16 and sel.group_size(pool[4], 8) == 8
    assert sel.group_size(pool[0], 32) == 32  # only a larger size has an effect
    assert selector(pool).group_size(pool[0], 8) == 8  # off by default


def test_a_run_with_rare_group_sizes_trains_groups_of_both_sizes(tmp_path: Path) -> None:
    cfg = selection_config(
        "pass_rate",
        "rollout.group_size=4",
        "data.pass_rate.group_size_rare=8",
        "checkpoint.every=3",
        steps=12,
    )
    selection_trainer(cfg, tmp_path / "ref").run()
    rows = read_metrics(tmp_path / "ref")
    sizes = Counter(len(g) for r in rows for g in r["rewards"])
    assert set(sizes) == {4, 8}
    for r in rows:  # every group is its problem's: the hopeless ones all wrong, whatever their size
        for pid, rewards in zip(r["problem_ids"], r["rewards"], strict=True):
            if pid in HOPELESS:
                assert set(rewards) == {-1.0}
        assert r["task/trajectories"] == sum(len(g) for g in r["rewards"])
    assert any(r["train/optimizer_stepped"] for r in rows)
    # a resumed run samples the same groups, sizes included
    with pytest.raises(RuntimeError, match="simulated crash"):
        selection_trainer(cfg, tmp_path / "run", FakeClient(fail_at_optim=5)).run()
    selection_trainer(cfg, tmp_path / "run", resume=True).run()
    assert [r["rewards"] for r in read_metrics(tmp_path / "run")] == [r["rewards"] for r in rows]
