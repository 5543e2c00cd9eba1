"""GSM8K: the test split as held-out problems (a seeded slice, or all of it), the train split, and the
leak check (no training problem is a test question, compared after normalisation).

A real benchmark the demo adds to its held-out set for real models and never trains on. The file is the
Hugging Face ``openai/gsm8k`` test split as JSONL (``question``, ``answer`` ending in ``#### <number>``,
optionally ``idx``); it is read from the data folder (``retool.data.paths``), where ``retool data fetch
gsm8k`` puts it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from retool.data.paths import data_dir as resolve_data_dir
from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.jsonl import read_jsonl_objects

GSM8K_FILE = "gsm8k_test.jsonl"
GSM8K_SOURCE = "gsm8k"


def gsm8k_answer(solution: str) -> str:
    """GSM8K's reference is the text after the last ``####``, with thousands separators removed."""
    _, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("GSM8K answer without '####'")
    return tail.strip().replace(",", "")


def gsm8k_problems(n: int, data_dir: str | Path | None, seed: int = 0) -> list[Problem]:
    """``n`` problems drawn (seeded) from ``<data_dir>/gsm8k_test.jsonl``; ids keep GSM8K's row number."""
    if n <= 0:
        return []
    path = resolve_data_dir(data_dir) / GSM8K_FILE
    if not path.is_file():
        raise DataError(
            f"the GSM8K slice needs {GSM8K_FILE} (looked in {path}); run `retool data fetch gsm8k`, "
            "pass --data-dir DIR or --gsm8k 0"
        )
    rows = read_jsonl_objects(path)
    if n > len(rows):
        raise DataError(f"--gsm8k {n}: {path} has only {len(rows)} problems")
    picked = sorted(random.Random(f"retool-gsm8k/{seed}").sample(range(len(rows)), n))
    return [
        Problem(
            id=f"gsm8k-{rows[i].get('idx', i)}",
            question=str(rows[i]["question"]),
            answer=gsm8k_answer(str(rows[i]["answer"])),
            data_source=GSM8K_SOURCE,
        )
        for i in picked
    ]


TRAIN_FILE = "gsm8k_train.jsonl"
SPLIT_FILES = {"train": TRAIN_FILE, "test": GSM8K_FILE}


class GSM8KLeakError(DataError):
    """A training problem is also a GSM8K test question (after normalisation)."""


def normalize_question(text: str) -> str:
    """Lower case, whitespace collapsed, punctuation dropped: two copies of one question compare equal."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def gsm8k_split(split: str, data_dir: str | Path | None) -> list[Problem]:
    """Every problem of GSM8K's ``train`` or ``test`` file, in file order; ids ``gsm8k-<split>-<row>``."""
    if split not in SPLIT_FILES:
        raise DataError(f"GSM8K has splits {sorted(SPLIT_FILES)}, not {split!r}")
    path = resolve_data_dir(data_dir) / SPLIT_FILES[split]
    if not path.is_file():
        raise DataError(
            f"GSM8K {split} needs {SPLIT_FILES[split]} (looked in {path}); run `retool data fetch gsm8k` "
            "or set data.data_dir"
        )
    problems = []
    for i, row in enumerate(read_jsonl_objects(path)):
        try:
            answer = gsm8k_answer(str(row["answer"]))
            question = str(row["question"])
        except (KeyError, ValueError) as exc:
            raise DataError(f"{path}: row {i + 1} is not a GSM8K problem ({exc})") from None
        problems.append(Problem(f"gsm8k-{split}-{row.get('idx', i)}", question, answer, GSM8K_SOURCE))
    return problems


def overlapping_ids(train: Sequence[Problem], test: Sequence[Problem]) -> list[str]:
    """Ids of the ``train`` problems whose normalised question is also a ``test`` question."""
    held_out = {normalize_question(p.question) for p in test}
    return [p.id for p in train if normalize_question(p.question) in held_out]


def check_no_test_leak(train: Sequence[Problem], test: Sequence[Problem]) -> None:
    """Raise ``GSM8KLeakError`` naming the first leaked ids when a train problem is a test question."""
    leaked = overlapping_ids(train, test)
    if leaked:
        raise GSM8KLeakError(
            f"{len(leaked)} training problem(s) are GSM8K test questions (normalised): "
            f"{', '.join(leaked[:5])}{' ...' if len(leaked) > 5 else ''}; a test question is never trained on"
        )
