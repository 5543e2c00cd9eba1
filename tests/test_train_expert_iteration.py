"""Expert iteration (``retool.train.expert_iteration``) with a scripted sampler and a fake training client:
what a round keeps (verified, tool-using, within the budgets, capped per problem, no duplicates), the exact
count of sampled trajectories and the stop at ``max_trajectories``, every SFT from the same start while
sampling uses the latest model, a resume that reads finished rounds back instead of sampling them and one
that takes a round stopped midway up at its first unfinished chunk; and,
through the real environments, that a kept attempt is the trace ``retool sft --data`` trains on."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import ForwardBackwardResult, OptimStepResult, Sample
from retool.components import Components
from retool.config import RolloutConfig, SamplingConfig, load_config
from retool.data.problem import Problem
from retool.env import ReToolOutcome
from retool.env.scoring import AnswerScore
from retool.env.source import ProblemList
from retool.env.types import AssistantTurn
from retool.protocol import ChatProtocol
from retool.reward.verifier import score_answer
from retool.rollout.engine import RolloutRequest
from retool.rollout.types import Trajectory, Transition
from retool.sandbox.base import ExecResult
from retool.train.expert_iteration import (
    ExpertIterationSettings,
    RoundPlan,
    run_expert_iteration,
)
from retool.train.sampling import GroupRollouts
from retool.train.sft import SFTExample, SFTReport, protocol_mismatch, read_examples
from retool.train.trace import build_trajectory

BUDGETS = RolloutConfig(
    max_code_calls=2, max_assistant_turns=3, max_tokens_per_turn=8, max_trajectory_tokens=64
)
PROBLEMS = [Problem(f"p{i}", f"question {i}", str(i), "easy" if i % 2 else "hard") for i in range(6)]
LONG = "p5"  # its attempts are over the budgets: a turn of 12 tokens


class FakeClient(TrainingClient):
    """Weights are a version number; a saved state is a file holding it."""

    tokenizer = None

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[str] = []

    async def forward_backward_async(self, datums, loss_fn, loss_config=None):  # type: ignore[no-untyped-def]
        return ForwardBackwardResult(loss=1.0, trained_tokens=1)

    async def optim_step_async(self, adam):  # type: ignore[no-untyped-def]
        return OptimStepResult(grad_norm=0.0, lr=adam.lr)

    async def save_state_async(self, name: str) -> str:
        Path(name).mkdir(parents=True, exist_ok=True)
        (Path(name) / "version.json").write_text(json.dumps(self.version))
        return name

    async def load_state_async(self, path: str) -> None:
        self.version = json.loads((Path(path) / "version.json").read_text())
        self.loaded.append(Path(path).name)

    async def sampling_client_async(self):  # type: ignore[no-untyped-def]
        return Policy(self.version)


@dataclass(frozen=True)
class Policy:
    version: int

    async def sample_async(self, prompt_tokens, num_samples, params):  # type: ignore[no-untyped-def]
        raise AssertionError("the scripted rollout samples nothing")


@dataclass(frozen=True)
class Group:
    problem: Problem
    size: int


class Setup:
    """Stands in for a ToolSetup: its groups are the scripted rollout's requests."""

    verifier = None

    def group_builder(self, problem, group_size, problem_index=0, score=None):  # type: ignore[no-untyped-def]
        return Group(problem, group_size)


def attempt(problem: Problem, branch: int) -> Trajectory:
    """Branches 0 and 4 are right with a call (p0's two are the same tokens), 2 right without one, the odd
    ones wrong; p5's turns are too long for the budgets."""
    correct, calls = branch % 2 == 0, 0 if branch == 2 else 1
    index = int(problem.id[1:])
    width = 12 if problem.id == LONG else 2
    twin = 0 if index == 0 and branch == 4 else branch
    code, answer = [20 + twin] * width, [30 + twin] * width
    prompt = [1, index]
    turns = []
    if calls:
        turns.append(AssistantTurn(prompt, code, [0.0] * width, "call", kind="tool"))
        prompt = [*prompt, *code, 7]
    turns.append(AssistantTurn(prompt, answer, [0.0] * width, "answer", kind="answer"))
    outcome = ReToolOutcome(stop_reason="answer", correct=correct, codes=("print(1)",) * calls)
    transitions = tuple(Transition(t, 0.0, i == len(turns) - 1) for i, t in enumerate(turns))
    return Trajectory(
        problem=problem,
        group_index=branch,
        transitions=transitions,
        reward=1.0 if correct else -1.0,
        outcome=outcome,
    )


