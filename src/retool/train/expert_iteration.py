"""Expert iteration: a model's own verified, tool-using attempts as its SFT data, round after round.

One round (``run_expert_iteration``): sample ``samples`` attempts at each of the round's problems with the
current model, the tool on (``GroupRollouts``: the RL rollout's environments, budgets and scorer); keep the
verified attempts that called the tool, at most ``keep_per_problem`` a problem in the whole pool, within the
RL budgets (``budget_violation``) and never the same token sequence twice; add them to the pool; fine-tune on
the pool. Then the next round samples with the fine-tuned model, which solves more, and so on for
``rounds`` rounds. What a round samples, with which environments and how a kept attempt becomes a trace is
the caller's ``RoundPlan`` (any problem source, any model; a recipe may sample its first round under a
few-shot prompt and strip it from the traces).

Every round's SFT starts from the same weights, the model the run began with (ReST-EM, Singh et al. 2023),
rather than from the previous round's model: fine-tuning that model again on a pool holding its own
training data would fit the early rounds' traces once more each round, while from the start the SFT
model is a function of the pool alone (the same pool gives the same model, resumed or not). Sampling uses
the latest model, so the pool grows with its skill. The start is saved with the backend's ``save_state``
and loaded before each round's SFT.

Every sampled trajectory is counted, right, wrong or lost: ``max_trajectories`` stops sampling at exactly
that many (the last problem's group made smaller), then the round trains on its pool and the run ends, so
two methods can be compared at an equal number of sampled trajectories.

Files under ``out``, one folder per round (``round-N``): ``samples.jsonl`` (a line per sampled trajectory:
its problem, category, branch, whether it was right, its calls and stop reason, and ``kept`` or why not),
``kept.jsonl`` (the traces it added, ``retool.train.sft.write_examples``), ``state`` (the round's SFT
weights, what the next round samples with after a resume) and ``report.json``, written last: a round with
one is finished and is read back on resume instead of sampled again. While a round samples, ``kept.jsonl`` is
rewritten and ``progress.json`` written after each chunk of ``chunk_problems``: a round stopped midway
resumes at its first unfinished chunk (each chunk's seed is fixed by the round and the chunk), so a kill
loses one chunk's sampling, not the round's. ``start`` holds the start's weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from retool.backends.interface.clients import TrainingClient
from retool.components import Components
from retool.config import Config, RolloutConfig
from retool.data.problem import Problem
from retool.env.retool import retool_outcome
from retool.env.source import ProblemList, ProblemSource
from retool.jsonl import JsonObject, JsonValue
from retool.rollout.types import Trajectory, trajectory_tokens
from retool.train.round_chunks import (
    KEPT_FILE,
    PROGRESS_FILE,
    REPORT_FILE,
    SAMPLES_FILE,
    RoundProgress,
    read_progress,
    sample_chunk,
    write_json,
    write_kept,
    write_progress,
)
from retool.train.sampling import GroupRollouts, rollout_seed, round_seed
from retool.train.sft import SFTExample, SFTReport, budget_violation, read_examples

logger = logging.getLogger(__name__)

SAMPLED = "sampled"  # the style of a trace kept from the model's own attempt
START_STATE = "start"

ToExample = Callable[[Trajectory], SFTExample | None]


def data_source(problem: Problem) -> str:
    """The category a kept trace is counted under by default: where its problem came from."""
    return problem.data_source


def sampled_example(traj: Trajectory, decode: Callable[[list[int]], str] | None = None) -> SFTExample | None:
    """The trace of a sampled trajectory as the model saw it: its own tokens, weight 1 on what it sampled
    and 0 on the prompt and the interpreter's output (None when it sampled nothing)."""
    tokens, _, sampled = trajectory_tokens(traj)
    if not any(sampled):
        return None
    weights = [1.0 if s else 0.0 for s in sampled]
    return SFTExample(traj.problem, SAMPLED, tokens, weights, decode(tokens) if decode is not None else "")


