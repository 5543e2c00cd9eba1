"""Evaluation sets (AIME 2025, AIME 2024, MATH-500, or any JSONL/parquet of problems) as ``Problem`` lists.

Names resolve to Hugging Face Hub datasets with their own field names; a path is read locally with
configurable field names. When the default field names are absent from a file, the common alternatives
(``problem`` for the question, ``unique_id``/``idx`` for the id) are tried, so the raw MATH-500 file loads
without flags. Numeric answers (AIME's integers) become strings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from retool.data.dapo import _answer_to_str, resolve_rows
from retool.data.problem import Problem
from retool.data.readers import BadRow, DataError, RowItem, iter_hub
from retool.data.report import LoadReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubSet:
    hub_id: str
    split: str
    question_field: str
    answer_field: str
    id_field: str


# Hub ids and their column names (dataset cards of each repository).
NAMED_SETS: dict[str, HubSet] = {
    "aime2025": HubSet("math-ai/aime25", "test", "problem", "answer", "id"),
    "aime2024": HubSet("HuggingFaceH4/aime_2024", "train", "problem", "answer", "id"),
    "math500": HubSet("HuggingFaceH4/MATH-500", "test", "problem", "answer", "unique_id"),
}

# Tried, in order, only when the caller kept the default field name and a row lacks it.
_FALLBACKS = {
    "question": ("question", "problem", "prompt"),
    "answer": ("answer", "ground_truth", "label"),
    "id": ("id", "unique_id", "idx", "index"),
}


def _field(row: dict[str, object], name: str, default: str) -> object:
    if name in row:
        return row[name]
    if name == default:
        for alt in _FALLBACKS[default]:
            if alt in row:
                return row[alt]
    return None


@dataclass(frozen=True)
class _Drop:
    reason: str
    detail: str


def _checked_row(row: dict[str, object], question_field: str, answer_field: str) -> tuple[str, str] | _Drop:
    """The row's (question, answer), or why it is dropped."""
    question = _field(row, question_field, "question")
    if question is None or (isinstance(question, str) and not question.strip()):
        return _Drop("missing_question", f"no {question_field!r}")
    if not isinstance(question, str):
        return _Drop("bad_question_type", type(question).__name__)
    raw_answer = _field(row, answer_field, "answer")
    if raw_answer is None:
        return _Drop("missing_answer", f"no {answer_field!r}")
    answer = _answer_to_str(raw_answer)
    if answer and "####" in answer:  # GSM8K: a worked solution ending in "#### <answer>"
        answer = answer.rsplit("####", 1)[1].strip()
    if answer is None:
        return _Drop("bad_answer_type", type(raw_answer).__name__)
    if not answer:
        return _Drop("missing_answer", "empty")
    return question.strip(), answer


def load_problems_with_report(
    path_or_name: str | Path,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str = "id",
    *,
    split: str | None = None,
) -> tuple[list[Problem], LoadReport]:
    """:func:`load_problems` plus the counts of what was kept and dropped (with row numbers)."""
    text = str(path_or_name)
    rows: Iterable[RowItem]
    named = NAMED_SETS.get(text.lower()) if not Path(text).exists() else None
    if named is not None:
        try:
            rows, source = iter_hub(named.hub_id, split or named.split), named.hub_id
        except DataError as exc:
            raise DataError(f"{text!r} is a Hub dataset ({named.hub_id}): {exc}") from None
        # The Hub set's own columns, unless the caller asked for specific ones.
        question_field = named.question_field if question_field == "question" else question_field
        answer_field = named.answer_field if answer_field == "answer" else answer_field
        id_field = named.id_field if id_field == "id" else id_field
        data_source = text.lower()
    else:
        rows, source = resolve_rows(text, split or "test", {k: v.hub_id for k, v in NAMED_SETS.items()})
        data_source = Path(text).stem if Path(text).exists() else text
    report = LoadReport(source=source)
    problems: list[Problem] = []
    used_ids: set[str] = set()
    for number, row in rows:
        report.read += 1
        if isinstance(row, BadRow):
            report.drop(number, row.reason, row.detail)
            continue
        checked = _checked_row(row, question_field, answer_field)
        if isinstance(checked, _Drop):
            report.drop(number, checked.reason, checked.detail)
            continue
        question, answer = checked
        raw_id = _field(row, id_field, "id")
        problem_id = str(raw_id) if raw_id not in (None, "") and not isinstance(raw_id, (dict, list)) else ""
        if not problem_id or problem_id in used_ids:
            if problem_id:
                report.renamed_ids += 1
            problem_id = f"{data_source}-{number}" if not problem_id else f"{problem_id}-row{number}"
        used_ids.add(problem_id)
        row_source = row.get("data_source")
        problems.append(
            Problem(
                id=problem_id,
                question=question,
                answer=answer,
                data_source=row_source if isinstance(row_source, str) and row_source else data_source,
            )
        )
    report.kept = len(problems)
    report.log_summary()
    return problems, report


def load_problems(
    path_or_name: str | Path,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str = "id",
    *,
    split: str | None = None,
) -> list[Problem]:
    """Problems of an evaluation or training set.

    ``path_or_name``: ``aime2025`` / ``aime2024`` / ``math500`` (Hub, needs ``datasets`` and a network),
    a Hub id ``owner/name``, or a local ``.jsonl`` / ``.json`` / ``.parquet`` file. Rows without a question
    or answer, with wrong types, or that are not JSON are skipped and logged with their numbers; a missing
    file or unknown name raises :class:`~retool.data.DataError`.
    """
    problems, _ = load_problems_with_report(path_or_name, question_field, answer_field, id_field, split=split)
    return problems
