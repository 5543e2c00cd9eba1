"""Off-policy pipelining with fake components: the version schedule and its tags, the queue in
checkpoints (resume with a non-empty queue), requeueing stale batches, failures in the batch sampler, and
dynamic sampling / the text-only share with k >= 1."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retool.config import Config, override_config
from retool.env import ProblemList
from retool.rollout import Trajectory
from retool.train.ahead import PipelineState, requeue_stale
from retool.train.checkpoint import PIPELINE_FILE, CheckpointManager
from retool.train.loop import Trainer
from retool.train.metrics import StepLostError
from retool.train.sampling import Batch
from test_train_loop import (
    PROBLEMS,
    FakeClient,
    as_rollout_fn,
    essentials,
    fake_components,
    fake_config,
    fake_rollouts,
    read_metrics,
    scripted_rollouts,
)


class VersionedClient(FakeClient):
    """Every optimizer step moves the weight by 1 besides the gradient (the fake's gradient sums to 0 over
    centred advantages), so each version samples differently; ``weights[v]`` is version v's weight."""

    def __init__(self, fail_at_optim: int | None = None) -> None:
        super().__init__(fail_at_optim)
        self.weights = [0.0]

    async def optim_step_async(self, adam: Any) -> Any:
        result = await super().optim_step_async(adam)
        self.weight += 1.0
        self.weights.append(self.weight)
        return result

    async def load_state_async(self, path: str) -> None:
        await super().load_state_async(path)
        self.weights = [float("nan")] * self.optim_steps + [self.weight]


def config(k: int, steps: int = 6, every: int = 2, *extra: str) -> Config:
    return override_config(fake_config(steps=steps, every=every), [f"train.max_steps_off_policy={k}", *extra])


def trainer(
    cfg: Config, run_dir: Path, client: Any = None, rollout_fn: Any = fake_rollouts, **kw: Any
) -> Trainer:
    return Trainer(
        cfg,
        run_dir,
        source=ProblemList(PROBLEMS, shuffle=True),
        components=fake_components(client or VersionedClient()),
        rollout_fn=rollout_fn,
        **kw,
    )


def recording(calls: list[tuple[str, float]]) -> Any:
    """A rollout function that notes (first problem id, sampler weight) of every call."""

    async def rollouts(problems: Any, *, sampler: Any, **kw: Any) -> Any:
        calls.append((problems[0].id, sampler.version))
        return await scripted_rollouts(problems, sampler=sampler, **kw)

    return as_rollout_fn(rollouts)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_batch_is_sampled_by_the_version_the_schedule_names_and_tagged_with_it(
    tmp_path: Path, k: int
) -> None:
    """Batch t is sampled on version max(t - 1 - k, 0), trained at version t - 1: lag min(k, t - 1)."""
    calls: list[tuple[str, float]] = []
    client = VersionedClient()
    trainer(config(k, steps=6, every=0), tmp_path / "run", client, recording(calls)).run()
    rows = read_metrics(tmp_path / "run")
    assert client.optim_steps == 6 and all(r["train/optimizer_stepped"] for r in rows)
    for t, r in enumerate(rows, start=1):
        version = max(t - 1 - k, 0)
        assert r["offpolicy/policy_version"] == version
        assert r["offpolicy/lag_max"] == r["offpolicy/lag_mean"] == min(k, t - 1)
        # the sampler that sampled the step's problems held the weights of that version
        first = r["problem_ids"][0]
        assert (first, client.weights[version]) in calls
    tags = {}
    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines():
        rec = json.loads(line)
        tags.setdefault(rec["step"], set()).add(rec["policy_version"])
    assert tags == {t: {max(t - 1 - k, 0)} for t in range(1, 7)}


