"""The mathematics recipe's task (``retool demo --recipe mathematics``): ReTool's two stages on DeepMind
Mathematics, a benchmark this project did not write.

Owns what differs from the other tasks, and nothing of the pipeline itself (``retool.pipeline.run``):

- the problem source RL trains on: the generated train split (``retool.env.mathematics``), checked against
  both test splits (``strict``: a leak stops the run);
- the held-out problems: the first ``per_module`` questions of every module of the interpolate and the
  extrapolate split (the files are seeded, so the slice is fixed), scored by the benchmark's checker;
- the cold start, ReTool's way for a dataset without worked solutions: the model's *own* code-integrated
  attempts on seeded train rows, sampled under a few-shot prompt (``FEW_SHOT``: six generic worked
  examples, written once for every module, none from the benchmark, their outputs the sandbox's real ones),
  kept only when the answer verifies and the attempt called the interpreter, then re-tokenised *without* the
  few-shot turns so the SFT model learns to do it from the plain prompt. No per-module solution template
  exists anywhere. Samples, kept trajectories and the yield per module are written to ``<out>/coldstart/``
  and read back when a run is resumed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from retool.components import Components
from retool.config import Config
from retool.data.mathematics import TEST_SPLITS, module_of, read_split
from retool.data.problem import Problem
from retool.env.mathematics import MathematicsList, MathematicsSource
from retool.jsonl import JsonObject
from retool.protocol import ChatProtocol
from retool.protocol.chat import Message
from retool.rollout.types import Trajectory
from retool.train.expert_iteration import (
    ExpertIterationResult,
    ExpertIterationSettings,
    RoundPlan,
    RoundReport,
    run_expert_iteration,
)
from retool.train.sampling import GroupRollouts
from retool.train.sft import SFTExample, SFTReport, write_examples
from retool.train.trace import answer_text, build_trajectory

logger = logging.getLogger(__name__)

TASK = "mathematics"
COLDSTART_DIR = "coldstart"

# The few-shot turns of the cold start's sampling prompt: (question, code). Generic on purpose, written once
# for every module and none taken from the benchmark: short code that copies the question's expression into
# sympy (exact arithmetic, solving, a yes/no property, a function's value, a derivative, a polynomial); the
# answer is what the code prints.
FEW_SHOT: tuple[tuple[str, str], ...] = (
    ("What is 3/4 - 2*(5 - 7)/6?", 'from sympy import *\nprint(S("3/4 - 2*(5 - 7)/6"))'),
    (
        "Solve 4*k - 7 = 2*k + 5 for k.",
        'from sympy import *\nk = Symbol("k")\nprint(solve(Eq(4*k - 7, 2*k + 5), k))',
    ),
    ("Is 221 a prime number?", "from sympy import *\nprint(isprime(221))"),
    (
        "Let g(n) = n**2 - 3*n + 1. What is g(-4)?",
        'from sympy import *\nn = Symbol("n")\ng = n**2 - 3*n + 1\nprint(g.subs(n, -4))',
    ),
    (
        "Differentiate 5*w**3 - 2*w + 8 with respect to w.",
        'from sympy import *\nw = Symbol("w")\nprint(diff(5*w**3 - 2*w + 8, w))',
    ),
    ("Expand (2*t + 1)*(t - 3).", 'from sympy import *\nt = Symbol("t")\nprint(expand((2*t + 1)*(t - 3)))'),
)


def mathematics_source(config: Config, data_dir: str | Path | None = None) -> MathematicsSource:
    """The generated train split to train on (in ``data_dir``, else ``data.data_dir``), refusing to start if
    any train question is a test question."""
    folder = data_dir if data_dir is not None else config.data.data_dir
    return MathematicsSource(folder, shuffle=config.data.shuffle, strict=True)


def held_out_problems(per_module: int, data_dir: str | Path | None) -> list[Problem]:
    """The first ``per_module`` questions of every module of the interpolate split, then the extrapolate
    split (every module has them: the files hold a fixed seeded sample)."""
    out: list[Problem] = []
    for split in TEST_SPLITS:
        taken: Counter[str] = Counter()
        for p in read_split(split, data_dir):
            if taken[module_of(p)] < per_module:
                taken[module_of(p)] += 1
                out.append(p)
    return out


def coldstart_problems(
    source: MathematicsSource,
    per_module: int,
    seed: int,
    *,
    round_index: int = 0,
    exclude: Collection[str] = frozenset(),
) -> list[Problem]:
    """``per_module`` train problems of every module, drawn with ``seed`` (and, after the first round, the
    round's index), none of the ids in ``exclude`` (the earlier rounds' problems)."""
    by_module: dict[str, list[Problem]] = defaultdict(list)
    for p in source.problems("train"):
        if p.id not in exclude:
            by_module[module_of(p)].append(p)
    rng = random.Random(
        f"retool-mathematics-coldstart/{seed}" + (f"/round-{round_index}" if round_index else "")
    )
    picked: list[Problem] = []
    for module in sorted(by_module):
        rows = by_module[module]
        picked += rng.sample(rows, min(per_module, len(rows)))
    return picked


def few_shot_messages(protocol: ChatProtocol, observe: dict[str, str]) -> list[Message]:
    """``FEW_SHOT`` as chat turns in ``protocol``'s call format, each call's output from ``observe``."""
    messages: list[Message] = []
    for question, code in FEW_SHOT:
        output = observe[code]
        answer = output.strip().strip("[]")
        messages += [
            {"role": "user", "content": question},
            protocol.assistant_message(protocol.fmt.render_call(code)),
            protocol.tool_message(output),
            protocol.assistant_message(answer_text(answer)),
        ]
    return messages


def observation_text(message: Message) -> str:
    """The interpreter's output inside an observation message (either call format)."""
    text = str(message.get("content", ""))
    if text.startswith("<interpreter>"):
        text = text.removeprefix("<interpreter>").removesuffix("</interpreter>").strip("\n")
    return text


