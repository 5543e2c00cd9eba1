"""The one JSONL reader (``retool.jsonl``) and the places that read back what the project writes: model text
carries U+0085 / U+2028 / U+2029 raw into records written with ``ensure_ascii=False``, and a reader that
splits on them (``str.splitlines``) cuts those records in two."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from retool.analyze.report import load_training_log
from retool.data.gsm8k import GSM8K_FILE, gsm8k_problems
from retool.jsonl import JsonlError, first_jsonl_object, iter_jsonl, jsonl_lines, read_jsonl
from retool.pipeline.report import demo_gain, difficulty_breakdown
from retool.train.checkpoint import TrainerState, repair_metrics
from retool.train.metrics import MetricsLog

SEPARATORS = ("\u0085", "\u2028", "\u2029")
MODEL_TEXT = "Let x = 2.\u0085So x\u2028+ 1 = 3\u2029\\boxed{3}"


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_the_separators_are_what_splitlines_would_cut(tmp_path: Path) -> None:
    path = write(tmp_path / "r.jsonl", [{"text": MODEL_TEXT}, {"text": "plain"}])
    raw = path.read_text(encoding="utf-8")
    assert all(sep in raw for sep in SEPARATORS)
    assert len(raw.splitlines()) == 5  # the trap: 2 records read as 5 lines
    assert read_jsonl(path) == [{"text": MODEL_TEXT}, {"text": "plain"}]


def test_lines_are_numbered_blank_ones_skipped_and_a_torn_end_is_marked(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"a": 2}\n{"a": 3')
    lines = list(jsonl_lines(path))
    assert [(x.number, x.raw, x.complete) for x in lines] == [
        (1, b'{"a": 1}', True),
        (4, b'{"a": 2}', True),
        (5, b'{"a": 3', False),
    ]


def test_a_bad_line_raises_with_its_place_or_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(JsonlError, match=r"r\.jsonl:2: not a JSON line"):
        read_jsonl(path)
    with caplog.at_level(logging.WARNING, logger="retool.jsonl"):
        assert read_jsonl(path, "warn") == [{"a": 1}, {"a": 2}]
    assert "r.jsonl:2: skipping an unreadable line" in caplog.text
    assert list(iter_jsonl(path, "skip")) == [{"a": 1}, {"a": 2}]


def test_first_object(tmp_path: Path) -> None:
    assert first_jsonl_object(write(tmp_path / "a.jsonl", [{"text": MODEL_TEXT}, {"b": 2}])) == {
        "text": MODEL_TEXT
    }
    assert first_jsonl_object(write(tmp_path / "b.jsonl", [[1, 2]])) is None
    assert first_jsonl_object(tmp_path / "missing.jsonl") is None


def _eval_record(pid: str, source: str, correct: list[bool]) -> dict[str, Any]:
    candidates = [{"correct": c, "text": MODEL_TEXT, "code_calls": 1, "valid_format": True} for c in correct]
    return {"id": pid, "data_source": source, "candidates": candidates}


def test_demo_gain_reads_records_holding_the_separators(tmp_path: Path) -> None:
    sources = ["tasks/sum/easy", "tasks/sum/hard"]
    sft = [_eval_record(f"p{i}", sources[i % 2], [False, i % 3 == 0]) for i in range(6)]
    rl = [_eval_record(f"p{i}", sources[i % 2], [True, i % 3 == 0]) for i in range(6)]
    write(tmp_path / "sft_retool.jsonl", sft)
    write(tmp_path / "rl_retool.jsonl", rl)
    gain = demo_gain(tmp_path)
    # Every problem gains one of its two candidates: +0.5 Average@2, with no spread to bootstrap.
    assert gain["average_at_n"] == {"gain": pytest.approx(0.5), "ci95": [0.5, 0.5], "problems": 6}
    assert gain["hard_accuracy"]["gain"] == pytest.approx(0.5) and gain["hard_accuracy"]["problems"] == 3


def test_difficulty_breakdown_reads_records_holding_the_separators(tmp_path: Path) -> None:
    rows = [_eval_record("a", "tasks/sum/hard", [True, False]), _eval_record("g", "gsm8k", [True])]
    out = difficulty_breakdown(write(tmp_path / "e.jsonl", rows))
    assert (out["hard_candidates"], out["hard_accuracy"]) == (2, 0.5)
    assert (out["gsm8k_candidates"], out["gsm8k_accuracy"]) == (1, 1.0)


def test_training_metrics_read_back_whole(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.append({"step": step, "note": MODEL_TEXT, "reward": step / 10})
    assert [r["note"] for r in log.read()] == [MODEL_TEXT] * 3
    assert [r["reward"] for r in load_training_log(log.path).rows] == [0.1, 0.2, 0.3]
    state = TrainerState(
        step=3, data_position={}, metrics_line={"step": 3, "note": MODEL_TEXT, "reward": 0.3}
    )
    assert repair_metrics(log.path, state) == 0  # nothing dropped: every line parsed whole
    assert [r["step"] for r in log.read()] == [1, 2, 3]


def test_gsm8k_rows_holding_the_separators(tmp_path: Path) -> None:
    rows = [
        {"question": f"Q{i}{SEPARATORS[i % 3]}?", "answer": f"w\u2028#### {i}", "idx": i} for i in range(6)
    ]
    write(tmp_path / GSM8K_FILE, rows)
    problems = gsm8k_problems(6, tmp_path)
    assert sorted(p.answer for p in problems) == [str(i) for i in range(6)]