class Script:
    """The rollout function: each group's attempts; records every request's problems, sizes and policy."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[str], int, int]] = []

    async def __call__(self, request: RolloutRequest) -> list[list[Trajectory]]:
        groups: Sequence[Group] = request.groups  # type: ignore[assignment]
        sizes = {g.size for g in groups}
        assert len(sizes) == 1
        self.requests.append(([g.problem.id for g in groups], sizes.pop(), request.policy.version))  # type: ignore[attr-defined]
        return [[attempt(g.problem, b) for b in range(g.size)] for g in groups]

    @property
    def sampled(self) -> int:
        return sum(len(ids) * size for ids, size, _ in self.requests)


def plan_for(script: Script, samples: int) -> RoundPlan:
    sampler = GroupRollouts(
        ProblemList(PROBLEMS, shuffle=False), Setup(), SamplingConfig(), rollout_fn=script
    )  # type: ignore[arg-type]
    return RoundPlan(PROBLEMS, sampler, samples)


class Trainer:
    """SFT stand-in: records the weights' version it started from and the pool, then changes the weights."""

    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pool: Sequence[SFTExample]) -> SFTReport:
        self.calls.append((self.client.version, len(pool)))
        self.client.version = 100 * len(self.calls)
        return SFTReport(steps=2, examples=len(pool), losses=[2.0, 1.0])


def run(tmp_path: Path, script: Script, client: FakeClient, **settings: object):  # type: ignore[no-untyped-def]
    trainer = Trainer(client)
    samples = int(settings.pop("samples", 6))  # type: ignore[call-overload]
    result = run_expert_iteration(
        client,
        lambda r: plan_for(script, samples),
        trainer,
        ExpertIterationSettings(**settings),  # type: ignore[arg-type]
        out=tmp_path / "ei",
        budgets=BUDGETS,
    )
    return result, trainer


def test_a_round_keeps_verified_tool_using_attempts_capped_per_problem(tmp_path: Path) -> None:
    script, client = Script(), FakeClient()
    result, trainer = run(tmp_path, script, client, rounds=1, keep_per_problem=2)
    (report,) = result.rounds
    assert report.sampled == script.sampled == 36 and report.attempted == 6
    assert report.correct == 18 and report.pass_rate == pytest.approx(0.5)
    # p0: branch 0 kept, its branch 4 the same tokens; p1-p4: branches 0 and 4; p5: over the budgets.
    assert report.kept == 9 == len(result.pool)
    assert report.dropped == {"wrong": 18, "no_call": 6, "duplicate": 1, "over_budget": 2}
    assert report.kept_by_category == {"hard": 5, "easy": 4} and report.correct_by_category["easy"] == 9
    assert all(ex.style == "sampled" and ex.task.id != LONG for ex in result.pool)
    first = result.pool[0]
    assert first.tokens == [1, 0, 20, 20, 7, 30, 30] and first.weights == [0, 0, 1, 1, 0, 1, 1]
    assert trainer.calls == [(0, 9)] and client.version == 100  # one SFT, from the start
    folder = tmp_path / "ei" / "round-0"
    lines = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 36 and sum(x["verdict"] == "kept" for x in lines) == 9
    assert [e.tokens for e in read_examples(folder / "kept.jsonl")] == [e.tokens for e in result.pool]
    assert json.loads((folder / "report.json").read_text())["kept"] == 9

    capped, _ = run(tmp_path / "one", Script(), FakeClient(), rounds=1, keep_per_problem=1)
    assert capped.rounds[0].kept == 5 and capped.rounds[0].dropped["problem_full"] == 5


def test_every_sft_starts_from_the_start_and_rounds_sample_the_latest_model(tmp_path: Path) -> None:
    script, client = Script(), FakeClient()
    result, trainer = run(tmp_path, script, client, rounds=3, keep_per_problem=2)
    assert [v for _, _, v in script.requests] == [0, 100, 200]  # round r samples round r-1's SFT model
    assert [v for v, _ in trainer.calls] == [0, 0, 0]  # and every SFT starts from the start's weights
    # The same attempts again add nothing: the pool is capped and deduplicated.
    assert [n for _, n in trainer.calls] == [9, 9, 9] and [r.kept for r in result.rounds] == [9, 0, 0]
    assert result.sampled == 3 * 36 and client.version == 300
    assert not (tmp_path / "ei" / "round-0" / "state").exists()  # only the last round's weights are kept
    assert (tmp_path / "ei" / "round-2" / "state").is_dir()


def test_sampling_stops_at_exactly_max_trajectories(tmp_path: Path) -> None:
    script, client = Script(), FakeClient()
    result, trainer = run(
        tmp_path, script, client, rounds=3, max_trajectories=50, chunk_problems=2, samples=4
    )
    # Rounds 0 and 1: 6 problems x 4 = 24 each; round 2: the 2 left, a group of 2 of its first problem.
    assert [r.sampled for r in result.rounds] == [24, 24, 2] and result.sampled == 50 == script.sampled
    assert [r.budget_spent for r in result.rounds] == [False, False, True]
    assert script.requests[-1] == (["p0"], 2, 200)
    assert len(trainer.calls) == 3  # the last round still trains on its pool

    early, _ = run(tmp_path / "early", Script(), FakeClient(), rounds=5, max_trajectories=30, samples=4)
    assert [r.sampled for r in early.rounds] == [24, 6] and early.rounds[1].attempted == 2