def trajectory_example(
    protocol: ChatProtocol,
    problem: Problem,
    messages: Sequence[Message],
    skip: int,
    max_observation_tokens: int,
) -> SFTExample | None:
    """A sampled transcript (``messages``; its first ``skip`` are the system prompt and the few-shot turns)
    re-tokenised with ``protocol``: the same assistant turns and observations after the plain prompt."""
    turns = [dict(m) for m in messages[skip + 1 :]]  # after the question
    if not turns or turns[-1].get("role") != "assistant":
        return None
    observations: list[str] = []
    calls: list[tuple[str, str]] = []
    for i in range(0, len(turns) - 1, 2):
        assistant, tool = turns[i], turns[i + 1]
        if assistant.get("role") != "assistant" or tool.get("role") not in ("user", "tool"):
            return None
        observations.append(observation_text(tool))
        calls.append((str(assistant["content"]), str(len(calls))))
    if not calls:
        return None
    tokens, weights, _ = build_trajectory(
        protocol,
        problem.question,
        calls,
        str(turns[-1]["content"]),
        lambda index: observations[int(index)],
        max_observation_tokens,
    )
    return SFTExample(problem, "tool", tokens, weights)


def _coldstart_config(config: Config, temperature: float, prompt_tokens: int = 0) -> Config:
    """The sampling config of a cold-start round: its temperature, and the trajectory budget raised by the
    few-shot turns' length (they sit in the context; the kept trajectories are checked without them)."""
    sampling = config.sampling.model_copy(update={"temperature": temperature})
    budget = config.rollout.max_trajectory_tokens + prompt_tokens
    rollout = config.rollout.model_copy(update={"max_trajectory_tokens": budget})
    return config.model_copy(update={"sampling": sampling, "rollout": rollout})


@dataclass(frozen=True)
class ColdStart:
    """The cold start's sizes. Round 0: ``samples`` attempts at ``temperature`` on ``per_module`` train
    problems of every module, under the few-shot prompt. Each further round (``rounds`` in all): the SFT
    model's own attempts without it, ``round_samples`` at ``round_temperature`` on ``round_per_module``
    other problems of every module. At most ``keep`` verified attempts a problem; sampling stops after
    ``max_trajectories`` trajectories in all (None: no limit)."""

    per_module: int
    samples: int = 1
    temperature: float = 0.0
    rounds: int = 1
    round_per_module: int = 16
    round_samples: int = 4
    round_temperature: float = 0.7
    keep: int = 1
    max_trajectories: int | None = None