@dataclass(frozen=True)
class RoundPlan:
    """What one round samples: ``samples`` attempts at each of ``problems`` through ``sampler`` (its
    environments, budgets and sampling settings); ``to_example`` turns a kept attempt into a trace (None:
    it cannot be one)."""

    problems: Sequence[Problem]
    sampler: GroupRollouts
    samples: int
    to_example: ToExample = sampled_example

    @classmethod
    def from_parts(
        cls,
        problems: Sequence[Problem],
        parts: Components,
        config: Config,
        *,
        samples: int,
        source: ProblemSource | None = None,
    ) -> RoundPlan:
        """The round with ``parts``' ReTool environments (the tool on) and ``config``'s budgets and sampling,
        ``problems`` scored by ``source``'s rule (default: the verifier's check); traces are the sampled
        tokens, decoded with ``parts.protocol``."""
        source = source if source is not None else ProblemList(problems, shuffle=False)
        sampler = GroupRollouts.from_parts(source, parts, config)
        decode = parts.protocol.decode
        return cls(problems, sampler, samples, lambda traj: sampled_example(traj, decode))


@dataclass(frozen=True)
class ExpertIterationSettings:
    """``rounds`` of sample -> keep -> SFT; ``keep_per_problem``: verified attempts a problem adds to the
    pool at most; ``max_trajectories``: sampled trajectories in all (None: no limit); ``seed``: the
    sampling seeds; ``chunk_problems``: problems rolled out together (a progress line each)."""

    rounds: int = 1
    keep_per_problem: int = 1
    max_trajectories: int | None = None
    seed: int = 0
    chunk_problems: int = 256

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.keep_per_problem < 1 or self.chunk_problems < 1:
            raise ValueError("expert iteration needs rounds, keep_per_problem and chunk_problems >= 1")
        if self.max_trajectories is not None and self.max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1 (None: no limit), got {self.max_trajectories}")


@dataclass
class RoundReport:
    """What one round did: its problems, how many it sampled attempts at (``attempted``), the sampled
    trajectories, the right ones, the traces kept (by category) and why the others were not, the pool after
    it, its SFT and the seconds each part took; ``budget_spent``: sampling stopped at ``max_trajectories``."""

    round: int
    problems: int
    attempted: int = 0
    sampled: int = 0
    correct: int = 0
    kept: int = 0
    pool: int = 0
    kept_by_category: dict[str, int] = field(default_factory=dict)
    correct_by_category: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    sample_seconds: float = 0.0
    sft_seconds: float = 0.0
    sft: JsonObject = field(default_factory=dict)
    state: str | None = None
    budget_spent: bool = False

    @property
    def pass_rate(self) -> float:
        return self.correct / self.sampled if self.sampled else 0.0

    def as_dict(self) -> JsonObject:
        record: JsonObject = json.loads(json.dumps(dataclasses.asdict(self)))
        return {**record, "pass_rate": self.pass_rate}

    @classmethod
    def from_dict(cls, record: JsonObject) -> RoundReport:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})  # type: ignore[arg-type]


@dataclass
class ExpertIterationResult:
    """Every round's report, the final pool, and the SFT of the last round (the weights the client holds)."""

    rounds: list[RoundReport]
    pool: list[SFTExample]
    sft: SFTReport

    @property
    def sampled(self) -> int:
        return sum(r.sampled for r in self.rounds)

    def as_dict(self) -> JsonObject:
        return {
            "rounds": [r.as_dict() for r in self.rounds],
            "sampled": self.sampled,
            "correct": sum(r.correct for r in self.rounds),
            "pool": len(self.pool),
        }


class _Pool:
    """The traces kept so far: at most ``cap`` per problem (after the ``initial`` ones), no token sequence
    twice."""

    def __init__(self, cap: int, initial: Sequence[SFTExample]) -> None:
        self.cap = cap
        self.examples: list[SFTExample] = []
        self._seen: set[tuple[int, ...]] = set()
        self._per_problem: Counter[str] = Counter()
        for example in initial:
            if self.refusal(example) != "duplicate":
                self.add(example)

    def full(self, problem: Problem) -> bool:
        return self._per_problem[problem.id] >= self.cap

    def refusal(self, example: SFTExample) -> str | None:
        if tuple(example.tokens) in self._seen:
            return "duplicate"
        return "problem_full" if self._per_problem[example.task.id] >= self.cap else None

    def add(self, example: SFTExample) -> None:
        self.examples.append(example)
        self._seen.add(tuple(example.tokens))
        self._per_problem[example.task.id] += 1


@dataclass
class _Round:
    """One round's sampling in progress: its report, the traces it kept, the sample lines' file."""

    report: RoundReport
    samples: IO[str]
    kept: list[SFTExample] = field(default_factory=list)
    attempted: set[str] = field(default_factory=set)
    chunks: int = 0  # chunks of ``chunk_problems`` sampled and judged