def test_a_round_with_no_problems_left_ends_the_run(tmp_path: Path) -> None:
    """A source spent before ``rounds`` (every problem drawn by earlier rounds) stops the run: an empty
    round would only fine-tune on the same pool again."""
    script, client = Script(), FakeClient()
    trainer = Trainer(client)

    def plan(r: int) -> RoundPlan:
        if r == 0:
            return plan_for(script, 6)
        sampler = GroupRollouts(ProblemList([], shuffle=False), Setup(), SamplingConfig(), rollout_fn=script)  # type: ignore[arg-type]
        return RoundPlan([], sampler, 6)

    result = run_expert_iteration(
        client, plan, trainer, ExpertIterationSettings(rounds=50), out=tmp_path / "ei", budgets=BUDGETS
    )
    assert [r.round for r in result.rounds] == [0] and len(trainer.calls) == 1
    assert not (tmp_path / "ei" / "round-1").exists()


def test_a_resumed_run_reads_finished_rounds_back_without_sampling(tmp_path: Path) -> None:
    first, client = Script(), FakeClient()
    run(tmp_path, first, client, rounds=2, keep_per_problem=2)
    assert len(first.requests) == 2

    again, fresh = Script(), FakeClient()  # a new process: the client holds the start model
    result, trainer = run(tmp_path, again, fresh, rounds=3, keep_per_problem=2)
    assert [v for _, _, v in again.requests] == [200]  # round 2 only, sampled with round 1's model
    assert fresh.loaded == ["state", "start"]  # round 1's weights to sample, the start's to train
    assert trainer.calls == [(0, 9)] and [r.round for r in result.rounds] == [0, 1, 2]
    assert result.sampled == 3 * 36 and len(result.pool) == 9

    done, last = Script(), FakeClient()  # every round finished: no sampling, the last model loaded
    result, trainer = run(tmp_path, done, last, rounds=3, keep_per_problem=2)
    assert done.requests == [] and trainer.calls == [] and last.version == 100
    assert result.sft.losses == [2.0, 1.0] and len(result.pool) == 9


class Killed(Exception):
    """The process stopped while a chunk sampled."""


