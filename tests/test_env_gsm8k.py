"""The GSM8K environment: train and test splits from the shared files, and the test-leak check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retool.data.gsm8k import GSM8KLeakError, check_no_test_leak, gsm8k_split, normalize_question
from retool.data.readers import DataError
from retool.env import SourceOptions, make_source
from retool.env.gsm8k import Gsm8kSource
from retool.env.source import SourceError


def _slice(src: Path, dst: Path, name: str, n: int, extra: list[dict[str, str]] = ()) -> None:  # type: ignore[assignment]
    with (src / name).open() as fh:
        rows = [json.loads(next(fh)) for _ in range(n)]
    (dst / name).write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra]))


def test_registered_env_reads_both_real_splits(fixture_data: Path) -> None:
    from retool.config import DataConfig

    env = make_source("gsm8k", SourceOptions(data=DataConfig(data_dir=str(fixture_data))))
    assert isinstance(env, Gsm8kSource)
    train, test = env.problems("train"), env.problems("test")
    rows = [sum(1 for _ in (fixture_data / f).open()) for f in ("gsm8k_train.jsonl", "gsm8k_test.jsonl")]
    assert [len(train), len(test)] == rows and env.leaked == []  # the first rows of each split: disjoint
    assert train[0].answer == "72" and train[0].id == "gsm8k-train-0" and test[0].id.startswith("gsm8k-test-")
    check_no_test_leak(train, test)
    # Training draws from the train split only, in a seeded order.
    assert {p.id for p in env.epoch(0, 0)} == {p.id for p in train}
    assert env.epoch(0, 0) == env.epoch(0, 0) != env.epoch(1, 0)


@pytest.mark.full_data("gsm8k_train.jsonl", "gsm8k_test.jsonl")
def test_the_whole_train_split_holds_no_test_question(full_data: Path) -> None:
    """The leak check over both whole splits: GSM8K's train split shares no question with its test split."""
    env = Gsm8kSource(full_data, strict=True)
    train, test = env.problems("train"), env.problems("test")
    assert (len(train), len(test)) == (7473, 1319) and env.leaked == []
    check_no_test_leak(train, test)


def test_a_test_question_in_train_is_filtered_or_refused(fixture_data: Path, tmp_path: Path) -> None:
    with (fixture_data / "gsm8k_test.jsonl").open() as fh:
        test_row = json.loads(next(fh))
    # The same question with other spacing, case and punctuation is still the test question.
    disguised = {
        "question": "  " + test_row["question"].upper().replace(" ", "  ").rstrip("?") + " ?",
        "answer": "x\n#### 1",
    }
    _slice(fixture_data, tmp_path, "gsm8k_train.jsonl", 5, [disguised])
    _slice(fixture_data, tmp_path, "gsm8k_test.jsonl", 3)
    assert normalize_question(disguised["question"]) == normalize_question(test_row["question"])
    env = Gsm8kSource(tmp_path)
    train = env.problems("train")
    assert len(train) == 5 and env.leaked == ["gsm8k-train-5"]
    assert all(normalize_question(p.question) != normalize_question(test_row["question"]) for p in train)
    with pytest.raises(GSM8KLeakError, match="gsm8k-train-5"):
        Gsm8kSource(tmp_path, strict=True).problems("train")
    with pytest.raises(GSM8KLeakError):
        check_no_test_leak(gsm8k_split("train", tmp_path), gsm8k_split("test", tmp_path))


def test_missing_files_and_bad_split_are_clear(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"gsm8k_train\.jsonl"):
        Gsm8kSource(tmp_path).problems("train")
    with pytest.raises(DataError, match="splits"):
        gsm8k_split("dev", tmp_path)
    (tmp_path / "gsm8k_test.jsonl").write_text(
        json.dumps({"question": "q", "answer": "no final line"}) + "\n"
    )
    with pytest.raises(SourceError, match="row 1 is not a GSM8K problem"):
        Gsm8kSource(tmp_path).problems("test")