class _RoundFiles:
    """Round ``r``'s sampling state, opened on its folder: fresh, or (``round_files.read_progress``) as its
    finished chunks left it, their kept traces back in the pool; the sample lines' file closed at exit."""

    def __init__(
        self, folder: Path, r: int, plan: RoundPlan, keeper: _Pool, settings: ExpertIterationSettings
    ) -> None:
        self.folder, self.r, self.plan, self.keeper, self.settings = folder, r, plan, keeper, settings

    def __enter__(self) -> _Round:
        problems = len(self.plan.problems)
        progress = read_progress(self.folder, self.settings.chunk_problems, problems)
        samples = (self.folder / SAMPLES_FILE).open("a" if progress else "w", encoding="utf-8")
        self.state = _Round(RoundReport(round=self.r, problems=problems), samples)
        if progress is not None:
            self.state.report = RoundReport.from_dict(progress.report)
            self.state.kept, self.state.attempted, self.state.chunks = (
                progress.kept,
                progress.attempted,
                progress.chunks,
            )
            for example in progress.kept:
                self.keeper.add(example)
            logger.info(
                "expert iteration round %d: resumed after %d chunks (%d trajectories, %d kept)",
                self.r,
                progress.chunks,
                self.state.report.sampled,
                len(progress.kept),
            )
        return self.state

    def __exit__(self, *exc: object) -> None:
        self.state.samples.close()


def run_expert_iteration(
    client: TrainingClient,
    plan: Callable[[int], RoundPlan],
    train: Callable[[Sequence[SFTExample]], SFTReport],
    settings: ExpertIterationSettings,
    *,
    out: Path,
    budgets: RolloutConfig,
    category: Callable[[Problem], str] = data_source,
    pool: Sequence[SFTExample] = (),
    on_round: Callable[[RoundReport], None] | None = None,
) -> ExpertIterationResult:
    """``settings.rounds`` rounds of expert iteration (module docstring) on ``client``, which holds the start
    model when called and the last round's SFT model on return.

    ``plan(r)``: what round ``r`` samples; ``train(pool)``: fine-tunes ``client`` on the pool (the caller's
    SFT settings); ``budgets``: the RL budgets a kept trace must fit; ``category(problem)``: the name a kept
    trace is counted under; ``pool``: traces the pool starts with; ``on_round``: hears each round's report
    (finished or read back). Finished rounds under ``out`` are read back, not sampled again.
    """
    out.mkdir(parents=True, exist_ok=True)
    keeper = _Pool(settings.keep_per_problem, pool)
    weights = _Weights(client, out, train)
    reports: list[RoundReport] = []
    sft: SFTReport | None = None
    for r in range(settings.rounds):
        done = _read_round(out / f"round-{r}")
        if done is not None:
            reports.append(done[0])
            for example in done[1]:
                keeper.add(example)
        else:
            if weights.start is None and settings.rounds > 1:
                weights.save_start()
            round_plan = plan(r)
            if reports and not round_plan.problems:
                logger.info("expert iteration: no problems left for round %d; stopping", r)
                break  # the source is spent: another round would only fine-tune on the same pool again
            if reports:
                weights.hold(reports[-1], keeper.examples)
            report, sft = _run_round(
                r, round_plan, keeper, weights, settings, reports, budgets, category, out
            )
            reports.append(report)
        if on_round is not None:
            on_round(reports[-1])
        if reports[-1].budget_spent:
            break
    if sft is None:  # every round was read back: the last one's model
        weights.hold(reports[-1], keeper.examples)
        sft = sft_report_of(reports[-1])
    return ExpertIterationResult(reports, keeper.examples, sft)


