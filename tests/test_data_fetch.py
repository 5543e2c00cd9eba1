"""`retool data fetch NAME`: where the data folder is, imports of a local copy (--from), downloads through a
stand-in Hub loader, and the one-line error offline; and that every reader by name finds what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.data import DataError
from retool.data.fetch import FETCHABLE, fetch_dataset
from retool.data.paths import cache_data_dir, data_dir


def test_the_data_folder_is_explicit_then_the_variable_then_the_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RETOOL_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_dir() == cache_data_dir() == tmp_path / "xdg" / "retool" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home" / ".cache" / "retool" / "data"
    monkeypatch.setenv("RETOOL_DATA_DIR", str(tmp_path / "env"))
    assert data_dir() == tmp_path / "env"
    assert data_dir(tmp_path / "given") == tmp_path / "given"


def test_every_name_of_the_issue_can_be_fetched() -> None:
    assert set(FETCHABLE) == {"gsm8k", "math500", "aime2024", "aime2025", "dapo", "mathematics"}


def test_from_a_local_copy_the_readers_by_name_find_it(
    fixture_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retool.data.gsm8k import gsm8k_problems
    from retool.env import make_source

    folder = tmp_path / "data"
    monkeypatch.setenv("RETOOL_DATA_DIR", str(folder))
    for name in ("gsm8k", "math500", "aime2024", "aime2025", "dapo"):
        fetch_dataset(name, source=fixture_data)
    # The named evaluation sets, GSM8K and DAPO now come from the data folder, not the Hub.
    aime = make_source("aime2025")
    assert aime.source == str(folder / "aime2025.jsonl") and len(aime.problems("test")) == 12
    assert make_source("math500").source == str(folder / "math500.jsonl")
    assert len(gsm8k_problems(5, None)) == 5
    gsm8k = make_source("gsm8k")
    assert len(gsm8k.problems("train")) == 60 and len(gsm8k.problems("test")) == 40
    dapo = make_source("dapo")
    assert dapo.source == str(folder / "dapo") and len(dapo.problems("test")) == 50  # prepared on fetch
    # Fetching again from the folder itself is a no-op, not an error.
    again = fetch_dataset("aime2025", source=folder)
    assert again.files == {"aime2025.jsonl": 12}


def test_a_local_copy_without_the_files_is_refused(fixture_data: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"mathematics needs mathematics_train\.jsonl"):
        fetch_dataset("mathematics", source=fixture_data, data_dir=tmp_path)
    with pytest.raises(DataError, match="no such folder"):
        fetch_dataset("gsm8k", source=tmp_path / "nowhere", data_dir=tmp_path)
    with pytest.raises(DataError, match="no dataset named 'mnist'"):
        fetch_dataset("mnist", data_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_mathematics_from_local_files_extrapolate_optional(tmp_path: Path) -> None:
    src = tmp_path / "gen"
    src.mkdir()
    row = json.dumps({"question": "Solve 2*x = 4 for x.", "answer": "2"})
    for split in ("train", "interpolate"):
        (src / f"mathematics_{split}.jsonl").write_text(row + "\n" + row + "\n")
    result = fetch_dataset("mathematics", source=src, data_dir=tmp_path / "data")
    assert result.files == {"mathematics_train.jsonl": 2, "mathematics_interpolate.jsonl": 2}
    (src / "mathematics_extrapolate.jsonl").write_text(row + "\n")
    result = fetch_dataset("mathematics", source=src, data_dir=tmp_path / "data")
    assert result.files["mathematics_extrapolate.jsonl"] == 1


def test_from_the_hub_each_split_becomes_jsonl(tmp_path: Path) -> None:
    calls: list[tuple[str, str | None, str]] = []

    def loader(hub_id: str, config: str | None, split: str) -> list[dict[str, object]]:
        calls.append((hub_id, config, split))
        return [{"question": f"{split} q{i}", "answer": f"x\n#### {i}"} for i in range(3)]

    result = fetch_dataset("gsm8k", data_dir=tmp_path, loader=loader)
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert result.files == {"gsm8k_train.jsonl": 3, "gsm8k_test.jsonl": 3}
    assert result.source == "https://huggingface.co/datasets/openai/gsm8k"
    rows = [json.loads(x) for x in (tmp_path / "gsm8k_test.jsonl").read_text().splitlines()]
    assert rows[1] == {"question": "test q1", "answer": "x\n#### 1"}
    fetch_dataset("mathematics", data_dir=tmp_path, loader=loader, config="numbers__gcd")
    assert calls[-2:] == [("deepmind/math_dataset", "numbers__gcd", s) for s in ("train", "test")]
    assert not (tmp_path / "mathematics_extrapolate.jsonl").exists()  # not on the Hub: generated locally


def test_dapo_from_the_hub_keeps_one_copy_of_each_row_and_is_prepared(
    fixture_data: Path, tmp_path: Path
) -> None:
    rows = [json.loads(x) for x in (fixture_data / "dapo_math_sample.jsonl").read_text().splitlines()]
    result = fetch_dataset("dapo", data_dir=tmp_path, loader=lambda *_: rows * 3)  # the Hub repeats rows
    assert result.files == {"dapo_math_17k.jsonl": len(rows)}
    assert result.prepared == tmp_path / "dapo" and (tmp_path / "dapo" / "dev.jsonl").is_file()


def test_offline_the_error_is_one_line_naming_the_set_the_address_and_from(tmp_path: Path) -> None:
    def offline(hub_id: str, config: str | None, split: str) -> list[dict[str, object]]:
        raise ConnectionError("[Errno -2] Name or service not known")

    with pytest.raises(DataError) as caught:
        fetch_dataset("aime2025", data_dir=tmp_path, loader=offline)
    message = str(caught.value)
    assert "\n" not in message and "aime2025" in message and "--from DIR" in message
    assert "https://huggingface.co/datasets/math-ai/aime25" in message
    assert not (tmp_path / "aime2025.jsonl").exists() and not list(tmp_path.glob("*.part"))


def test_the_command(fixture_data: Path, tmp_path: Path) -> None:
    from retool.cli import app

    runner = CliRunner()
    ok = runner.invoke(
        app, ["data", "fetch", "aime2024", "--from", str(fixture_data), "--data-dir", str(tmp_path)]
    )
    assert ok.exit_code == 0, ok.output
    assert "12 rows" in ok.output and (tmp_path / "aime2024.jsonl").is_file()
    bad = runner.invoke(app, ["data", "fetch", "mnist", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "no dataset named 'mnist'" in bad.output
    helped = runner.invoke(app, ["data", "fetch", "--help"])
    assert "--from" in helped.output and "retool data mathematics" in " ".join(helped.output.split())
