"""The training loop with fake components: data order, metrics, checkpoints, resume, SIGINT."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import AdamParams, ForwardBackwardResult, OptimStepResult, Sample
from retool.components import Components
from retool.config import Config, load_config, override_config
from retool.data.problem import Problem
from retool.env import ProblemList, ReToolOutcome
from retool.rollout import AssistantTurn, RolloutFn, RolloutRequest, Trajectory, Transition
from retool.sandbox.base import ExecResult
from retool.train.checkpoint import CheckpointManager
from retool.train.datasource import DataPosition, ProblemStream
from retool.train.loop import RunDirError, Trainer, run_training
from retool.train.metrics import rollout_metrics
from train_harness import PhaseSignals

PROBLEMS = [Problem(f"p{i:02d}", f"What is {i} + {i}?", str(2 * i)) for i in range(10)]


class FakeSampler:
    def __init__(self, version: float) -> None:
        self.version = version

    async def sample_async(self, prompt_tokens, num_samples, params) -> list[Sample]:  # pragma: no cover
        raise NotImplementedError


class FakeClient(TrainingClient):
    """A 'model' with one scalar weight; save/load keep it and the step count in a JSON file."""

    tokenizer = None

    def __init__(self, fail_at_optim: int | None = None) -> None:
        self.weight = 0.0
        self.grad = 0.0
        self.optim_steps = 0
        self.refreshes = 0
        self.fail_at_optim = fail_at_optim

    async def sampling_client_async(self) -> FakeSampler:
        self.refreshes += 1
        return FakeSampler(self.weight)

    async def forward_backward_async(self, datums, loss_fn, loss_config=None) -> ForwardBackwardResult:
        g = sum(w * a for d in datums for w, a in zip(d.weights, d.advantages, strict=True))
        self.grad += g
        n = sum(1 for d in datums for w in d.weights if w)
        return ForwardBackwardResult(loss=-g, trained_tokens=n)

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        if self.fail_at_optim is not None and self.optim_steps + 1 >= self.fail_at_optim:
            raise RuntimeError("simulated crash in the optimizer step")
        self.weight = round(self.weight + adam.lr * self.grad, 12)
        self.grad = 0.0
        self.optim_steps += 1
        return OptimStepResult(grad_norm=abs(self.weight), lr=adam.lr)

    async def save_state_async(self, name: str) -> str:
        path = Path(name)
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.json").write_text(json.dumps({"weight": self.weight, "optim_steps": self.optim_steps}))
        return str(path)

    async def load_state_async(self, path: str) -> None:
        state = json.loads((Path(path) / "state.json").read_text())
        self.weight = state["weight"]
        self.optim_steps = state["optim_steps"]


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little")


def scripted_trajectory(problem: Problem, pi: int, b: int, seed: int, sampler: Any) -> Trajectory:
    """Deterministic in (problem, seed, branch, sampler weights); the reward depends on the weights too."""
    h = _h(problem.id, seed, b, sampler.version)
    n = 2 + h % 5
    reward = 1.0 if (h >> 8) % 3 == 0 else -1.0
    turn = AssistantTurn([1, 2, 3], [10 + (h >> k) % 40 for k in range(n)], [-0.5] * n, "x")
    return Trajectory(
        problem=problem,
        group_index=b,
        problem_index=pi,
        transitions=(Transition(turn, reward, True),),
        reward=reward,
        outcome=ReToolOutcome(correct=reward > 0, valid_format=True, stop_reason="answer"),
    )


async def scripted_rollouts(
    problems: list[Problem], *, sampler: Any, group_size: int, seed: int, **_: Any
) -> list[list[Trajectory]]:
    """The groups of ``problems`` from loose parts (what the tests' wrappers change)."""
    return [
        [scripted_trajectory(p, pi, b, seed, sampler) for b in range(group_size)]
        for pi, p in enumerate(problems)
    ]


def as_rollout_fn(loose: Any) -> RolloutFn:
    """A rollout function over a loose-parts coroutine ``loose(problems, sampler=, group_size=, seed=)``."""

    async def rollout_fn(request: RolloutRequest) -> list[list[Trajectory]]:
        problems = [g.problem for g in request.groups]
        group_size = request.groups[0].group_size
        groups = await loose(problems, sampler=request.policy, group_size=group_size, seed=request.seed)
        for trajectory in (t for g in groups for t in g):
            if request.on_trajectory is not None:
                request.on_trajectory(trajectory)
        return groups

    return rollout_fn


fake_rollouts = as_rollout_fn(scripted_rollouts)


def fake_config(steps: int = 6, every: int = 2, keep: int = 2) -> Config:
    return load_config(
        None,
        [
            f"train.steps={steps}",
            f"checkpoint.every={every}",
            f"checkpoint.keep_last={keep}",
            "rollout.questions_per_step=3",
            "rollout.group_size=4",
            "optimizer.lr=0.5",
            "logging.tracker='none'",
            "logging.progress=false",
        ],
    )


class StubProtocol:
    """What the trainer itself asks of the protocol when the rollouts are scripted: the records' text."""

    use_tools = True

    def decode(self, tokens: list[int]) -> str:
        return " ".join(map(str, tokens))


def fake_components(client: Any = None) -> Components:
    """A fake backend with stand-ins for the parts only the real rollout would touch."""
    return Components(
        backend=client or FakeClient(), protocol=StubProtocol(), verifier=object(), executor=object()
    )


def make_trainer(
    cfg: Config, run_dir: Path, resume: bool = False, client: FakeClient | None = None, **hooks: Any
) -> Trainer:
    hooks.setdefault("rollout_fn", fake_rollouts)
    return Trainer(
        cfg,
        run_dir,
        resume=resume,
        source=ProblemList(PROBLEMS, shuffle=True),
        components=fake_components(client),
        **hooks,
    )


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def essentials(rows: list[dict[str, Any]]) -> list[tuple]:
    return [
        (r["step"], tuple(r["problem_ids"]), json.dumps(r["rewards"]), r["policy/grad_norm"]) for r in rows
    ]


def test_problem_stream_is_deterministic_and_resumable() -> None:
    source = ProblemList(PROBLEMS, shuffle=True).epoch
    whole = ProblemStream(source, seed=3)
    ids = [p.id for _ in range(7) for p in whole.next_batch(3)]  # 21 problems: crosses two epochs
    assert sorted(ids[:10]) == sorted(p.id for p in PROBLEMS) == sorted(ids[10:20])
    assert ids[:10] != ids[10:20]  # each epoch reshuffled
    first = ProblemStream(source, seed=3)
    got = [p.id for _ in range(4) for p in first.next_batch(3)]
    resumed = ProblemStream(source, seed=3, position=DataPosition(**first.position.to_dict()))
    got += [p.id for _ in range(3) for p in resumed.next_batch(3)]
    assert got == ids


def test_loop_writes_one_metrics_line_per_step_and_keeps_last_checkpoints(tmp_path: Path) -> None:
    cfg = fake_config(steps=5, every=2, keep=2)
    client = FakeClient()
    summary = make_trainer(cfg, tmp_path / "run", client=client).run()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert summary.last_step == 5 and not summary.interrupted
    assert client.refreshes == 5  # the sampler is refreshed at the start of every step
    stepped = [r for r in rows if r["train/optimizer_stepped"]]
    assert client.optim_steps == len(stepped) > 0
    for r in rows:
        assert len(r["problem_ids"]) == 3 and len(r["rewards"]) == 3
        rewards = [x for g in r["rewards"] for x in g]
        assert len(rewards) == 12 and set(rewards) <= {-1.0, 1.0}
        assert r["task/reward_mean"] == pytest.approx(sum(rewards) / 12)
        degenerate = sum(1 for g in r["rewards"] if len(set(g)) == 1)
        assert r["task/degenerate_group_rate"] == pytest.approx(degenerate / 3)
        # The scripted trajectories answer at once, with no tool call: no self-correction, no execution.
        assert r["tool/self_correction_rate"] == 0.0 and r["env/exec_calls"] == 0.0
        assert r["stop/answer"] == 1.0
        assert r["time/rollout"] >= 0.0 and r["time/train"] >= 0.0
        # Each trajectory samples 2..6 tokens (``scripted_trajectory``); 12 of them per step.
        assert 24 <= r["tokens/completion"] <= 72
    # 10 problems, 3 per step: steps 1-3 and the first of step 4 are epoch 0, all distinct.
    first_epoch = [pid for r in rows[:3] for pid in r["problem_ids"]]
    assert len(set(first_epoch)) == 9
    names = [p.name for p in CheckpointManager(tmp_path / "run").complete_checkpoints()]
    assert names == ["step_000004", "step_000005"]  # every 2, the final one, keep the last 2
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000005"
    assert (tmp_path / "run" / "config.toml").is_file()


def test_existing_run_dir_is_not_overwritten(tmp_path: Path) -> None:
    cfg = fake_config(steps=1)
    make_trainer(cfg, tmp_path / "run").run()
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="--resume"):
        make_trainer(cfg, tmp_path / "run").run()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    with pytest.raises(RunDirError, match="no run to resume"):
        make_trainer(cfg, tmp_path / "elsewhere", resume=True).run()


