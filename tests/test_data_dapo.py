"""retool.data DAPO preparation: wrapper stripping, dedupe, split, bad-row counting, sources, CLI."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.data import DataError, load_dapo, prepare_dapo, strip_dapo_template

PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_row(question: str, answer: object, index: object = "0", wrap: bool = True) -> dict:
    content = f"{PREFIX}{question}{SUFFIX}" if wrap else question
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": content, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_strip_removes_both_sentences_and_keeps_the_problem() -> None:
    problem = "Find $x$ if $2x = 6$.\n\nGive the value of $x$."
    assert strip_dapo_template(PREFIX + problem + SUFFIX) == problem
    assert strip_dapo_template(problem) == problem  # an already bare problem is untouched
    # Only the wrapper at the ends goes: the same words inside a problem stay.
    inner = 'Explain why "Answer:" matters. Remember to put your answer on its own line after "Answer:". Then 1+1?'
    assert strip_dapo_template(PREFIX + inner + SUFFIX) == inner


def test_prepare_real_sample_writes_train_and_50_dev(fixture_data: Path, tmp_path: Path) -> None:
    source = fixture_data / "dapo_math_sample.jsonl"
    report = prepare_dapo(source, tmp_path / "out", dev_size=50, seed=0)
    train = read_jsonl(tmp_path / "out" / "train.jsonl")
    dev = read_jsonl(tmp_path / "out" / "dev.jsonl")
    n_lines = sum(1 for line in source.open(encoding="utf-8") if line.strip())
    assert report.read == n_lines
    assert len(dev) == 50 and report.dev == 50
    assert len(train) == report.train == report.kept - 50
    assert report.kept + report.duplicates + sum(report.dropped.values()) == report.read
    for row in train + dev:
        assert set(row) == {"id", "question", "answer", "data_source"}
        assert row["question"] and row["answer"]
        assert "Solve the following math problem" not in row["question"]
        assert "Remember to put your answer on its own line" not in row["question"]
    questions = [" ".join(r["question"].split()) for r in train + dev]
    assert len(set(questions)) == len(questions), "duplicates survived"
    ids = [r["id"] for r in train + dev]
    assert len(set(ids)) == len(ids)
    assert not {r["id"] for r in dev} & {r["id"] for r in train}
    saved = json.loads((tmp_path / "out" / "prepare_report.json").read_text())
    assert saved["kept"] == report.kept and saved["dev"] == 50


def test_dev_split_is_seeded(tmp_path: Path) -> None:
    rows = [json.dumps(dapo_row(f"Problem number {i}?", i, str(i))) for i in range(40)]
    src = write_lines(tmp_path / "d.jsonl", rows)
    a = prepare_dapo(src, tmp_path / "a", dev_size=5, seed=1)
    b = prepare_dapo(src, tmp_path / "b", dev_size=5, seed=1)
    c = prepare_dapo(src, tmp_path / "c", dev_size=5, seed=2)
    dev_a, dev_b, dev_c = (read_jsonl(r.dev_file) for r in (a, b, c))
    assert dev_a == dev_b
    assert dev_a != dev_c
    # Train keeps the source order.
    train_ids = [int(r["id"]) for r in read_jsonl(a.train_file)]
    assert train_ids == sorted(train_ids)


def test_bad_rows_are_counted_with_line_numbers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [
        json.dumps(dapo_row("Good one: 1+1?", "2", "a")),  # 1
        "{not json",  # 2
        json.dumps({"prompt": [{"role": "user", "content": PREFIX + "No answer here." + SUFFIX}]}),  # 3
        json.dumps(dapo_row("Answer is a dict", {"x": 1}, "b")),  # 4
        json.dumps({"reward_model": {"ground_truth": "3"}}),  # 5: no prompt
        json.dumps([1, 2, 3]),  # 6: not an object
        "",  # blank: ignored, not a row
        json.dumps(dapo_row("Good one: 1+1?", "2", "dup")),  # 8: duplicate of line 1
        json.dumps({"prompt": 17, "reward_model": {"ground_truth": "1"}}),  # 9: prompt of a wrong type
        json.dumps(dapo_row(" ", "4", "c", wrap=True)),  # 10: nothing left after stripping
        json.dumps(dapo_row("Numeric answer row", 128.0, "d")),  # 11: good, answer becomes "128"
        json.dumps(dapo_row("Boolean answer", True, "e")),  # 12: bool is not an answer
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"prompt": "\xff\xfe"}\n')  # 13: bad UTF-8
    with caplog.at_level("WARNING"):
        problems, report = load_dapo(path)
    assert [p.answer for p in problems] == ["2", "128"]
    assert report.read == 12
    assert report.kept == 2 and report.duplicates == 1
    assert report.dropped_lines == {
        "malformed_json": [2],
        "missing_answer": [3],
        "bad_answer_type": [4, 12],
        "missing_prompt": [5],
        "not_an_object": [6],
        "bad_prompt_type": [9],
        "empty_question": [10],
        "bad_encoding": [13],
    }
    assert "row 2 skipped (malformed_json)" in caplog.text


def test_duplicate_ids_are_made_unique(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "d.jsonl", [json.dumps(dapo_row(f"Q{i}?", i, "same")) for i in range(3)])
    problems, report = load_dapo(src)
    assert len({p.id for p in problems}) == 3
    assert report.renamed_ids == 2


def test_missing_file_and_unknown_source_raise_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        load_dapo(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unknown source"):
        load_dapo("definitely-not-a-source")
    src = write_lines(tmp_path / "d.jsonl", [json.dumps(dapo_row("Q?", 1))])
    with pytest.raises(DataError, match="dev split"):
        prepare_dapo(src, tmp_path / "o", dev_size=50)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(DataError, match="cannot write"):
        prepare_dapo(src, tmp_path / "a_file", dev_size=0)


def test_parquet_without_pyarrow_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        load_dapo(path)


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [dapo_row(f"Parquet problem {i}?", str(i), str(i)) for i in range(5)]
    rows.append({**dapo_row("no answer", "1", "x"), "reward_model": {"ground_truth": None, "style": "r"}})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    problems, report = load_dapo(tmp_path / "d.parquet")
    assert [p.question for p in problems] == [f"Parquet problem {i}?" for i in range(5)]
    assert report.dropped_lines == {"missing_answer": [6]}


def test_hub_source_goes_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    def load_dataset(name: str, config: object = None, split: str = "train") -> list[dict]:
        calls.append((name, split))
        return [dapo_row("Hub problem?", "7", "u1"), dapo_row("Hub problem?", "7", "u2")]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    problems, report = load_dapo("BytedTsinghua-SIA/DAPO-Math-17k")
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", "train")]
    assert [(p.id, p.question, p.answer) for p in problems] == [("u1", "Hub problem?", "7")]
    assert report.duplicates == 1


def test_hub_without_datasets_is_a_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="datasets"):
        load_dapo("someone/some-dataset")


def test_cli_prepare_prints_counts_and_exit_codes(fixture_data: Path, tmp_path: Path) -> None:
    from retool.cli import app

    runner = CliRunner()
    out = tmp_path / "out"
    ok = runner.invoke(
        app, ["prepare", "dapo", "--input", str(fixture_data / "dapo_math_sample.jsonl"), "--out", str(out)]
    )
    assert ok.exit_code == 0, ok.output
    for word in ("read:", "kept:", "duplicates:", "dropped:"):
        assert word in ok.stdout
    assert len(read_jsonl(out / "dev.jsonl")) == 50

    missing = runner.invoke(
        app, ["prepare", "dapo", "--input", str(tmp_path / "nope.jsonl"), "--out", str(out)]
    )
    assert missing.exit_code == 2
    assert missing.stderr.strip().count("\n") == 0 and "file not found" in missing.stderr

    unknown = runner.invoke(app, ["prepare", "dapo", "--input", "nonsense", "--out", str(out)])
    assert unknown.exit_code == 2 and "unknown source" in unknown.stderr
