"""Which groups and trajectories a step learns from: DAPO dynamic sampling, void-turn and overlong filters."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from retool.config import ConfigError, FiltersConfig, RolloutConfig, load_config
from retool.data.problem import Problem
from retool.env import ReToolOutcome
from retool.train.sampling import StepBatchBuilder, questions_for_round, rollout_seed, round_seed
from retool.train.step import build_step_data, is_overlong, is_void


@dataclass
class Turn:
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    sampler_stop: str = "stop"


@dataclass
class Traj:
    turns: list[Turn]
    reward: float = -1.0
    stop_reason: str = "answer"
    reward_status: str = "ok"
    extra: dict = field(default_factory=dict)

    @property
    def outcome(self) -> ReToolOutcome:
        return ReToolOutcome(stop_reason=self.stop_reason, reward_status=self.reward_status)


def traj(
    reward: float, stop: str = "answer", status: str = "ok", sampler_stop: str = "stop", n: int = 3
) -> Traj:
    return Traj(
        turns=[Turn([1, 2], list(range(10, 10 + n)), [-0.5] * n, sampler_stop)],
        reward=reward,
        stop_reason=stop,
        reward_status=status,
    )


# -- void-turn and overlong predicates ------------------------------------------------------------


def test_void_turn_is_a_last_turn_without_a_call_or_an_answer() -> None:
    assert is_void(traj(-1.0, stop="invalid", status=""))
    assert is_void(traj(-1.0, stop="answer", status="no_answer"))  # text without \boxed{}
    assert not is_void(traj(-1.0, stop="answer", status="ok"))  # a wrong answer is an answer
    assert not is_void(traj(1.0))
    assert not is_void(traj(-1.0, stop="max_turns", status=""))  # ended on a complete call
    assert not is_void(traj(-1.0, stop="context_full", status=""))


def test_overlong_is_a_trajectory_cut_by_a_token_budget() -> None:
    assert is_overlong(traj(-1.0, stop="context_full", status=""))
    assert is_overlong(traj(-1.0, stop="invalid", status="", sampler_stop="length"))  # per-turn cap
    assert not is_overlong(traj(-1.0, stop="invalid", status=""))
    assert not is_overlong(traj(1.0))
    assert not is_overlong(traj(-1.0, stop="max_code_calls", status=""))  # a call budget, not tokens


# -- filters in the step's data ---------------------------------------------------------------------


def test_void_filter_drops_the_trajectory_but_keeps_it_in_the_baseline() -> None:
    void = traj(-1.0, stop="invalid", status="")
    group = [traj(1.0), traj(1.0), traj(-1.0), void]
    off = build_step_data([group])
    on = build_step_data([group], drop_void=True)
    assert len(off.datums) == 4 and off.n_void == 0
    assert len(on.datums) == 3 and on.n_void == 1 and on.n_overlong == 0
    assert on.datum_index == [[0, 1, 2, None]]
    # Baseline over all four rewards: mean 0 -> advantages +1, +1, -1 (not recomputed without the void one).
    assert on.advantages == [[1.0, 1.0, -1.0, -1.0]]
    assert [max(d.advantages) if max(d.advantages) > 0 else min(d.advantages) for d in on.datums] == [
        1.0,
        1.0,
        -1.0,
    ]
    # Mean reduction counts trained datums only: each of the 3 datums' 3 tokens weighs 1 / (3 * 3).
    for d in on.datums:
        assert sum(d.weights) == pytest.approx(1.0 / 3)


def test_overlong_filter_and_void_filter_count_a_trajectory_once() -> None:
    both = traj(-1.0, stop="invalid", status="", sampler_stop="length")
    cut = traj(-1.0, stop="context_full", status="")
    group = [traj(1.0), both, cut, traj(-1.0)]
    data = build_step_data([group], drop_void=True, drop_overlong=True)
    assert (data.n_void, data.n_overlong, len(data.datums)) == (1, 1, 2)
    only_overlong = build_step_data([group], drop_overlong=True)
    assert (only_overlong.n_void, only_overlong.n_overlong, len(only_overlong.datums)) == (0, 2, 2)


def test_filters_off_by_default_and_in_the_chapter_preset() -> None:
    for cfg in (load_config(None), load_config("chapter")):
        f = cfg.filters
        assert (f.dynamic_sampling, f.void_turn, f.overlong) == (False, False, False)


# -- dynamic sampling -----------------------------------------------------------------------------

PROBLEMS = [Problem(f"q{i:03d}", f"What is {i}?", str(i)) for i in range(200)]


class Stream:
    def __init__(self) -> None:
        self.position = 0

    def next_batch(self, n: int) -> list[Problem]:
        out = PROBLEMS[self.position : self.position + n]
        self.position += n
        return out

    def observe(self, problems: Any, groups: Any) -> None:
        """The step sampler shows every round's groups; this stream's order does not depend on them."""

    def group_size(self, problem: Any, default: int) -> int:
        return default


def rounds_recorder(informative: set[str]) -> tuple[Any, list[tuple[list[str], int]]]:
    """A group sampler (``retool.train.sampling.GroupRollouts``'s shape) whose groups are informative exactly
    for the problems named in ``informative``; it notes the problem ids and the round (read off the round's
    seed) of every round it samples."""
    calls: list[tuple[list[str], int]] = []
    round_of = {round_seed(rollout_seed(0, 1), r): r for r in range(10)}

    class Groups:
        async def sample(self, problems: list[Problem], policy: Any, *, group_size: int, seed: int) -> Any:
            if not problems:  # the (empty) text-only part of a round
                return []
            calls.append(([p.id for p in problems], round_of[seed]))
            return [
                [traj(1.0), traj(-1.0)] if p.id in informative else [traj(-1.0), traj(-1.0)] for p in problems
            ]

    return Groups(), calls


def sample_batch(groups: Any, stream: Any, target: int, filters: FiltersConfig) -> Any:
    """Step 1's batch: ``target`` questions per step (groups of 2) drawn from ``stream``."""
    rollout = RolloutConfig(questions_per_step=target, group_size=2)
    return StepBatchBuilder(groups, None, rollout, filters, seed=0).sample(1, stream, None)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_without_dynamic_sampling_one_round_trains_every_group() -> None:
    sample_round, calls = rounds_recorder({"q001"})
    stream = Stream()
    out = run(sample_batch(sample_round, stream, 4, FiltersConfig()))
    assert calls == [(["q000", "q001", "q002", "q003"], 0)]
    assert len(out.groups) == 4 and out.groups == out.sampled
    assert (out.rounds, out.informative) == (1, 1)
    assert out.metrics()["sampling/groups_kept"] == 4.0
    # The verdict on each kept group is recorded where it is decided; build_step_data reads it.
    assert out.group_informative == (False, True, False, False)


def test_dynamic_sampling_refills_until_enough_informative_groups() -> None:
    informative = {f"q{i:03d}" for i in (1, 2, 5, 7, 8, 9)}
    sample_round, calls = rounds_recorder(informative)
    stream = Stream()
    filters = FiltersConfig(dynamic_sampling=True, oversample=1.0, max_extra_rounds=5)
    out = run(sample_batch(sample_round, stream, 4, filters))
    # Round 0: q000-q003 -> 2 kept (q001, q002); round 1 asks for the 2 missing: q004, q005 -> 1 kept;
    # round 2 asks for 1: q006 -> 0; round 3: q007 -> 1. Done with 4.
    assert calls == [
        (["q000", "q001", "q002", "q003"], 0),
        (["q004", "q005"], 1),
        (["q006"], 2),
        (["q007"], 3),
    ]
    assert [g[0].reward for g in out.groups] == [1.0] * 4
    assert len(out.groups) == 4 and len(out.sampled) == 8 and len(out.problems) == 8
    assert out.group_informative == (True,) * 4
    m = out.metrics()
    assert m == {
        "sampling/rounds": 4.0,
        "sampling/groups_sampled": 8.0,
        "sampling/groups_informative": 4.0,
        "sampling/informative_share": 0.5,  # of every group sampled, extra rounds included
        "sampling/groups_kept": 4.0,
    }


def test_dynamic_sampling_oversamples_caps_rounds_and_cuts_extras() -> None:
    # Everything informative: round 0 over-samples ceil(1.5 * 4) = 6 and keeps only the first 4.
    sample_round, calls = rounds_recorder({p.id for p in PROBLEMS})
    filters = FiltersConfig(dynamic_sampling=True, oversample=1.5, max_extra_rounds=2)
    out = run(sample_batch(sample_round, Stream(), 4, filters))
    assert [len(c[0]) for c in calls] == [6]
    assert [g is s for g, s in zip(out.groups, out.sampled[:4], strict=True)] == [True] * 4
    assert (len(out.groups), out.informative) == (4, 6)

    # Nothing informative: 1 + max_extra_rounds rounds, then the step trains on nothing.
    sample_round, calls = rounds_recorder(set())
    out = run(sample_batch(sample_round, Stream(), 4, filters))
    assert [len(c[0]) for c in calls] == [6, 6, 6] and [c[1] for c in calls] == [0, 1, 2]
    assert out.groups == [] and out.rounds == 3 and len(out.sampled) == 18
    assert out.group_informative == ()


def test_round_seeds_and_sizes() -> None:
    assert round_seed(12345, 0) == 12345  # dynamic sampling off samples exactly as before
    seeds = {round_seed(12345, r) for r in range(5)}
    assert len(seeds) == 5
    assert questions_for_round(4, 1.0) == 4
    assert questions_for_round(3, 1.5) == 5
    assert questions_for_round(1, 1.0) == 1
    with pytest.raises(ValueError):
        run(sample_batch(rounds_recorder(set())[0], Stream(), 0, FiltersConfig()))


def test_oversample_below_one_is_rejected() -> None:
    from retool.config import ConfigError

    with pytest.raises(ConfigError, match=r"filters\.oversample"):
        load_config(None, ["filters.oversample=0.5"])


# -- in the training loop ---------------------------------------------------------------------------


def test_trainer_reports_dynamic_sampling_metrics_and_trains_only_informative_groups(tmp_path: Path) -> None:
    from tests.test_train_loop import PROBLEMS as LOOP_PROBLEMS
    from tests.test_train_loop import FakeClient, fake_components, fake_rollouts

    from retool.env import ProblemList
    from retool.train.loop import Trainer

    seen_datums: list[int] = []

    class CountingClient(FakeClient):
        async def forward_backward_async(self, datums, loss_fn, loss_config=None):  # type: ignore[override]
            seen_datums.append(len(datums))
            return await super().forward_backward_async(datums, loss_fn, loss_config)

    cfg = load_config(
        None,
        [
            "train.steps=3",
            "checkpoint.every=0",
            "rollout.questions_per_step=3",
            "rollout.group_size=4",
            "filters.dynamic_sampling=true",
            "filters.max_extra_rounds=3",
            "logging.tracker='none'",
            "logging.progress=false",
        ],
    )
    trainer = Trainer(
        cfg,
        tmp_path / "run",
        source=ProblemList(LOOP_PROBLEMS, shuffle=True),
        components=fake_components(CountingClient()),
        rollout_fn=fake_rollouts,
    )
    trainer.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        kept, sampled = r["sampling/groups_kept"], r["sampling/groups_sampled"]
        assert kept <= 3 and sampled >= 3 and r["sampling/rounds"] >= 1
        assert len(r["problem_ids"]) == sampled == len(r["rewards"])
        degenerate = sum(len(set(g)) == 1 for g in r["rewards"])
        assert r["task/degenerate_groups"] == degenerate
        assert r["train/datums"] == 4 * kept  # every trajectory of every kept group, no degenerate one
        if r["sampling/rounds"] > 1:
            assert degenerate > 0


# -- text-only share ------------------------------------------------------------------------------------


def test_text_only_count() -> None:
    from retool.train.sampling import text_only_count

    assert text_only_count(8, 0.0) == 0
    assert text_only_count(8, 0.25) == 2
    assert text_only_count(8, 0.01) == 1  # a positive share always sends at least one question
    assert text_only_count(1, 0.5) == 0  # a lone question stays in tool mode
    assert text_only_count(4, 0.9) == 3  # at least one question keeps the tool


def test_trainer_rolls_out_a_share_of_questions_text_only(tmp_path: Path) -> None:
    from dataclasses import replace

    from tests.test_train_loop import PROBLEMS as LOOP_PROBLEMS
    from tests.test_train_loop import FakeClient, fake_rollouts

    from retool.components import Components
    from retool.env import ProblemList, ReToolGroupBuilder
    from retool.rollout import RolloutRequest
    from retool.train.loop import Trainer

    calls: list[tuple[int, bool, object, object]] = []

    async def recording_rollouts(request: RolloutRequest):  # type: ignore[no-untyped-def]
        setups = {id(g.setup): g.setup for g in request.groups if isinstance(g, ReToolGroupBuilder)}
        (setup,) = setups.values()  # one mode per call
        use_tools = setup.tool is not None
        calls.append((len(request.groups), use_tools, setup.protocol, setup.tool))
        groups = await fake_rollouts(request)
        return [[replace(t, outcome=replace(t.outcome, use_tools=use_tools)) for t in g] for g in groups]

    text_protocol, executor = object(), object()

    class ToolProtocol:  # the text-only protocol is the tool protocol's text-only twin
        def with_tools(self, use_tools: bool) -> object:
            return self if use_tools else text_protocol

        def decode(self, tokens: list[int]) -> str:  # the trajectory records' text
            return " ".join(map(str, tokens))

    tool_protocol = ToolProtocol()
    cfg = load_config(
        None,
        [
            "train.steps=2",
            "checkpoint.every=0",
            "rollout.questions_per_step=4",
            "rollout.group_size=2",
            "rollout.text_only_share=0.25",
            "logging.tracker='none'",
            "logging.progress=false",
        ],
    )
    Trainer(
        cfg,
        tmp_path / "run",
        source=ProblemList(LOOP_PROBLEMS, shuffle=False),
        components=Components(
            backend=FakeClient(), protocol=tool_protocol, verifier=object(), executor=executor
        ),
        rollout_fn=recording_rollouts,
    ).run()
    # Per step: 3 questions with the tool protocol and executor, 1 text-only with neither the tool
    # protocol nor an executor.
    assert sorted(calls, key=lambda c: c[1]) == [
        (1, False, text_protocol, None),
        (1, False, text_protocol, None),
        (3, True, tool_protocol, executor),
        (3, True, tool_protocol, executor),
    ]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sampling/text_only_groups"] for r in rows] == [1.0, 1.0]


def test_settings_that_went_are_refused_by_name_whatever_their_value() -> None:
    # No compatibility code before a tagged release: a config naming a removed setting fails, even one
    # holding the only behaviour that remains.
    with pytest.raises(ValidationError, match="stream_rounds"):
        FiltersConfig(dynamic_sampling=True, stream_rounds=True)  # type: ignore[call-arg]
    for removed in (
        "filters.stream_rounds=true",
        "filters.stream_rounds=false",
        "rollout.scheduling=per_trajectory",
    ):
        with pytest.raises(ConfigError, match=removed.split(".")[1].split("=")[0]):
            load_config("tiny", [removed])