class _Weights:
    """Which weights ``client`` holds: the start (-1) or round r's SFT model (r); how to get them back."""

    def __init__(
        self, client: TrainingClient, out: Path, train: Callable[[Sequence[SFTExample]], SFTReport]
    ) -> None:
        self.client, self.out, self.train = client, out, train
        self.start: str | None = None
        self.holds = -1

    def save_start(self) -> None:
        self.start = self.client.save_state(str((self.out / START_STATE).resolve()))

    def to_start(self) -> None:
        if self.holds != -1:
            if self.start is None:
                raise RuntimeError("expert iteration: the start's weights were not saved")
            self.client.load_state(self.start)
            self.holds = -1

    def fine_tune(self, round_index: int, pool: Sequence[SFTExample]) -> tuple[SFTReport, str]:
        """SFT on ``pool`` from the start; the weights saved as round ``round_index``'s."""
        self.to_start()
        report = self.train(pool)
        state = self.client.save_state(str((self.out / f"round-{round_index}" / "state").resolve()))
        self.holds = round_index
        return report, state

    def hold(self, report: RoundReport, pool: Sequence[SFTExample]) -> None:
        """Round ``report.round``'s SFT model: its saved weights, or (gone) trained again on its pool."""
        if self.holds == report.round:
            return
        if report.state is not None and Path(report.state).exists():
            self.client.load_state(report.state)
            self.holds = report.round
            return
        logger.warning("expert iteration: round %d's weights are gone; training them again", report.round)
        self.fine_tune(report.round, pool[: report.pool])  # the pool as that round left it


def sft_report_of(report: RoundReport) -> SFTReport:
    """The SFT report a round recorded (its losses included)."""
    sft = report.sft
    losses = sft.get("losses", [])
    styles = sft.get("styles", {})
    return SFTReport(
        steps=_int(sft.get("steps", 0)),
        examples=_int(sft.get("examples", 0)),
        losses=[float(x) for x in losses if isinstance(x, int | float)] if isinstance(losses, list) else [],
        seconds=_float(sft.get("seconds", 0.0)),
        styles={k: _int(v) for k, v in styles.items()} if isinstance(styles, dict) else {},
    )


def _int(value: JsonValue) -> int:
    return int(value) if isinstance(value, int | float) else 0


def _float(value: JsonValue) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _read_round(folder: Path) -> tuple[RoundReport, list[SFTExample]] | None:
    """A finished round's report and kept traces (None: not finished)."""
    path = folder / REPORT_FILE
    if not path.is_file():
        return None
    report = RoundReport.from_dict(json.loads(path.read_text(encoding="utf-8")))
    kept = read_examples(folder / KEPT_FILE) if (folder / KEPT_FILE).stat().st_size else []
    logger.info("expert iteration round %d: finished earlier, read back (%d kept)", report.round, len(kept))
    return report, kept


def _run_round(
    r: int,
    plan: RoundPlan,
    keeper: _Pool,
    weights: _Weights,
    settings: ExpertIterationSettings,
    earlier: Sequence[RoundReport],
    budgets: RolloutConfig,
    category: Callable[[Problem], str],
    out: Path,
) -> tuple[RoundReport, SFTReport]:
    """Sample round ``r``, keep, fine-tune on the pool from the start, write its files (the report last)."""
    folder = out / f"round-{r}"
    folder.mkdir(parents=True, exist_ok=True)
    left = (
        None
        if settings.max_trajectories is None
        else settings.max_trajectories - sum(e.sampled for e in earlier)
    )
    start = time.perf_counter()
    with _RoundFiles(folder, r, plan, keeper, settings) as state:
        earlier_seconds = state.report.sample_seconds

        def save_progress() -> None:
            state.report.sample_seconds = earlier_seconds + time.perf_counter() - start
            progress = RoundProgress(state.chunks, state.report.as_dict(), state.kept, state.attempted)
            write_progress(folder, progress, state.samples, settings.chunk_problems)

        asyncio.run(
            _sample_round(
                weights.client, plan, state, keeper, settings, left, budgets, category, save_progress
            )
        )
    report = state.report
    report.attempted, report.kept, report.pool = len(state.attempted), len(state.kept), len(keeper.examples)
    report.budget_spent = left is not None and report.sampled >= left
    report.sample_seconds = earlier_seconds + time.perf_counter() - start
    write_kept(state.kept, folder / KEPT_FILE)
    if not keeper.examples:
        raise ValueError(
            f"expert iteration round {r}: none of {report.sampled} sampled attempts was kept "
            f"({report.correct} right; dropped: {report.dropped}) and the pool is empty: nothing to train on"
        )
    start = time.perf_counter()
    sft, report.state = weights.fine_tune(r, keeper.examples)
    report.sft_seconds = time.perf_counter() - start
    report.sft = {**sft.as_dict(), "losses": list(sft.losses)}
    write_json(folder / REPORT_FILE, report.as_dict())
    (folder / PROGRESS_FILE).unlink(missing_ok=True)
    _drop_earlier_state(earlier, out)
    logger.info(
        "expert iteration round %d: %d trajectories, pass rate %.1f%%, %d kept (pool %d), %.0fs sampling, "
        "%.0fs SFT",
        r,
        report.sampled,
        100 * report.pass_rate,
        report.kept,
        report.pool,
        report.sample_seconds,
        report.sft_seconds,
    )
    return report, sft


