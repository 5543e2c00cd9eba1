"""GSM8K's test split as held-out problems: a seeded slice read from a local ``gsm8k_test.jsonl``.

A real benchmark the demo adds to its held-out set for real models and never trains on. The file is the
Hugging Face ``openai/gsm8k`` test split as JSONL (``question``, ``answer`` ending in ``#### <number>``,
optionally ``idx``); it is found in ``$RETOOL_DATA_DIR``, ``../shared/data`` or ``data``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from retool.data.problem import Problem
from retool.data.readers import DataError
from retool.jsonl import read_jsonl_objects

GSM8K_FILE = "gsm8k_test.jsonl"
GSM8K_SOURCE = "gsm8k"


def default_data_dir() -> Path | None:
    """``$RETOOL_DATA_DIR``, else ``../shared/data`` or ``data`` when one holds the GSM8K file."""
    env = os.environ.get("RETOOL_DATA_DIR")
    if env:
        return Path(env)
    for folder in (Path("../shared/data"), Path("data")):
        if (folder / GSM8K_FILE).is_file():
            return folder
    return None


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
    folder = Path(data_dir) if data_dir is not None else default_data_dir()
    path = folder / GSM8K_FILE if folder is not None else None
    if path is None or not path.is_file():
        raise DataError(
            f"the GSM8K slice needs {GSM8K_FILE} (looked in {path or '$RETOOL_DATA_DIR, ../shared/data, data'}); "
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