class KilledAt(Script):
    """Samples like ``Script`` until request ``at``, which never comes back."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    async def __call__(self, request: RolloutRequest) -> list[list[Trajectory]]:
        if len(self.requests) == self.at:
            raise Killed
        return await super().__call__(request)


def test_a_round_stopped_midway_resumes_at_its_first_unfinished_chunk(tmp_path: Path) -> None:
    whole, _ = run(tmp_path / "whole", Script(), FakeClient(), rounds=1, keep_per_problem=2, chunk_problems=2)
    expected = (tmp_path / "whole" / "ei" / "round-0" / "samples.jsonl").read_text()

    killed = KilledAt(2)  # chunks p0-p1 and p2-p3 sampled, p4-p5 not
    with pytest.raises(Killed):
        run(tmp_path, killed, FakeClient(), rounds=1, keep_per_problem=2, chunk_problems=2)
    folder = tmp_path / "ei" / "round-0"
    progress = json.loads((folder / "progress.json").read_text())
    assert (
        progress["chunks"] == 2
        and progress["report"]["sampled"] == 24
        and not (folder / "report.json").exists()
    )
    with (folder / "samples.jsonl").open("a") as fh:  # a line of the next chunk, written before the kill
        fh.write('{"problem": "p4"')

    again = Script()
    result, trainer = run(tmp_path, again, FakeClient(), rounds=1, keep_per_problem=2, chunk_problems=2)
    assert [ids for ids, _, _ in again.requests] == [["p4", "p5"]]  # the finished chunks not sampled again
    (report,), (same,) = result.rounds, whole.rounds
    assert (report.sampled, report.attempted, report.kept, report.pool) == (36, 6, 9, 9)
    assert (report.dropped, report.kept_by_category) == (same.dropped, same.kept_by_category)
    assert [e.tokens for e in result.pool] == [e.tokens for e in whole.pool]
    assert (folder / "samples.jsonl").read_text() == expected  # the half line cut, no line twice
    assert trainer.calls == [(0, 9)] and not (folder / "progress.json").exists()


def test_a_progress_that_does_not_match_the_round_samples_it_from_its_start(tmp_path: Path) -> None:
    with pytest.raises(Killed):
        run(tmp_path, KilledAt(1), FakeClient(), rounds=1, chunk_problems=2)
    again = Script()  # chunks of another size: the progress's chunk count means other problems
    result, _ = run(tmp_path, again, FakeClient(), rounds=1, chunk_problems=3)
    assert [ids for ids, _, _ in again.requests] == [["p0", "p1", "p2"], ["p3", "p4", "p5"]]
    assert result.rounds[0].sampled == 36

    with pytest.raises(Killed):
        run(tmp_path / "cut", KilledAt(1), FakeClient(), rounds=1, chunk_problems=2)
    (tmp_path / "cut" / "ei" / "round-0" / "samples.jsonl").write_text("")  # shorter than the progress says
    again = Script()
    run(tmp_path / "cut", again, FakeClient(), rounds=1, chunk_problems=2)
    assert len(again.requests) == 3


def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="max_trajectories"):
        ExpertIterationSettings(max_trajectories=0)
    with pytest.raises(ValueError, match="rounds"):
        ExpertIterationSettings(rounds=0)


class Calculator:
    """The tool: every program prints 4."""

    async def arun(self, code: str) -> ExecResult:
        return ExecResult(True, "4\n", "", 0, False, 0.0)

    def format_tool_content(self, result: ExecResult) -> str:
        return result.stdout


class BoxedVerifier:
    async def ascore(self, text: str, ref: str) -> AnswerScore:
        return score_answer(text, ref)


def test_a_kept_attempt_is_the_trace_retool_sft_data_trains_on(qwen_tokenizers: dict, tmp_path: Path) -> None:
    """Through the real environments (a scripted policy that calls the tool, then answers): the kept trace
    is token for token what ``build_trajectory`` writes for the same turns, and fits the model's protocol."""
    protocol = ChatProtocol(qwen_tokenizers["Qwen2.5-Instruct"], "hermes", system_prompt="compact")
    call, answer = protocol.fmt.render_call("print(2 + 2)"), "\\boxed{4}"

    class Scripted(FakeClient):
        async def sampling_client_async(self):  # type: ignore[no-untyped-def]
            return self

        async def sample_async(self, prompt_tokens, num_samples, params):  # type: ignore[no-untyped-def]
            seen = "tool_response" in protocol.decode(prompt_tokens)
            tokens = protocol.encode_completion(answer if seen else call)
            return [Sample(tokens, [0.0] * len(tokens), "stop") for _ in range(num_samples)]

    client = Scripted()
    config = load_config("tiny")
    parts = Components(client, protocol, BoxedVerifier(), Calculator())  # type: ignore[arg-type]
    problem = Problem("q1", "What is 2 + 2?", "4", "sums")
    result = run_expert_iteration(
        client,
        lambda r: RoundPlan.from_parts([problem], parts, config, samples=2),
        Trainer(client),
        ExpertIterationSettings(),
        out=tmp_path,
        budgets=config.rollout,
    )
    assert result.rounds[0].sampled == 2 and result.rounds[0].dropped == {"problem_full": 1}
    (kept,) = result.pool
    observation_tokens = config.rollout.max_observation_tokens
    tokens, weights, _ = build_trajectory(
        protocol, problem.question, [(call, "print(2 + 2)")], answer, lambda code: "4\n", observation_tokens
    )
    assert (kept.tokens, kept.weights) == (tokens, weights)
    assert kept.text == protocol.decode(tokens) and protocol_mismatch(kept, protocol) is None
    assert protocol_mismatch(kept, protocol.with_examples([{"role": "user", "content": "hi"}])) is not None


def test_a_long_chunk_says_how_far_it_got(caplog: pytest.LogCaptureFixture) -> None:
    """While a chunk samples, a line every ``every`` seconds with the turns and tokens sampled so far, even
    before any trajectory has finished (a chunk's groups finish together, late)."""
    from retool.backends.interface.types import Sample, SamplingParams
    from retool.train.round_chunks import ChunkTicker

    class Policy:
        async def sample_async(self, prompt: list[int], n: int, params: SamplingParams) -> list[Sample]:
            return [Sample(tokens=[1, 2, 3], logprobs=[0.0] * 3, stop_reason="stop") for _ in range(n)]

    async def run() -> None:
        ticker = ChunkTicker(Policy(), 3, every=0.01)
        reporter = asyncio.create_task(ticker.report())
        await ticker.sample_async([0], 2, SamplingParams(max_tokens=3))
        await asyncio.sleep(0.03)
        ticker(None)  # type: ignore[arg-type]  # a trajectory finished
        await asyncio.sleep(0.03)
        reporter.cancel()

    with caplog.at_level(logging.INFO, logger="retool.train.round_chunks"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert lines and lines[0].startswith(
        "expert iteration: 0/3 trajectories of this chunk finished, 2 turns (6 tokens"
    )
    assert any(line.startswith("expert iteration: 1/3 trajectories") for line in lines)