def _drop_earlier_state(earlier: Sequence[RoundReport], out: Path) -> None:
    """The previous round's saved weights, once a later round's are saved (a resume needs the last only)."""
    if earlier and earlier[-1].state is not None:
        folder = Path(earlier[-1].state)
        if folder.is_dir() and folder.resolve().is_relative_to(out.resolve()):
            shutil.rmtree(folder)


async def _sample_round(
    client: TrainingClient,
    plan: RoundPlan,
    state: _Round,
    keeper: _Pool,
    settings: ExpertIterationSettings,
    left: int | None,
    budgets: RolloutConfig,
    category: Callable[[Problem], str],
    on_chunk: Callable[[], None],
) -> None:
    """The round's attempts, ``settings.chunk_problems`` problems at a time from its first unfinished chunk,
    until its problems or the trajectory budget ``left`` run out; each group judged as it comes back,
    ``on_chunk`` told after each chunk."""
    policy = await client.sampling_client_async()
    problems, size = list(plan.problems), plan.samples
    base = rollout_seed(settings.seed, state.report.round)
    start, resumed_at = time.perf_counter(), state.chunks * settings.chunk_problems
    for chunk, first in enumerate(range(0, len(problems), settings.chunk_problems)):
        if chunk < state.chunks:
            continue
        todo = problems[first : first + settings.chunk_problems]
        room = None if left is None else left - state.report.sampled
        if room is not None and room <= 0:
            break
        groups = await sample_chunk(plan.sampler, policy, todo, size, room, round_seed(base, chunk))
        for group in groups:
            _judge(group, plan.to_example, state, keeper, budgets, category)
        state.chunks = chunk + 1
        on_chunk()
        done = min(first + len(todo), len(problems))
        rate = (time.perf_counter() - start) / (done - resumed_at)
        logger.info(
            "expert iteration round %d: %d/%d problems, %d trajectories, %d right, %d kept, ETA %.0fs",
            state.report.round,
            done,
            len(problems),
            state.report.sampled,
            state.report.correct,
            len(state.kept),
            rate * (len(problems) - done),
        )


def _judge(
    group: Sequence[Trajectory],
    to_example: ToExample,
    state: _Round,
    keeper: _Pool,
    budgets: RolloutConfig,
    category: Callable[[Problem], str],
) -> None:
    """Count a problem's attempts; keep the verified, tool-using ones the pool takes, in branch order."""
    report = state.report
    for traj in sorted(group, key=lambda t: t.group_index):
        outcome = retool_outcome(traj.outcome)
        name = category(traj.problem)
        report.sampled += 1
        state.attempted.add(traj.problem.id)
        verdict = _verdict(traj, to_example, keeper, budgets)
        if outcome.correct:
            report.correct += 1
            report.correct_by_category[name] = report.correct_by_category.get(name, 0) + 1
        if isinstance(verdict, SFTExample):
            keeper.add(verdict)
            state.kept.append(verdict)
            report.kept_by_category[name] = report.kept_by_category.get(name, 0) + 1
        else:
            report.dropped[verdict] = report.dropped.get(verdict, 0) + 1
        line = {
            "problem": traj.problem.id,
            "category": name,
            "branch": traj.group_index,
            "correct": outcome.correct,
            "code_calls": outcome.code_calls,
            "stop_reason": outcome.stop_reason,
            "verdict": "kept" if isinstance(verdict, SFTExample) else verdict,
        }
        state.samples.write(json.dumps(line, ensure_ascii=False) + "\n")


def _verdict(
    traj: Trajectory, to_example: ToExample, keeper: _Pool, budgets: RolloutConfig
) -> SFTExample | str:
    """The trace to keep, or why not: wrong, no call, the problem's share taken, not a trace, over the RL
    budgets, already in the pool."""
    outcome = retool_outcome(traj.outcome)
    if not outcome.correct:
        return "wrong"
    if outcome.code_calls < 1:
        return "no_call"
    if keeper.full(traj.problem):
        return "problem_full"
    example = to_example(traj)
    if example is None:
        return "not_a_trace"
    if budget_violation(example, budgets) is not None:
        return "over_budget"
    return keeper.refusal(example) or example
