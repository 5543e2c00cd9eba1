"""Trajectory records and where they are written: spans from the datum, the run's trajectories.jsonl
(sampling, resume), eval transcripts in the same shape, and the config knob."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import AdamParams, ForwardBackwardResult, OptimStepResult
from retool.components import Components
from retool.config import ConfigError, load_config
from retool.data.problem import Problem
from retool.env import ProblemList, ReToolOutcome
from retool.rollout import RolloutRequest
from retool.rollout.records import datum_tokens, trajectory_record
from retool.train.loop import Trainer
from retool.train.records import TRAJECTORIES_FILE, TrajectoryLog, cut_from_step, read_records, select_groups
from retool.train.sampling import Collected
from retool.train.step import build_step_data, trajectory_tokens
from synthetic_runs import decode, encode, make_problems, make_trajectory


def group_of(problem: Problem, n: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    return [make_trajectory(problem, b, rng, skill=0.5) for b in range(n)]


def mixed_groups(seed: int = 0) -> list[list[Any]]:
    """Groups with both rewards in them (so each is trained), found by trying seeds."""
    problems = make_problems(3, seed)
    out = []
    s = seed
    for p in problems:
        while True:
            group = group_of(p, 4, s)
            s += 1
            if len({t.reward for t in group}) > 1:
                out.append(group)
                break
    return out


def trained_tokens_of(record: dict[str, Any]) -> set[int]:
    return {j for s in record["spans"] if s["trained"] for j in range(s["start"], s["end"])}


def test_spans_are_read_off_the_datum_weights() -> None:
    groups = mixed_groups()
    data = build_step_data(groups)
    traj = groups[0][0]
    datum = data.datums[0]
    record = trajectory_record(traj, source="train", advantage=None, datum=datum, step=1, decode=decode)
    assert record["mask_source"] == "datum"
    assert trained_tokens_of(record) == {j + 1 for j, w in enumerate(datum.weights) if w != 0.0}
    tokens, _, sampled = trajectory_tokens(traj)
    # The spans tile the sequence in order, and their text is the decoded sequence.
    assert [s["start"] for s in record["spans"]] == [0] + [s["end"] for s in record["spans"][:-1]]
    assert record["spans"][-1]["end"] == len(tokens)
    assert "".join(s["text"] for s in record["spans"]) == decode(tokens)
    # Observations (interpreter output) are masked; each completion is trained.
    roles = {(s["role"], s["trained"]) for s in record["spans"]}
    assert roles <= {("prompt", False), ("completion", True), ("observation", False)}
    assert record["tokens"]["trained"] == sum(sampled) == record["tokens"]["completion"]

    # Not recomputed: a datum whose weights differ from the turn structure is shown as it is.
    weights = list(datum.weights)
    first = next(i for i, w in enumerate(weights) if w)
    weights[first : first + 5] = [0.0] * 5
    odd = trajectory_record(
        traj, source="train", advantage=None, datum=replace(datum, weights=weights), decode=decode
    )
    assert trained_tokens_of(odd) == trained_tokens_of(record) - set(range(first + 1, first + 6))
    split = [s for s in odd["spans"] if s["role"] == "completion" and s["turn"] == 0]
    assert [s["trained"] for s in split] == [False, True]


def test_a_datum_of_another_trajectory_is_refused() -> None:
    groups = mixed_groups()
    data = build_step_data(groups)
    with pytest.raises(ValueError, match="not this trajectory"):
        trajectory_record(groups[0][1], source="train", advantage=0.0, datum=data.datums[0])


def test_untrained_and_eval_records() -> None:
    group = group_of(make_problems(1, 5)[0], 3, 1)
    untrained = trajectory_record(group[0], source="train", advantage=0.0, datum=None, decode=decode)
    assert untrained["mask_source"] == "untrained"
    assert not any(s["trained"] for s in untrained["spans"]) and untrained["spans"]
    ev = trajectory_record(group[0], source="eval", advantage=0.0, mode="retool", decode=None)
    assert ev["mask_source"] == "turn_structure"
    assert all(s["trained"] == (s["role"] == "completion") for s in ev["spans"])
    assert all(s["text"] is None for s in ev["spans"])  # no tokenizer: no text invented


def test_turns_carry_code_executor_result_and_observation() -> None:
    rng = random.Random(3)
    problem = make_problems(1, 0)[0]
    traj = next(
        t
        for t in (make_trajectory(problem, 0, rng) for _ in range(50))
        if t.outcome.code_calls >= 2 and t.outcome.stop_reason == "answer"
    )
    record = trajectory_record(traj, source="eval", advantage=None, decode=decode)
    tools = [t for t in record["turns"] if t["kind"] == "tool"]
    assert [t["code"] for t in tools] == list(traj.outcome.codes)
    assert [t["exec"]["stderr"] for t in tools] == [r.stderr for r in traj.outcome.exec_results]
    assert [t["observation"] for t in tools] == list(traj.outcome.observations)
    assert record["turns"][-1]["kind"] == "answer" and record["turns"][-1]["code"] is None
    assert json.loads(json.dumps(record)) == record  # JSON-ready as it is


def test_trajectories_that_ended_early() -> None:
    from retool.rollout.types import Trajectory

    problem = make_problems(1, 0)[0]
    empty = Trajectory(
        problem=problem, group_index=0, reward=-1.0, outcome=ReToolOutcome(stop_reason="context_full")
    )
    record = trajectory_record(empty, source="train", advantage=0.0, decode=decode)
    assert record["spans"] == [] and record["turns"] == [] and record["tokens"]["total"] == 0
    rng = random.Random(0)
    traj = next(t for t in (make_trajectory(problem, 0, rng) for _ in range(50)) if t.outcome.code_calls >= 1)
    # The executor raised on the first call: its code is recorded, no result, and the trajectory ends.
    traj = replace(
        traj,
        transitions=traj.transitions[:1],
        outcome=replace(
            traj.outcome,
            exec_results=(),
            observations=(),
            observations_trimmed=(),
            codes=traj.outcome.codes[:1],
            stop_reason="executor_error",
            error="OSError: sandbox gone",
        ),
    )
    record = trajectory_record(traj, source="train", advantage=-1.0, decode=decode)
    assert record["turns"][0]["code"] == traj.outcome.codes[0] and record["turns"][0]["exec"] is None
    assert [s["role"] for s in record["spans"]] == ["prompt", "completion"]
    assert record["error"] == "OSError: sandbox gone"


def test_select_groups() -> None:
    assert select_groups(8, "all", 0, 1) == list(range(8))
    assert select_groups(8, 0, 0, 1) == []
    assert select_groups(3, 5, 0, 1) == [0, 1, 2]
    picked = select_groups(8, 2, 0, 7)
    assert len(picked) == 2 and picked == select_groups(8, 2, 0, 7)  # the same on a redone step
    assert len({tuple(select_groups(8, 2, 0, s)) for s in range(1, 20)}) > 1


def test_log_appends_steps_and_cuts_redone_steps(tmp_path: Path) -> None:
    path = tmp_path / TRAJECTORIES_FILE
    log = TrajectoryLog(path, groups_per_step=2, seed=0)
    for step in (1, 2, 3, 4):
        groups = mixed_groups(step * 10)
        assert log.write_step(step, groups, build_step_data(groups), decode=decode) == 8
    assert [r["step"] for r in read_records(path)] == [1] * 8 + [2] * 8 + [3] * 8 + [4] * 8
    with path.open("a") as fh:
        fh.write('{"step": 4, "partial')  # a kill mid-write
    # A resumed run (checkpoint at step 2) redoes step 3: steps >= 3 and the partial line go first.
    resumed = TrajectoryLog(path, groups_per_step=1, seed=0)
    groups = mixed_groups(99)
    resumed.write_step(3, groups, build_step_data(groups), decode=decode)
    assert [r["step"] for r in read_records(path)] == [1] * 8 + [2] * 8 + [3] * 4
    assert path.read_bytes().endswith(b"\n")
    assert cut_from_step(path, 10) == 0


def test_the_log_maps_datums_by_where_the_step_sampled_each_trajectory(tmp_path: Path) -> None:
    # Dynamic sampling kept groups 2 and 0 of three sampled (in that order) and RoC kept three branches of
    # each: the step's own map (``Collected.origin``) says which sampled trajectory each datum trained.
    sampled = mixed_groups(7)
    kept = [[sampled[2][3], sampled[2][0], sampled[2][1]], [sampled[0][1], sampled[0][2], sampled[0][3]]]
    kept = [g for g in kept if len({t.reward for t in g}) > 1]
    collected = Collected(groups=kept, sampled=sampled)
    collected.tag_origins()
    data = build_step_data(collected.groups)
    log = TrajectoryLog(tmp_path / TRAJECTORIES_FILE, "all")
    assert log.write_step(1, collected.sampled, data, collected.origin, decode) == 12
    records = list(read_records(tmp_path / TRAJECTORIES_FILE))
    trained = {(r["group"], i % 4) for i, r in enumerate(records) if r["mask_source"] == "datum"}
    assert trained == {where for group in collected.origin for where in group}
    for (g, b), record in zip(((i // 4, i % 4) for i in range(12)), records, strict=True):
        if (g, b) in trained:  # the record's tokens are its own datum's
            assert encode("".join(s["text"] for s in record["spans"])) == trajectory_tokens(sampled[g][b])[0]


def test_log_failure_never_stops_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    groups = mixed_groups()
    data = build_step_data(groups)
    log = TrajectoryLog(tmp_path / "missing" / "x" / TRAJECTORIES_FILE, "all")
    (tmp_path / "missing").write_text("a file where a folder should be")
    assert log.write_step(1, groups, data) == 0
    assert "writing the trajectories of step 1" in caplog.text


# -- the training loop writes it ---------------------------------------------------------------------


class FakeSampler:
    version = 0.0


class FakeClient(TrainingClient):
    """Keeps the datums it was given, per optimizer step."""

    tokenizer = None

    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.steps: list[list[Any]] = []

    async def sampling_client_async(self) -> FakeSampler:
        return FakeSampler()

    async def forward_backward_async(self, datums, loss_fn, loss_config=None) -> ForwardBackwardResult:
        self.pending += list(datums)
        return ForwardBackwardResult(loss=0.0, trained_tokens=sum(1 for d in datums for w in d.weights if w))

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        self.steps.append(self.pending)
        self.pending = []
        return OptimStepResult(grad_norm=0.0, lr=adam.lr)

    async def save_state_async(self, name: str) -> str:
        Path(name).mkdir(parents=True, exist_ok=True)
        return name

    async def load_state_async(self, path: str) -> None:  # pragma: no cover - these runs never resume
        raise NotImplementedError


async def synthetic_rollouts(request: RolloutRequest) -> list[list[Any]]:
    rng = random.Random(request.seed)
    return [
        [make_trajectory(g.problem, b, rng, skill=0.5, problem_index=pi) for b in range(g.group_size)]
        for pi, g in enumerate(request.groups)
    ]


class CharProtocol:
    decode = staticmethod(decode)


def run_trainer(tmp_path: Path, groups_per_step: Any) -> tuple[Path, FakeClient]:
    cfg = load_config(
        None,
        [
            "train.steps=3",
            "checkpoint.every=0",
            "rollout.questions_per_step=3",
            "rollout.group_size=4",
            "logging.tracker='none'",
            "logging.progress=false",
            f"logging.trajectory_groups_per_step={groups_per_step}",
        ],
    )
    client = FakeClient()
    run = tmp_path / "run"
    Trainer(
        cfg,
        run,
        source=ProblemList(make_problems(6, 0)),
        components=Components(backend=client, protocol=CharProtocol(), verifier=object(), executor=object()),
        rollout_fn=synthetic_rollouts,
    ).run()
    return run, client


def test_trainer_writes_sampled_groups_with_the_trained_datums(tmp_path: Path) -> None:
    run, client = run_trainer(tmp_path, 2)
    records = list(read_records(run / TRAJECTORIES_FILE))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert [r["step"] for r in records] == [1] * 8 + [2] * 8 + [3] * 8  # 2 groups x 4 branches per step
    last = [r for r in records if r["step"] == 3]
    # Step 3's records of trained groups carry exactly the weights the client received.
    trained = [r for r in last if r["mask_source"] == "datum"]
    by_tokens = {tuple(datum_tokens(d)): d for d in client.steps[-1]}
    assert trained
    for r in trained:
        datum = by_tokens.get(tuple(encode("".join(s["text"] for s in r["spans"]))))
        assert datum is not None, "a record marked trained has no datum the client received"
        assert trained_tokens_of(r) == {j + 1 for j, w in enumerate(datum.weights) if w != 0.0}
        assert r["datum_weight"] == pytest.approx(next(w for w in datum.weights if w))
        assert r["advantage"] == pytest.approx(
            next(a for a, w in zip(datum.advantages, datum.weights, strict=True) if w)
        )
    for r in last:
        if r["mask_source"] == "untrained":  # a degenerate group: all rewards equal, advantage 0
            assert r["advantage"] == 0.0 and not trained_tokens_of(r)
    assert all(r["spans"][0]["text"].startswith("<|im_start|>system") for r in records)


@pytest.mark.parametrize(("setting", "per_step"), [("'all'", 12), (0, 0)])
def test_trainer_all_or_none(tmp_path: Path, setting: Any, per_step: int) -> None:
    run, _ = run_trainer(tmp_path, setting)
    path = run / TRAJECTORIES_FILE
    assert (len(list(read_records(path))) if path.exists() else 0) == 3 * per_step


def test_config_knob_values() -> None:
    assert load_config(None, []).logging.trajectory_groups_per_step == 2
    assert (
        load_config(None, ["logging.trajectory_groups_per_step=all"]).logging.trajectory_groups_per_step
        == "all"
    )
    for bad in ("-1", "some"):
        with pytest.raises(ConfigError, match="trajectory_groups_per_step"):
            load_config(None, [f"logging.trajectory_groups_per_step={bad}"])


# -- eval transcripts ----------------------------------------------------------------------------------


def test_eval_transcripts_use_the_record_shape(tmp_path: Path) -> None:
    from synthetic_runs import write_eval

    problems = make_problems(2, 3, prefix="test")
    summary = write_eval(tmp_path / "ev.jsonl", mode="retool", label="rl", problems=problems, val_n=3)
    assert summary["status"] == "complete"
    lines = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text(encoding="utf-8").split("\n") if x]
    for line in lines:
        rewards = [c["reward"] for c in line["candidates"]]
        for cand in line["candidates"]:
            rec = cand["trajectory"]
            assert (
                rec["source"] == "eval" and rec["mode"] == "retool" and rec["mask_source"] == "turn_structure"
            )
            assert rec["problem_id"] == line["id"] and rec["group_index"] == cand["index"]
            assert rec["advantage"] == pytest.approx(cand["reward"] - sum(rewards) / len(rewards))
            assert rec["spans"] and all(s["trained"] == (s["role"] == "completion") for s in rec["spans"])
            assert rec["messages"] == cand["messages"]


def test_eval_without_transcripts_has_no_record(tmp_path: Path) -> None:
    from retool.config import Config
    from retool.evaluate.runner import run_eval

    async def rollout(request: RolloutRequest) -> list[list[Any]]:
        rng = random.Random(request.seed)
        return [[make_trajectory(g.problem, b, rng) for b in range(g.group_size)] for g in request.groups]

    asyncio.run(
        run_eval(
            make_problems(1, 0),
            Components(backend=None, protocol=CharProtocol(), verifier=None, sampler=object()),  # type: ignore[arg-type]
            config=Config(),
            mode="retool",
            output=tmp_path / "ev.jsonl",
            val_n=2,
            rollout_fn=rollout,
        )
    )
    line = json.loads((tmp_path / "ev.jsonl").read_text(encoding="utf-8").split("\n")[0])
    assert all("trajectory" not in c and "messages" not in c for c in line["candidates"])
