"""Lint, format and type checks, run by the README's test command (and so by ``.ci/run``).

``ruff check`` and ``ruff format --check`` over the repository, and ``mypy`` over ``src/retool`` at its
default strictness (settings in ``pyproject.toml``; its cache in ``.mypy_cache/``, so a rerun takes
seconds). Each check fails with the tool's own output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 600) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}", pytrace=False)


def test_ruff_check() -> None:
    _run("ruff", "check", ".")


def test_ruff_format() -> None:
    _run("ruff", "format", "--check", ".")


def test_mypy() -> None:
    _run("mypy")  # files, strictness and cache dir: [tool.mypy] in pyproject.toml