def test_off_policy_runs_train_on_the_same_problems_as_the_synchronous_loop(tmp_path: Path) -> None:
    """Only the sampling weights differ; with k = 0 the loop is the synchronous one (lag 0 everywhere)."""
    runs = {}
    for k in (0, 1, 2):
        trainer(config(k, steps=6, every=0), tmp_path / f"k{k}").run()
        runs[k] = read_metrics(tmp_path / f"k{k}")
    ids = {k: [r["problem_ids"] for r in rows] for k, rows in runs.items()}
    assert ids[0] == ids[1] == ids[2]
    assert all(r["offpolicy/lag_max"] == 0 for r in runs[0])
    rewards = {k: [r["rewards"] for r in rows] for k, rows in runs.items()}
    assert rewards[0][:1] == rewards[1][:1] and rewards[0][2:] != rewards[1][2:]  # other weights sampled


@pytest.mark.parametrize(("k", "crash_at_optim"), [(1, 3), (1, 4), (2, 3), (2, 5)])
def test_resume_with_a_non_empty_queue_matches_an_uninterrupted_run(
    tmp_path: Path, k: int, crash_at_optim: int
) -> None:
    cfg = config(k, steps=7, every=2)
    trainer(cfg, tmp_path / "ref").run()
    reference = read_metrics(tmp_path / "ref")
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(cfg, crashed, VersionedClient(fail_at_optim=crash_at_optim)).run()
    latest = CheckpointManager(crashed).latest()
    assert latest is not None
    done = int(latest.name.removeprefix("step_"))
    json.loads((latest / PIPELINE_FILE).read_text())  # plain JSON records, no pickle
    queued = CheckpointManager.load_pipeline(latest, PipelineState)
    assert queued is not None
    # The checkpoint holds the batches of the next k steps, sampled by versions done-k..done-1.
    assert [b.step for b in queued.batches] == list(range(done + 1, done + 1 + k))
    assert [b.version for b in queued.batches] == [max(s - 1 - k, 0) for s in range(done + 1, done + 1 + k)]
    summary = trainer(cfg, crashed, resume=True).run()
    assert summary.start_step == done and summary.last_step == 7
    resumed = read_metrics(crashed)
    assert [r["step"] for r in resumed] == list(range(1, 8))
    assert essentials(resumed) == essentials(reference)
    assert [r["offpolicy/policy_version"] for r in resumed] == [
        r["offpolicy/policy_version"] for r in reference
    ]


def test_resuming_with_a_smaller_bound_requeues_the_stale_batches(tmp_path: Path) -> None:
    """Written with k = 2, resumed with k = 1: the queued batches of steps 3 and 4 (versions 0 and 1) are
    too old for step 3 (trained at version 2); their problems are sampled again, first, in order."""
    cfg = config(2, steps=6, every=2)
    trainer(cfg, tmp_path / "ref").run()
    reference = read_metrics(tmp_path / "ref")
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(cfg, run, VersionedClient(fail_at_optim=3)).run()
    trainer(override_config(cfg, ["train.max_steps_off_policy=1"]), run, resume=True).run()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert essentials(rows[:2]) == essentials(reference[:2])
    # Same problems in the same order, now sampled within the new bound (the resumed weights: version 2).
    assert [r["problem_ids"] for r in rows] == [r["problem_ids"] for r in reference]
    assert [r["offpolicy/policy_version"] for r in rows[2:]] == [2, 2, 3, 4]
    assert all(r["offpolicy/lag_max"] <= 1 for r in rows[2:])
    assert rows[2]["offpolicy/requeued_groups"] == 6  # two batches of 3 groups
    assert rows[3]["rewards"] != reference[3]["rewards"]


def _batch(step: int, version: int, problems: list[str]) -> Batch:
    from retool.train.datasource import DataPosition
    from retool.train.sampling import Collected

    by_id = {p.id: p for p in PROBLEMS}
    picked = [by_id[p] for p in problems]
    return Batch(step, version, Collected([], [[]] * len(picked), picked), DataPosition(index=step), [])


