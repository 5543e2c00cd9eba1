"""Code-integrated cold-start data from annotated solutions (``retool data coldstart``).

Each solution (GSM8K's ``48/2 = <<48/2=24>>24``, parsed by ``retool.data.annotated``) becomes one tool
trajectory in the model's own call format: the reasoning text up to an annotation and a call whose code
is the annotation's expression, the REAL sandbox output as the observation, the text after it, and so on;
the last turn is the rest of the reasoning and ``\\boxed{answer}``. Built with ``retool.train.trace``'s
``build_trajectory`` (the rollout's own token bookkeeping), so the sequences are what the SFT stage trains
on (``retool.train.sft.SFTExample``, written with its ``write_examples``) and token-exact. A row is kept only if every observation matches its annotation's result
and the final answer verifies against the reference; every other row is counted under its reason.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict, Unpack

from retool.config import RolloutConfig, SandboxConfig
from retool.data.annotated import AnnotatedSolution, ParseFailure, Step, matches_result, parse_solution
from retool.data.gsm8k import gsm8k_answer, normalize_question
from retool.data.problem import Problem
from retool.jsonl import JsonObject
from retool.protocol import ChatProtocol
from retool.reward.verifier import score_answer
from retool.sandbox import make_executor
from retool.sandbox.base import Executor
from retool.sandbox.bwrap import strict_support
from retool.train.sft import SFTExample, budget_violation
from retool.train.trace import answer_text, build_trajectory

logger = logging.getLogger(__name__)

STYLE = "annotated"  # the solution's steps computed by interpreter calls
TEXT_STYLE = "annotated_text"  # the same solution as plain reasoning in one turn, no tool registered
# Reasons a row is dropped, in the order they are checked.
DROP_REASONS = (
    "invalid_json",
    "missing_field",
    "test_question",
    "no_final_answer",
    "no_annotation",
    "unparsable_annotation",
    "execution_error",
    "observation_mismatch",
    "answer_not_verified",
    "format_cannot_carry",
    "over_budget",
)


class ConvertOptions(TypedDict, total=False):
    """Which fields hold the question, the annotated solution and (optionally) the reference answer
    (default: the text after ``####``); ``limit``: rows read at most; ``per_call``: steps per call."""

    question_field: str
    solution_field: str
    answer_field: str | None
    limit: int | None
    per_call: int
    held_out: Sequence[str]  # questions never trained on (compared normalised): a row asking one is dropped
    rows: Collection[int]  # only these row numbers (from 1); the others are skipped, not read
    budgets: RolloutConfig  # drop a trajectory the rollout's budgets would have cut (``budget_violation``)
    text_only: bool  # plain reasoning in one turn (the protocol must have no tool), arithmetic still checked


@dataclass
class ConvertReport:
    read: int = 0
    kept: int = 0
    calls: int = 0  # interpreter calls in the kept trajectories
    dropped: Counter[str] = field(default_factory=Counter)
    examples_of: dict[str, str] = field(default_factory=dict)  # reason -> the first row's detail
    rejects: list[JsonObject] = field(default_factory=list)  # every dropped row: its number, reason, detail

    def merge(self, other: ConvertReport) -> None:
        """Add ``other``'s counts (another part of the same file), keeping each reason's first example."""
        self.read += other.read
        self.kept += other.kept
        self.calls += other.calls
        self.dropped.update(other.dropped)
        for reason, example in other.examples_of.items():
            self.examples_of.setdefault(reason, example)
        self.rejects = sorted([*self.rejects, *other.rejects], key=lambda r: int(str(r["row"])))

    def drop(self, reason: str, row: int, detail: str) -> None:
        self.dropped[reason] += 1
        self.examples_of.setdefault(reason, f"row {row}: {detail}")
        self.rejects.append({"row": row, "reason": reason, "detail": detail})

    def as_dict(self) -> JsonObject:
        return {
            "read": self.read,
            "kept": self.kept,
            "calls": self.calls,
            "dropped": dict(sorted(self.dropped.items())),
            "first_of_each": dict(sorted(self.examples_of.items())),
        }


class Dropped(Exception):
    """Why one row yields no trajectory (a reason name from ``DROP_REASONS`` and a detail)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def caching_observer(executor: Executor) -> Callable[[str], tuple[str, bool]]:
    """Runs each distinct program once in the sandbox: (the observation text, whether it ran cleanly)."""
    seen: dict[str, tuple[str, bool]] = {}

    def run(code: str) -> tuple[str, bool]:
        if code not in seen:
            result = executor.run(code)
            seen[code] = (executor.format_tool_content(result), result.ok)
        return seen[code]

    return run


def chunk_code(steps: Sequence[Step]) -> str:
    """One program computing every step of a chunk, one printed line per step."""
    return "\n".join(step.code for step in steps)


def _chunks(solution: AnnotatedSolution, per_call: int) -> list[tuple[Step, ...]]:
    """The steps grouped into calls: ``per_call`` steps each (0: all of them in one call)."""
    size = per_call or len(solution.steps)
    return [solution.steps[i : i + size] for i in range(0, len(solution.steps), size)]


def _observations(chunks: Sequence[Sequence[Step]], run: Callable[[str], tuple[str, bool]]) -> dict[str, str]:
    """Every call executed; raises ``Dropped`` unless each printed line is its annotation's result."""
    outputs: dict[str, str] = {}
    for i, chunk in enumerate(chunks):
        code = chunk_code(chunk)
        text, ok = run(code)
        if not ok:
            raise Dropped("execution_error", f"call {i + 1} {code!r}: {' '.join(text.split())[-120:]}")
        lines = text.strip().split("\n")
        if len(lines) != len(chunk) or not all(
            matches_result(line, step.result) for line, step in zip(lines, chunk, strict=False)
        ):
            stated = [step.result for step in chunk]
            raise Dropped(
                "observation_mismatch", f"call {i + 1} {code!r} printed {text.strip()!r}, annotated {stated}"
            )
        outputs[code] = text
    return outputs


def _turns(chunks: Sequence[Sequence[Step]], protocol: ChatProtocol) -> list[tuple[str, str]]:
    """Each call's assistant turn: the reasoning written since the previous call's first step, then the call.

    The text after a call's first step (which states that step's result) is written once its output is
    seen, so a folded call's turn comes before the reasoning of all the steps it computes.
    """
    turns: list[tuple[str, str]] = []
    pending = ""
    for chunk in chunks:
        pending += chunk[0].text
        code = chunk_code(chunk)
        turns.append((f"{pending.strip()}\n{protocol.fmt.render_call(code)}".strip(), code))
        pending = "".join(step.text for step in chunk[1:])
    return turns


def convert_solution(
    problem: Problem,
    solution: str,
    protocol: ChatProtocol,
    run: Callable[[str], tuple[str, bool]],
    *,
    per_call: int = 1,
    max_observation_tokens: int = 64,
    text_only: bool = False,
) -> SFTExample:
    """The cold-start trajectory of one annotated solution; raises ``Dropped`` with the reason.

    ``text_only``: the solution as one turn of plain reasoning (annotations replaced by their results, as
    written) for ``protocol`` without a tool; its annotations are still executed and checked, so the
    arithmetic it teaches is right."""
    if text_only and protocol.use_tools:
        raise ValueError(
            "a text-only trajectory needs the protocol without the tool (protocol.with_tools(False))"
        )
    parsed = parse_solution(solution)
    if isinstance(parsed, ParseFailure):
        raise Dropped(parsed.reason, parsed.detail)
    chunks = _chunks(parsed, per_call)
    outputs = _observations(chunks, run)
    rest = "".join(step.text for step in chunks[-1][1:]) + parsed.tail
    if text_only:
        rest = "".join(step.text for step in parsed.steps) + parsed.tail
    final_text = f"{rest.strip()}\n\n{answer_text(parsed.answer)}".strip()
    if not score_answer(final_text, problem.answer).correct:
        raise Dropped("answer_not_verified", f"\\boxed{{{parsed.answer}}} vs reference {problem.answer!r}")
    if text_only:
        tokens, weights, _ = build_trajectory(protocol, problem.question, [], final_text, run_text, 0)
        return SFTExample(problem, TEXT_STYLE, tokens, weights, text=protocol.decode(tokens))
    try:
        turns = _turns(chunks, protocol)
    except ValueError as exc:
        raise Dropped("format_cannot_carry", str(exc)) from None
    tokens, weights, _ = build_trajectory(
        protocol, problem.question, turns, final_text, outputs.__getitem__, max_observation_tokens
    )
    return SFTExample(task=problem, style=STYLE, tokens=tokens, weights=weights, text=protocol.decode(tokens))


def run_text(code: str) -> str:
    """The observer of a text-only trajectory, which makes no call: never called."""
    raise AssertionError(f"a text-only trajectory ran code: {code!r}")


def _rows(path: Path) -> Iterator[tuple[int, JsonObject | None, str]]:
    """(row number from 1, the object or None, the parse error) of every non-blank line."""
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield n, None, f"not JSON ({exc.msg} at char {exc.pos})"
                continue
            yield (n, obj, "") if isinstance(obj, dict) else (n, None, "not a JSON object")


def _problem(row: int, obj: JsonObject, fields: tuple[str, str, str | None]) -> tuple[Problem, str]:
    question_field, solution_field, answer_field = fields
    values = {f: obj.get(f) for f in (question_field, solution_field, answer_field) if f}
    missing = [f for f, v in values.items() if not isinstance(v, str | int | float) or not str(v).strip()]
    if missing:
        raise Dropped("missing_field", f"no text in {', '.join(missing)}")
    solution = str(values[solution_field])
    try:
        reference = str(values[answer_field]) if answer_field else gsm8k_answer(solution)
    except ValueError:
        raise Dropped("no_final_answer", "no '#### <answer>' line") from None
    problem_id = str(obj.get("id", obj.get("idx", f"row-{row}")))
    return Problem(problem_id, str(values[question_field]), reference, "coldstart"), solution


def convert_file(
    path: str | Path,
    protocol: ChatProtocol,
    executor: Executor,
    **options: Unpack[ConvertOptions],
) -> tuple[list[SFTExample], ConvertReport]:
    """Every row of a JSONL file converted (or counted under its drop reason); never raises for a row."""
    question_field = options.get("question_field", "question")
    solution_field = options.get("solution_field", "answer")
    answer_field = options.get("answer_field")
    limit = options.get("limit")
    per_call = options.get("per_call", 1)
    held_out = {normalize_question(q) for q in options.get("held_out", ())}
    only = options.get("rows")
    budgets = options.get("budgets")
    observation_tokens = budgets.max_observation_tokens if budgets is not None else 64
    report = ConvertReport()
    run = caching_observer(executor)
    examples: list[SFTExample] = []
    for row, obj, error in _rows(Path(path)):
        if limit is not None and report.read >= limit:
            break
        if only is not None and row not in only:
            continue
        report.read += 1
        if report.read % 1000 == 0:
            logger.info("coldstart: %d rows read, %d kept", report.read, report.kept)
        try:
            if obj is None:
                raise Dropped("invalid_json", error)
            problem, solution = _problem(row, obj, (question_field, solution_field, answer_field))
            if normalize_question(problem.question) in held_out:
                raise Dropped("test_question", "the question is a held-out test question")
            example = convert_solution(
                problem,
                solution,
                protocol,
                run,
                per_call=per_call,
                max_observation_tokens=observation_tokens,
                text_only=options.get("text_only", False),
            )
            if budgets is not None and (why := budget_violation(example, budgets)) is not None:
                raise Dropped("over_budget", why)
        except Dropped as drop:
            report.drop(drop.reason, row, drop.detail)
            continue
        examples.append(example)
        report.kept += 1
        report.calls += 0 if options.get("text_only") else _calls(solution, per_call)
    return examples, report


def _calls(solution: str, per_call: int) -> int:
    parsed = parse_solution(solution)
    return 0 if isinstance(parsed, ParseFailure) else len(_chunks(parsed, per_call))


def coldstart_protocol(model: str, tool_format: str = "auto", system_prompt: str = "full") -> ChatProtocol:
    """The protocol of ``model``'s tokenizer (a folder or Hub id); the call format read from its template."""
    from transformers import AutoTokenizer  # deferred: transformers (~3 s)

    return ChatProtocol(AutoTokenizer.from_pretrained(model), fmt=tool_format, system_prompt=system_prompt)


def convert_with_sandbox(
    path: str | Path, protocol: ChatProtocol, **options: Unpack[ConvertOptions]
) -> tuple[list[SFTExample], ConvertReport]:
    """``convert_file`` with the project's sandbox executor (strict isolation where this machine has it)."""
    # Plain arithmetic: nothing to pre-import.
    isolation: Literal["strict", "none"] = "strict" if strict_support()[0] else "none"
    with make_executor(SandboxConfig(isolation=isolation, preimport=[])) as executor:
        return convert_file(path, protocol, executor, **options)


def write_rejects(report: ConvertReport, path: str | Path) -> None:
    """One JSON line per dropped row: ``row`` (its line number), ``reason``, ``detail``."""
    Path(path).write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in report.rejects), encoding="utf-8"
    )
