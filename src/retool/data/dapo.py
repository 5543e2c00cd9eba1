"""DAPO-Math-17k: read rows, strip the dataset's instruction wrapper, deduplicate, split train/dev, write JSONL.

A DAPO row is ``{data_source, prompt: [{role, content}], ability, reward_model: {ground_truth, style},
extra_info: {index}}``. Every prompt is wrapped in the same instructions ("Solve the following math problem
step by step. ... Answer: $Answer ..." before the problem, "Remember to put your answer on its own line
after "Answer:"." after it), which contradict the ``\\boxed{}`` format this project asks for (chapter
8.4.2), so both sentences are removed and only the problem is kept.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterable
from pathlib import Path

from retool.data.problem import Problem
from retool.data.readers import (
    LOCAL_SUFFIXES,
    BadRow,
    DataError,
    RowItem,
    iter_hub,
    iter_local,
    looks_like_hub_id,
)
from retool.data.report import LoadReport, PrepareReport

logger = logging.getLogger(__name__)

DAPO_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
DEFAULT_DATA_SOURCE = "math_dapo"
# The dev split `retool prepare dapo` holds out by default (the ``dapo`` environment splits alike).
DEV_SIZE, DEV_SEED = 50, 0

# Tolerant of whitespace and of "$Answer"/"Answer" wording drift; anchored so text inside a problem is safe.
_PREFIX_RE = re.compile(
    r"\A\s*Solve the following math problem step by step\.[^\n]*?"
    r"where \$?Answer is the answer to the problem\.\s*",
)
_SUFFIX_RE = re.compile(
    r"\s*Remember to put your answer on its own line after [\"“']?Answer:?[\"”']?\.?\s*\Z",
)


def strip_dapo_template(text: str) -> str:
    """The bare problem: DAPO's leading instruction sentence and trailing reminder removed."""
    text = _PREFIX_RE.sub("", text, count=1)
    text = _SUFFIX_RE.sub("", text, count=1)
    return text.strip()


def _answer_to_str(value: object) -> str | None:
    """Reference answers as strings; numbers are converted (``128.0`` -> ``"128"``); other types: None."""
    if isinstance(value, bool):  # bool is an int subclass; True is not an answer
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value.strip()
    return None


def _question_from_prompt(prompt: object) -> tuple[str | None, str]:
    """(raw question text, drop reason if None)."""
    if isinstance(prompt, str):
        return prompt, ""
    if not isinstance(prompt, list) or not prompt:
        return None, "missing_prompt" if prompt in (None, [], "") else "bad_prompt_type"
    messages = [m for m in prompt if isinstance(m, dict)]
    if not messages:
        return None, "bad_prompt_type"
    # The problem is the user's message; DAPO has exactly one, but a system message may precede it.
    user = next((m for m in messages if m.get("role") == "user"), messages[0])
    content = user.get("content")
    if content is None:
        return None, "missing_prompt"
    if not isinstance(content, str):
        return None, "bad_prompt_type"
    return content, ""


def normalize_dapo_row(number: int, row: dict[str, object]) -> tuple[Problem | None, str]:
    """``(Problem, "")`` or ``(None, reason)`` for one DAPO row (``number`` is its 1-based line/row)."""
    raw, reason = _question_from_prompt(row.get("prompt", row.get("question")))
    if raw is None:
        return None, reason
    question = strip_dapo_template(raw)
    if not question:
        return None, "empty_question"

    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        truth = reward_model["ground_truth"]
    elif reward_model is not None and not isinstance(reward_model, dict):
        return None, "bad_answer_type"
    else:
        truth = row.get("answer")
    if isinstance(truth, list):  # some exports keep a list of acceptable answers; the first is canonical
        truth = truth[0] if truth else None
    if truth is None:
        return None, "missing_answer"
    answer = _answer_to_str(truth)
    if answer is None:
        return None, "bad_answer_type"
    if not answer:
        return None, "missing_answer"

    extra = row.get("extra_info")
    index = extra.get("index") if isinstance(extra, dict) else None
    problem_id = str(index) if index not in (None, "") else str(number)
    source = row.get("data_source")
    data_source = source if isinstance(source, str) and source else DEFAULT_DATA_SOURCE
    return Problem(id=problem_id, question=question, answer=answer, data_source=data_source), ""