def coldstart_chunk(sample_batch_size: int, samples: int) -> int:
    """Problems a cold-start round rolls out together: about two sampler batches of trajectories in flight.
    The local sampler queues every turn it is given; with far more trajectories in flight than it batches,
    a trajectory's next turn waits behind all the others and its context drops out of the prefix cache,
    so each turn prefills its whole context again (RL's steps, a few batches each, sample several times
    faster on the same model)."""
    return max(1, (2 * sample_batch_size) // max(1, samples))


class _RoundProblems:
    """Each round's problems, drawn once: round 0 under ``cold.per_module``, later rounds under
    ``cold.round_per_module`` among the problems no earlier round drew."""

    def __init__(self, source: MathematicsSource, cold: ColdStart, seed: int) -> None:
        self.source, self.cold, self.seed = source, cold, seed
        self.rounds: list[list[Problem]] = []

    def __call__(self, round_index: int) -> list[Problem]:
        while len(self.rounds) <= round_index:
            r = len(self.rounds)
            per_module = self.cold.per_module if r == 0 else self.cold.round_per_module
            drawn = {p.id for problems in self.rounds for p in problems}
            self.rounds.append(
                coldstart_problems(self.source, per_module, self.seed, round_index=r, exclude=drawn)
            )
        return self.rounds[round_index]


def _few_shot_round(parts: Components, config: Config, cold: ColdStart, problems: list[Problem]) -> RoundPlan:
    """Round 0: the base model's attempts under the few-shot prompt, kept re-tokenised without it."""
    assert parts.executor is not None, "the few-shot outputs and the attempts' calls run in the sandbox"
    outputs = {code: parts.executor.format_tool_content(parts.executor.run(code)) for _, code in FEW_SHOT}
    shots = few_shot_messages(parts.protocol, outputs)
    prompted = dataclasses.replace(parts, protocol=parts.protocol.with_examples(shots))
    extra = len(prompted.protocol.build_prompt(prompted.protocol.initial_messages(""))) - len(
        parts.protocol.build_prompt(parts.protocol.initial_messages(""))
    )
    source = MathematicsList(problems, shuffle=False, name="mathematics-coldstart")
    sampler = GroupRollouts.from_parts(source, prompted, _coldstart_config(config, cold.temperature, extra))
    skip, observation_tokens = 1 + len(shots), config.rollout.max_observation_tokens

    def plain(traj: Trajectory) -> SFTExample | None:
        return trajectory_example(
            parts.protocol, traj.problem, traj.outcome.messages, skip, observation_tokens
        )

    return RoundPlan(problems, sampler, cold.samples, plain)


def coldstart_expert_iteration(
    parts: Components,
    config: Config,
    cold: ColdStart,
    *,
    out: Path,
    train: Callable[[Sequence[SFTExample]], SFTReport],
    data_dir: str | Path | None = None,
    on_round: Callable[[RoundReport], None] | None = None,
) -> ExpertIterationResult:
    """The cold start: round 0 under the few-shot prompt, then ``cold.rounds - 1`` rounds of expert
    iteration (``retool.train.expert_iteration``), each fine-tuning ``parts.backend`` with ``train`` on the
    pool from the start. Rounds are kept in ``out/coldstart/round-N`` (a finished round is read back); the
    pool goes to ``out/coldstart/train.jsonl``, the summary to ``report.json``."""
    folder = out / COLDSTART_DIR
    problems = _RoundProblems(mathematics_source(config, data_dir), cold, config.train.seed)

    def plan(round_index: int) -> RoundPlan:
        if round_index == 0:
            return _few_shot_round(parts, config, cold, problems(0))
        source = MathematicsList(problems(round_index), shuffle=False, name="mathematics-coldstart")
        sampling = _coldstart_config(config, cold.round_temperature)
        return RoundPlan.from_parts(
            problems(round_index), parts, sampling, samples=cold.round_samples, source=source
        )

    settings = ExpertIterationSettings(
        rounds=cold.rounds,
        keep_per_problem=cold.keep,
        max_trajectories=cold.max_trajectories,
        seed=config.train.seed,
        chunk_problems=coldstart_chunk(
            config.backend.sample_batch_size, max(cold.samples, cold.round_samples)
        ),
    )
    result = run_expert_iteration(
        parts.backend,
        plan,
        train,
        settings,
        out=folder,
        budgets=config.rollout,
        category=module_of,
        on_round=on_round,
    )
    write_examples(result.pool, folder / "train.jsonl")
    (folder / "report.json").write_text(
        json.dumps(coldstart_summary(result), indent=2) + "\n", encoding="utf-8"
    )
    logger.info("mathematics cold start: %d traces kept of %d sampled", len(result.pool), result.sampled)
    return result


def coldstart_summary(result: ExpertIterationResult) -> JsonObject:
    """The cold start's counts over its rounds (problems, sampled, right, kept, kept by module, dropped) and
    each round's own report."""
    kept_by_module: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    for r in result.rounds:
        kept_by_module.update(r.kept_by_category)
        dropped.update(r.dropped)
    return {
        "problems": sum(r.problems for r in result.rounds),
        "sampled": result.sampled,
        "correct": sum(r.correct for r in result.rounds),
        "kept": len(result.pool),
        "dropped": dict(sorted(dropped.items())),
        "kept_by_module": dict(sorted(kept_by_module.items())),
        "modules_kept": len(kept_by_module),
        "few_shot": [q for q, _ in FEW_SHOT],
        "rounds": [_without_losses(r.as_dict()) for r in result.rounds],
    }


def _without_losses(round_report: JsonObject) -> JsonObject:
    """A round's report without its SFT loss curve (``round-N/report.json`` keeps it)."""
    sft = round_report.get("sft")
    if not isinstance(sft, dict):
        return round_report
    return {**round_report, "sft": {k: v for k, v in sft.items() if k != "losses"}}
