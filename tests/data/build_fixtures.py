"""Rebuild the data fixtures of tests/data from whole copies of the datasets (see SOURCES.md).

    python tests/data/build_fixtures.py DIR   # DIR: a folder with the whole files and tokenizers/

Each JSONL fixture is the first rows of the whole file, unchanged; each tokenizer keeps the real chat
templates and tokenizer_config.json over the first ``MERGES`` merges of the real BPE (vocab.json: the 256
byte tokens and the token of each kept merge, under their real ids).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = {
    "aime2024.jsonl": 12,
    "aime2025.jsonl": 12,
    "math500.jsonl": 40,
    "gsm8k_test.jsonl": 40,
    "gsm8k_train.jsonl": 60,
    "dapo_math_sample.jsonl": 80,
}
TOKENIZERS = ("Qwen2.5-Instruct", "Qwen3", "Qwen3.5")
MERGES = 8000


def first_rows(src: Path, name: str, n: int) -> None:
    lines = [line for line in (src / name).read_text(encoding="utf-8").split("\n") if line.strip()]
    (HERE / name).write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")


def small_tokenizer(src: Path, name: str) -> None:
    out = HERE / "tokenizers" / name
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    kept = {token: i for token, i in vocab.items() if i < 256 + MERGES}  # merge r makes token 256 + r
    (out / "vocab.json").write_text(json.dumps(kept, ensure_ascii=False) + "\n", encoding="utf-8")
    merges = (src / "merges.txt").read_text(encoding="utf-8").split("\n")
    (out / "merges.txt").write_text("\n".join(merges[: MERGES + 1]) + "\n", encoding="utf-8")  # + header
    for path in src.iterdir():
        if path.name not in ("vocab.json", "merges.txt"):
            shutil.copyfile(path, out / path.name)


def main(src: Path) -> None:
    for name, n in ROWS.items():
        first_rows(src, name, n)
    for name in TOKENIZERS:
        small_tokenizer(src / "tokenizers" / name, name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
