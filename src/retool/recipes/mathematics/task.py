"""The mathematics recipe's task (``retool demo --recipe mathematics``): ReTool's two stages on DeepMind
Mathematics, a benchmark this project did not write.

Owns what differs from the other tasks, and nothing of the pipeline itself (``retool.tasks.pipeline``):

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

import asyncio
import dataclasses
import json
import logging
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from retool.components import Components
from retool.config import Config
from retool.data.mathematics import TEST_SPLITS, module_of, read_split
from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.env.mathematics import MathematicsList, MathematicsSource
from retool.evaluate.runner import run_eval
from retool.evaluate.store import read_problem_records
from retool.jsonl import JsonObject
from retool.protocol import ChatProtocol
from retool.protocol.chat import Message
from retool.tasks.coldstart import budget_violation, read_examples, write_examples
from retool.tasks.sft import SFTExample, answer_text, build_trajectory

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


def coldstart_problems(source: MathematicsSource, per_module: int, seed: int) -> list[Problem]:
    """``per_module`` train problems of every module, drawn with ``seed``."""
    by_module: dict[str, list[Problem]] = defaultdict(list)
    for p in source.problems("train"):
        by_module[module_of(p)].append(p)
    rng = random.Random(f"retool-mathematics-coldstart/{seed}")
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


async def _sample(
    parts: Components, config: Config, problems: Sequence[Problem], samples: int, output: Path
) -> None:
    view = parts.for_mode(True)
    await view.refresh_sampler()
    await run_eval(
        list(problems),
        view,
        config=config,
        mode="retool",
        output=output,
        val_n=samples,
        seed=config.train.seed,
        identity={"model": "coldstart", "checkpoint": "base", "dataset": "mathematics train"},
        concurrency=len(problems),
        save_transcripts=True,
        source=MathematicsList(problems, shuffle=False, name="mathematics-coldstart"),
        bootstrap_resamples=10,  # the cold start reads its records, not their interval
    )


def _coldstart_config(config: Config, temperature: float, prompt_tokens: int) -> Config:
    """The sampling config of the cold start: its temperature, and the trajectory budget raised by the
    few-shot turns' length (they sit in the context; the kept trajectories are checked without them)."""
    sampling = config.sampling.model_copy(update={"temperature": temperature})
    budget = config.rollout.max_trajectory_tokens + prompt_tokens
    rollout = config.rollout.model_copy(update={"max_trajectory_tokens": budget})
    return config.model_copy(update={"sampling": sampling, "rollout": rollout})


def coldstart_examples(
    parts: Components,
    config: Config,
    *,
    per_module: int,
    samples: int,
    temperature: float,
    out: Path,
    data_dir: str | Path | None = None,
) -> tuple[list[SFTExample], JsonObject]:
    """The cold-start trajectories: ``samples`` attempts at ``temperature`` on ``per_module`` seeded train
    problems of every module, under the few-shot prompt; one verified, interpreter-using attempt kept per
    problem, re-tokenised with the plain prompt. Cached in ``out/coldstart/`` (samples resumable)."""
    folder = out / COLDSTART_DIR
    kept_file, report_file = folder / "train.jsonl", folder / "report.json"
    if kept_file.is_file() and report_file.is_file():
        return read_examples(kept_file), json.loads(report_file.read_text(encoding="utf-8"))
    assert parts.executor is not None, "the few-shot outputs and the attempts' calls run in the sandbox"
    folder.mkdir(parents=True, exist_ok=True)
    problems = coldstart_problems(mathematics_source(config, data_dir), per_module, config.train.seed)
    outputs = {code: parts.executor.format_tool_content(parts.executor.run(code)) for _, code in FEW_SHOT}
    shots = few_shot_messages(parts.protocol, outputs)
    prompted = dataclasses.replace(parts, protocol=parts.protocol.with_examples(shots))
    samples_file = folder / "samples.jsonl"
    extra = len(prompted.protocol.build_prompt(prompted.protocol.initial_messages(""))) - len(
        parts.protocol.build_prompt(parts.protocol.initial_messages(""))
    )
    sampling = _coldstart_config(config, temperature, extra)
    asyncio.run(_sample(prompted, sampling, problems, samples, samples_file))
    examples, report = _keep_verified(parts.protocol, config, problems, samples_file, skip=1 + len(shots))
    if not examples:
        raise DataError(f"the mathematics cold start kept none of {report['sampled']} samples: {report}")
    write_examples(examples, folder / "train.partial")
    (folder / "train.partial").replace(kept_file)
    report_file.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    logger.info("mathematics cold start: %d of %d problems kept", len(examples), len(problems))
    return examples, report


def _keep_verified(
    protocol: ChatProtocol, config: Config, problems: Sequence[Problem], samples_file: Path, skip: int
) -> tuple[list[SFTExample], JsonObject]:
    """One verified, interpreter-using attempt per problem (the first in sample order), within the RL
    budgets; the counts by module and by reason."""
    by_id = {p.id: p for p in problems}
    examples: list[SFTExample] = []
    sampled = correct = 0
    dropped: Counter[str] = Counter()
    kept_by_module: Counter[str] = Counter()
    for record in read_problem_records(samples_file):
        problem = by_id[str(record["id"])]
        candidates = record.get("candidates", [])
        sampled += len(candidates)
        correct += sum(bool(c["correct"]) for c in candidates)
        example = None
        for cand in candidates:
            if not cand["correct"]:
                continue
            if int(cand["code_calls"]) < 1:
                dropped["correct without a call"] += 1
                continue
            example = trajectory_example(
                protocol, problem, cand.get("messages", []), skip, config.rollout.max_observation_tokens
            )
            why = (
                budget_violation(example, config.rollout) if example is not None else "unreadable transcript"
            )
            if why is None:
                break
            dropped[why.split(" ")[-2] if example is not None else why] += 1
            example = None
        if example is not None:
            examples.append(example)
            kept_by_module[module_of(problem)] += 1
    report: JsonObject = {
        "problems": len(problems),
        "sampled": sampled,
        "correct": correct,
        "kept": len(examples),
        "dropped": dict(dropped),
        "kept_by_module": dict(sorted(kept_by_module.items())),
        "few_shot": [q for q, _ in FEW_SHOT],
    }
    return examples, report