def resolve_rows(source: str | Path, split: str, aliases: dict[str, str]) -> tuple[Iterable[RowItem], str]:
    """Rows of a local file (if it exists), of a Hub dataset (an alias or ``owner/name``), or DataError."""
    text = str(source)
    path = Path(text)
    if path.exists():
        return iter_local(path), text
    if text.lower() in aliases:
        return iter_hub(aliases[text.lower()], split), aliases[text.lower()]
    if looks_like_hub_id(text):
        try:
            return iter_hub(text, split), text
        except DataError as exc:  # it may just as well be a mistyped path: say both
            raise DataError(f"no local file {text!r}, and {exc}") from None
    if text.endswith(LOCAL_SUFFIXES) or "/" in text or os.sep in text:
        raise DataError(f"file not found: {text}")
    names = ", ".join(sorted(aliases))
    raise DataError(f"unknown source {text!r}: not a file, not a Hub id (owner/name), not one of: {names}")


_DAPO_ALIASES = {"dapo": DAPO_HUB_ID, "dapo-math-17k": DAPO_HUB_ID}


def _question_key(question: str) -> str:
    # "Identical" up to whitespace: the same problem re-wrapped differently must not count twice.
    return " ".join(question.split())


def load_dapo(path_or_hub_id: str | Path, *, split: str = "train") -> tuple[list[Problem], LoadReport]:
    """Read DAPO rows from a local JSONL/JSON/parquet file or the Hub; strip, validate, deduplicate.

    Bad rows are skipped and counted by reason with their line numbers (see :class:`LoadReport`); only an
    unusable source raises :class:`DataError`.
    """
    rows, name = resolve_rows(path_or_hub_id, split, _DAPO_ALIASES)
    report = LoadReport(source=name)
    problems: list[Problem] = []
    seen: dict[str, Problem] = {}
    used_ids: set[str] = set()
    for number, row in rows:
        report.read += 1
        if isinstance(row, BadRow):
            report.drop(number, row.reason, row.detail)
            continue
        problem, reason = normalize_dapo_row(number, row)
        if problem is None:
            report.drop(number, reason)
            continue
        key = _question_key(problem.question)
        first = seen.get(key)
        if first is not None:
            report.duplicates += 1
            if first.answer != problem.answer:
                report.duplicate_answer_conflicts += 1
                logger.warning(
                    "%s: row %d repeats problem %s with a different answer (%r vs %r); keeping the first",
                    name,
                    number,
                    first.id,
                    problem.answer,
                    first.answer,
                )
            continue
        if problem.id in used_ids:  # ids must stay unique downstream (evaluation keys, resume positions)
            report.renamed_ids += 1
            problem = Problem(
                f"{problem.id}-row{number}", problem.question, problem.answer, problem.data_source
            )
        used_ids.add(problem.id)
        seen[key] = problem
        problems.append(problem)
    report.kept = len(problems)
    report.log_summary()
    return problems, report


def write_jsonl(path: Path, problems: Iterable[Problem]) -> int:
    """Write problems as JSONL atomically (a crash never leaves half a file under the final name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for problem in problems:
            fh.write(json.dumps(problem.to_dict(), ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def split_dev(
    problems: list[Problem], dev_size: int = DEV_SIZE, seed: int = DEV_SEED, *, source: str = "DAPO"
) -> tuple[list[Problem], list[Problem]]:
    """(train, dev): ``dev_size`` problems chosen with ``seed`` held out; both keep the source order."""
    if dev_size >= len(problems):
        raise DataError(
            f"{source}: only {len(problems)} usable problems, not enough for a dev split of {dev_size}"
        )
    chosen = set(random.Random(seed).sample(range(len(problems)), dev_size))
    dev = [p for i, p in enumerate(problems) if i in chosen]
    train = [p for i, p in enumerate(problems) if i not in chosen]
    return train, dev


def prepare_dapo(
    input: str | Path,
    out_dir: str | Path,
    dev_size: int = DEV_SIZE,
    seed: int = DEV_SEED,
    *,
    split: str = "train",
) -> PrepareReport:
    """Load DAPO (:func:`load_dapo`), hold out ``dev_size`` problems chosen with ``seed``, write
    ``train.jsonl`` and ``dev.jsonl`` (``{id, question, answer, data_source}``) plus ``prepare_report.json``.

    The training file keeps the source order; the dev problems are a seeded random sample.
    """
    if dev_size < 0:
        raise DataError(f"dev size must be >= 0, got {dev_size}")
    problems, load_report = load_dapo(input, split=split)
    train, dev = split_dev(problems, dev_size, seed, source=load_report.source)
    out = Path(out_dir)
    train_file, dev_file = out / "train.jsonl", out / "dev.jsonl"
    report = PrepareReport(
        load=load_report, train=len(train), dev=len(dev), train_file=train_file, dev_file=dev_file
    )
    try:
        write_jsonl(train_file, train)
        write_jsonl(dev_file, dev)
        (out / "prepare_report.json").write_text(
            json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8"
        )
    except OSError as exc:
        raise DataError(f"cannot write to {out}: {exc.strerror or exc}") from exc
    logger.info("wrote %d train and %d dev problems to %s", len(train), len(dev), out)
    return report