@pytest.mark.parametrize("crash_at_optim", [3, 4])
def test_resume_after_crash_matches_an_uninterrupted_run(tmp_path: Path, crash_at_optim: int) -> None:
    cfg = fake_config(steps=7, every=2)
    make_trainer(cfg, tmp_path / "ref").run()
    reference = read_metrics(tmp_path / "ref")
    assert any(r["train/optimizer_stepped"] for r in reference)

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(cfg, crashed, client=FakeClient(fail_at_optim=crash_at_optim)).run()
    with open(crashed / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 99, "partial')  # a line cut by the kill
    summary = make_trainer(cfg, crashed, resume=True).run()
    assert summary.start_step in (2, 4, 6) and summary.last_step == 7
    resumed = read_metrics(crashed)
    assert [r["step"] for r in resumed] == list(range(1, 8))
    assert essentials(resumed) == essentials(reference)


def test_sigint_saves_a_checkpoint_and_stops_cleanly(tmp_path: Path) -> None:
    cfg = fake_config(steps=6, every=100)
    make_trainer(cfg, tmp_path / "ref").run()
    signals = PhaseSignals(cfg, sigint_at=["rollout:2"])  # SIGINT once step 2's first group is rolled out
    summary = make_trainer(cfg, tmp_path / "run", rollout_fn=signals.rollouts(fake_rollouts)).run()
    assert summary.interrupted and summary.last_step == 2
    assert CheckpointManager(tmp_path / "run").latest().name == "step_000002"
    make_trainer(cfg, tmp_path / "run", resume=True).run()
    assert essentials(read_metrics(tmp_path / "run")) == essentials(read_metrics(tmp_path / "ref"))


def test_run_training_with_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    cfg = fake_config(steps=2, every=1).model_copy(deep=True)
    cfg.logging.tracker = "tensorboard"
    run_training(
        cfg,
        tmp_path / "run",
        source=ProblemList(PROBLEMS),
        components=fake_components(),
        rollout_fn=fake_rollouts,
    )
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_rollout_metrics_definitions() -> None:
    def traj(correct: bool, results: list[bool], stop: str = "answer") -> Trajectory:
        return Trajectory(
            problem=PROBLEMS[0],
            group_index=0,
            transitions=(
                Transition(AssistantTurn([1, 2], [3, 4, 5], [-1.0] * 3, "x"), 1.0 if correct else -1.0, True),
            ),
            reward=1.0 if correct else -1.0,
            outcome=ReToolOutcome(
                correct=correct,
                valid_format=correct,
                stop_reason=stop,
                codes=("print(1)",) * len(results),
                exec_results=tuple(ExecResult(ok, "", "", 0 if ok else 1, False, 0.5) for ok in results),
            ),
        )

    groups = [[traj(True, []), traj(True, [False, True]), traj(False, [True], "max_turns"), traj(False, [])]]
    m = rollout_metrics(groups)
    assert m["task/correct_rate"] == 0.5 and m["task/reward_mean"] == 0.0
    assert m["tool/code_share"] == 0.5 and m["tool/mean_code_calls"] == 0.75
    assert m["tool/correct_without_code_rate"] == 0.25
    assert m["tool/self_correction_rate"] == 0.25 and m["tool/self_correction_given_error"] == 1.0
    assert m["env/exec_calls"] == 3 and m["env/exec_error_rate"] == pytest.approx(1 / 3)
    assert m["stop/max_turns"] == 0.25 and m["stop/answer"] == 0.75
    assert m["tokens/completion"] == 12 and m["policy/response_length"] == 3


def test_default_components_are_built_for_the_run_folder_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--run-dir`` / ``--resume`` may name another folder than ``train.run_dir``: the components the
    trainer builds follow it (the backend keeps its own checkpoints there), and it closes them."""
    from retool.train import loop

    seen: list[Config] = []
    closed: list[bool] = []

    class Built(Components):
        async def aclose(self) -> None:
            closed.append(True)

    monkeypatch.setattr(
        loop,
        "build_components",
        lambda c: seen.append(c) or Built(FakeClient(), StubProtocol(), object(), object()),
    )
    cfg = override_config(fake_config(steps=1), ["train.run_dir='elsewhere'"])
    Trainer(cfg, tmp_path / "run", source=ProblemList(PROBLEMS), rollout_fn=fake_rollouts).run()
    assert seen[0].train.run_dir == str(tmp_path / "run") and cfg.train.run_dir == "elsewhere"
    assert seen[0].optimizer.lr == cfg.optimizer.lr
    assert closed == [True]


def test_components_passed_in_stay_open(tmp_path: Path) -> None:
    closed: list[bool] = []

    class Lent(Components):
        async def aclose(self) -> None:  # pragma: no cover - must not be called
            closed.append(True)

    parts = Lent(FakeClient(), StubProtocol(), object(), object())
    Trainer(
        fake_config(steps=1),
        tmp_path / "run",
        source=ProblemList(PROBLEMS),
        components=parts,
        rollout_fn=fake_rollouts,
    ).run()
    assert closed == []


@pytest.mark.parametrize("k", [0, 1])
def test_the_synchronous_step_samples_in_the_trainers_own_task(tmp_path: Path, k: int) -> None:
    """k = 0: each step awaits its sampling itself (no background task); only k >= 1 samples ahead in
    the pipeline's task, ``retool-rollouts`` (``retool.train.ahead``)."""
    tasks: list[set[str]] = []

    async def rollout_fn(request: RolloutRequest) -> list[list[Trajectory]]:
        tasks.append({t.get_name() for t in asyncio.all_tasks()})
        return await fake_rollouts(request)

    cfg = override_config(fake_config(steps=3, every=0), [f"train.max_steps_off_policy={k}"])
    make_trainer(cfg, tmp_path / "run", rollout_fn=rollout_fn).run()
    assert len(tasks) == 3
    assert all(("retool-rollouts" in names) == (k > 0) for names in tasks)
