"""retool.data evaluation-set loaders: local files with configurable fields, named Hub sets, bad rows."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from retool.data import DataError, load_problems, load_problems_with_report


def test_aime2025_local(fixture_data: Path) -> None:
    problems = load_problems(fixture_data / "aime2025.jsonl")
    assert len(problems) == 12  # the fixture: the first 12 of the 30 problems
    assert problems[0].id == "2025-I-1"
    assert all(isinstance(p.answer, str) and p.answer.isdigit() for p in problems)  # ints became strings
    assert problems[0].answer == "70"
    assert problems[0].data_source == "aime2025"


def test_math500_local_uses_its_own_field_names(fixture_data: Path) -> None:
    # MATH-500 has "problem" and "unique_id"; explicit fields and the default fallbacks agree.
    explicit = load_problems(fixture_data / "math500.jsonl", question_field="problem", id_field="unique_id")
    fallback = load_problems(fixture_data / "math500.jsonl")
    assert len(explicit) == sum(1 for line in (fixture_data / "math500.jsonl").open() if line.strip())
    assert explicit == fallback
    assert explicit[0].id == "test/precalculus/807.json"
    assert explicit[0].answer.startswith("\\left( 3")


def test_configurable_fields_and_number_conversion(tmp_path: Path) -> None:
    rows = [
        {"q": "What is 1/2 as a decimal?", "a": 0.5, "key": 7},
        {"q": "Two?", "a": 2.0, "key": 8},
        {"q": "Text answer", "a": " \\frac{1}{2} ", "key": 9},
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_problems(path, question_field="q", answer_field="a", id_field="key")
    assert [(p.id, p.answer) for p in problems] == [("7", "0.5"), ("8", "2"), ("9", "\\frac{1}{2}")]
    # A non-default field that is absent is not guessed: the rows are dropped, not misread.
    problems, report = load_problems_with_report(path, question_field="nope", answer_field="a")
    assert problems == [] and report.dropped_lines == {"missing_question": [1, 2, 3]}


def test_bad_rows_skipped_with_numbers(tmp_path: Path) -> None:
    lines = [
        json.dumps({"id": "a", "question": "ok?", "answer": 1}),
        "garbage {",
        json.dumps({"id": "b", "question": "no answer"}),
        json.dumps({"id": "c", "question": ["not", "text"], "answer": "1"}),
        json.dumps({"id": "d", "question": "bad answer", "answer": [1, 2]}),
        json.dumps({"id": "a", "question": "same id again", "answer": "5"}),
        json.dumps({"question": "no id", "answer": "6"}),
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems, report = load_problems_with_report(path)
    assert [p.answer for p in problems] == ["1", "5", "6"]
    assert len({p.id for p in problems}) == 3
    assert problems[2].id == "set-7"
    assert report.dropped_lines == {
        "malformed_json": [2],
        "missing_answer": [3],
        "bad_question_type": [4],
        "bad_answer_type": [5],
    }


def test_gsm8k_style_answers_keep_only_the_final_number(fixture_data: Path) -> None:
    problems = load_problems(fixture_data / "gsm8k_test.jsonl")
    assert problems[0].answer == "18"


def test_named_sets_resolve_to_hub_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    def load_dataset(name: str, config: object = None, split: str = "train") -> list[dict]:
        calls.append((name, split))
        return [{"problem": "P?", "answer": 204, "id": 60, "unique_id": "u"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_problems("aime2024")[0].answer == "204"
    assert load_problems("aime2025")[0].data_source == "aime2025"
    assert load_problems("math500")[0].id == "u"
    assert [c[0] for c in calls] == ["HuggingFaceH4/aime_2024", "math-ai/aime25", "HuggingFaceH4/MATH-500"]


def test_missing_and_unknown_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match="file not found"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="unknown source"):
        load_problems("aime1999")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="datasets"):
        load_problems("aime2025")