def test_queued_batches_are_json_records_refused_in_one_line_when_they_no_longer_fit(tmp_path: Path) -> None:
    """A checkpoint's queued batches round-trip through JSON records (tuples stay tuples); a record naming a
    class outside the package, or one whose fields its class no longer takes, is refused in one line."""
    from retool.train.checkpoint import CheckpointError
    from retool.train.state_json import RecordError, from_record, to_record

    batch = _batch(3, 2, ["p00", "p01"])
    batch.collected.group_informative = (True, False)
    state = PipelineState(1, [batch], [PROBLEMS[5]])
    assert from_record(json.loads(json.dumps(to_record(state)))) == state
    manager = CheckpointManager(tmp_path / "run")
    manager.write_pipeline(tmp_path, 3, state)
    assert CheckpointManager.load_pipeline(tmp_path, PipelineState) == state
    with pytest.raises(CheckpointError, match="holds a Batch, not a PipelineState"):
        (tmp_path / PIPELINE_FILE).write_text(json.dumps(to_record(batch)))
        CheckpointManager.load_pipeline(tmp_path, PipelineState)
    for record, message in [
        ({"__type__": "os:system"}, "only dataclasses of retool are read back"),
        ({**to_record(PROBLEMS[0]), "renamed": 1}, "record does not fit its class"),  # type: ignore[dict-item]
        ({"__type__": "retool.nowhere:Thing"}, "which this version of retool does not have"),
    ]:
        (tmp_path / PIPELINE_FILE).write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match=message) as caught:
            CheckpointManager.load_pipeline(tmp_path, PipelineState)
        assert "\n" not in str(caught.value)
    with pytest.raises(RecordError, match="cannot record a PosixPath"):
        to_record(PipelineState(0, [], [tmp_path]))  # type: ignore[list-item]


def test_requeue_stale_keeps_the_fresh_prefix_and_requeues_in_draw_order() -> None:
    fresh, old, older = _batch(3, 2, ["p00"]), _batch(4, 1, ["p01", "p02"]), _batch(5, 3, ["p03"])
    older.replay = [PROBLEMS[9]]
    kept, replay, groups = requeue_stale([fresh, old, older], [], 1)
    # step 4 trains at version 3: lag 2 > 1. Step 5 is fresh enough but its problems were drawn later.
    assert kept == [fresh] and groups == 3
    assert [p.id for p in replay] == ["p01", "p02", "p03", "p09"]
    assert requeue_stale([fresh, old], [PROBLEMS[8]], 2) == ([fresh, old], [PROBLEMS[8]], 0)


def test_a_failed_batch_stops_the_run_when_the_trainer_reaches_it(tmp_path: Path) -> None:
    """Batch 4 (sampled while step 3 trains) loses every trajectory: steps 1-3 finish, the checkpoint of
    step 2 holds batch 3, and a resume samples batch 4 again."""
    calls: list[int] = []

    async def failing(problems: Any, *, sampler: Any, group_size: int, seed: int, **kw: Any) -> Any:
        groups = await scripted_rollouts(problems, sampler=sampler, group_size=group_size, seed=seed, **kw)
        calls.append(seed)
        if len(calls) == 4:
            lost = {"stop_reason": "sampler_error", "error": "ConnectionResetError: gone"}
            return [
                [replace(traj, reward=-1.0, outcome=replace(traj.outcome, **lost)) for traj in group]
                for group in groups
            ]
        return groups

    cfg = config(1, steps=5, every=2)
    trainer(cfg, tmp_path / "ref").run()
    run = tmp_path / "run"
    with pytest.raises(StepLostError, match="step 4: all 12 trajectories"):
        trainer(cfg, run, rollout_fn=as_rollout_fn(failing)).run()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    trainer(cfg, run, resume=True).run()
    assert essentials(read_metrics(run)) == essentials(read_metrics(tmp_path / "ref"))


def test_a_checkpoint_stores_the_batches_before_a_failed_one(tmp_path: Path) -> None:
    """k = 2: batch 4 fails while step 2 trains; the checkpoint of step 2 stores batch 3 alone and the
    stream position after it, so a resume samples batch 4 again (from version 2)."""
    seen: list[int] = []

    async def failing(problems: Any, **kw: Any) -> Any:
        groups = await scripted_rollouts(problems, **kw)
        seen.append(1)
        if len(seen) == 4:
            raise ConnectionError("sampler unreachable")
        return groups

    cfg = config(2, steps=6, every=2)
    run = tmp_path / "run"
    with pytest.raises(ConnectionError, match="unreachable"):
        trainer(cfg, run, rollout_fn=as_rollout_fn(failing)).run()
    latest = CheckpointManager(run).latest()
    assert latest is not None and latest.name == "step_000002"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["extra"]["pipeline"] == {"batches": [3], "replay": 0}
    assert state["data_position"]["index"] == 9  # three steps of 3 problems drawn, batch 4's not counted
    trainer(cfg, run, resume=True).run()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["offpolicy/policy_version"] for r in rows] == [0, 0, 0, 2, 2, 3]
    assert len({pid for r in rows for pid in r["problem_ids"][:3]}) == 10  # no problem skipped or repeated


@pytest.mark.parametrize("k", [1, 2])
def test_dynamic_sampling_with_k_resumes_exactly(tmp_path: Path, k: int) -> None:
    cfg = config(
        k, 6, 2, "filters.dynamic_sampling=true", "filters.max_extra_rounds=2", "rollout.group_size=2"
    )
    trainer(cfg, tmp_path / "ref").run()
    reference = read_metrics(tmp_path / "ref")
    assert any(r["sampling/rounds"] > 1 for r in reference), "no step needed a second round"
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(cfg, tmp_path / "run", VersionedClient(fail_at_optim=4)).run()
    trainer(cfg, tmp_path / "run", resume=True).run()
    assert essentials(read_metrics(tmp_path / "run")) == essentials(reference)


def test_sigint_with_a_full_queue_saves_it_and_stops(tmp_path: Path) -> None:
    from train_harness import HarnessTrainer, PhaseSignals

    cfg = config(2, steps=6, every=100)
    trainer(cfg, tmp_path / "ref").run()
    summary = HarnessTrainer(
        cfg,
        tmp_path / "run",
        source=ProblemList(PROBLEMS, shuffle=True),
        components=fake_components(VersionedClient()),
        rollout_fn=fake_rollouts,
        signals=PhaseSignals(cfg, sigint_at=["optim:3"]),
    ).run()
    assert summary.interrupted and summary.last_step == 3
    latest = CheckpointManager(tmp_path / "run").latest()
    assert latest is not None
    assert json.loads((latest / "trainer_state.json").read_text())["extra"]["pipeline"]["batches"] == [4, 5]
    trainer(cfg, tmp_path / "run", resume=True).run()
    assert essentials(read_metrics(tmp_path / "run")) == essentials(read_metrics(tmp_path / "ref"))


def test_offpolicy_metrics_reach_tensorboard(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    class MeasuringClient(VersionedClient):  # reports a mismatch, as the real backends do for RL losses
        async def forward_backward_async(self, datums: Any, loss_fn: Any, loss_config: Any = None) -> Any:
            result = await super().forward_backward_async(datums, loss_fn, loss_config)
            result.mismatch_tokens, result.logprob_diff_mean = result.trained_tokens, 0.01
            return result

    cfg = override_config(config(1, steps=3, every=0), ["logging.tracker='tensorboard'"])
    trainer(cfg, tmp_path / "run", MeasuringClient()).run()
    events = accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "offpolicy/lag_mean",
        "offpolicy/lag_max",
        "offpolicy/logprob_diff_mean",
        "offpolicy/kl_k3",
        "offpolicy/ratio_outside",
        "offpolicy/sampler_check_failed",
        "time/wait",
    ):
        assert tag in tags, tag
    assert [e.value for e in events.Scalars("offpolicy/lag_max")] == [0.0, 1.0, 1.0]


DRIFT = 0.1  # the fake policy's logprob of every sampled token is -0.5 - DRIFT * weight


class DriftingClient(VersionedClient):
    """Measures the sampler/trainer mismatch as the real backends do: the trainer's logprob of a sampled
    token is -0.5 - DRIFT * (its weight now), the sampler's the same at the weight it sampled with."""

    async def forward_backward_async(self, datums: Any, loss_fn: Any, loss_config: Any = None) -> Any:
        result = await super().forward_backward_async(datums, loss_fn, loss_config)
        lp = -0.5 - DRIFT * self.weight
        diffs = [abs(lp - mu) for d in datums for w, mu in zip(d.weights, d.logprobs, strict=True) if w]
        result.mismatch_tokens = len(diffs)
        result.logprob_diff_mean, result.logprob_diff_max = sum(diffs) / len(diffs), max(diffs)
        return result


class NeverRefreshed(DriftingClient):
    """The weight sync is broken: every refresh hands out the first sampler again."""

    async def sampling_client_async(self) -> Any:
        if not hasattr(self, "first"):
            self.first = await super().sampling_client_async()
        return self.first


async def _drifting(problems: Any, *, sampler: Any, **kw: Any) -> Any:
    groups = await scripted_rollouts(problems, sampler=sampler, **kw)

    def drifted(t: Trajectory) -> Trajectory:
        lp = -0.5 - DRIFT * sampler.version
        steps = tuple(
            replace(x, turn=replace(x.turn, logprobs=[lp] * len(x.turn.logprobs))) for x in t.transitions
        )
        return replace(t, transitions=steps)

    return [[drifted(t) for t in g] for g in groups]


drifting_rollouts = as_rollout_fn(_drifting)


def test_a_sampler_that_is_not_refreshed_fails_the_on_policy_check(tmp_path: Path) -> None:
    """k = 0, the trainer pushing the weights every step: no mismatch, lag 0, no alarm. A sampler that
    never receives new weights still reads lag 0 (the trainer believes it published them) but its
    logprobs drift from the trainer's: offpolicy/sampler_check_failed = 1 from step 2 on. Breaking the
    trainer's refresh (``Trainer._current_policy`` handing out its first sampler again) fails the fresh half."""
    cfg = config(0, steps=4, every=0)
    rows = {}
    for name, client in (("fresh", DriftingClient()), ("stale", NeverRefreshed())):
        trainer(cfg, tmp_path / name, client, drifting_rollouts).run()
        rows[name] = read_metrics(tmp_path / name)
        assert client.optim_steps == 4 and all(r["train/optimizer_stepped"] for r in rows[name])
    for r in rows["fresh"]:
        assert r["offpolicy/lag_max"] == 0 and r["offpolicy/sampler_check_failed"] == 0.0
        assert r["offpolicy/logprob_diff_mean"] == pytest.approx(0.0, abs=1e-9)
    stale = rows["stale"]
    assert [r["offpolicy/lag_max"] for r in stale] == [0.0] * 4
    assert [r["offpolicy/sampler_check_failed"] for r in stale] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["offpolicy/logprob_diff_mean"] > cfg.train.sampler_check_tol for r in stale[1:])


def test_lagged_steps_show_the_mismatch_of_their_lag_without_an_alarm(tmp_path: Path) -> None:
    """k = 1: step t trains on version t - 2's samples; the mismatch is the drift between the two versions
    and the on-policy check stays quiet (it judges lag-0 steps only)."""
    client = DriftingClient()
    trainer(config(1, steps=4, every=0), tmp_path / "run", client, drifting_rollouts).run()
    rows = read_metrics(tmp_path / "run")
    assert [r["offpolicy/lag_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    for t, r in enumerate(rows, start=1):
        sampled, trained = client.weights[max(t - 2, 0)], client.weights[t - 1]
        assert r["offpolicy/logprob_diff_mean"] == pytest.approx(DRIFT * abs(trained - sampled))
        assert r["offpolicy/sampler_check_failed"] == 0.0
