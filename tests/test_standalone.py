"""The repository stands alone: a clone in an empty folder (no ``../shared``, no ``$RETOOL_DATA_DIR``, an
empty user cache) passes the data-dependent tests from the fixtures in ``tests/data`` alone, none skipped.

The data-dependent tests are the files that use the ``fixture_data`` or ``qwen_tokenizers`` fixtures; the
clone runs their fast part (``-m "not slow"``) with its own ``src`` first on the path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_USES_DATA = re.compile(r"\b(fixture_data|qwen_tokenizers)\b")


def data_test_files() -> list[str]:
    here = Path(__file__).name
    return sorted(
        f"tests/{p.name}"
        for p in (REPO / "tests").glob("test_*.py")
        if p.name != here and _USES_DATA.search(p.read_text(encoding="utf-8"))
    )


def _clone(into: Path) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone from")
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    clone = into / "retool-rl"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    return clone


def _bare_env(clone: Path, cache: Path) -> dict[str, str]:
    """A new user's environment: no data folder variables, an empty cache for retool's data (the Hugging
    Face cache stays where it was: models and tokenizers are not data), the clone's own ``src``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RETOOL_DATA_DIR", "RETOOL_SHARED_DATA")}
    env.setdefault(
        "HF_HOME", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface")
    )
    env["XDG_CACHE_HOME"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(clone / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_data_tests_are_found() -> None:
    files = data_test_files()
    assert "tests/test_env_gsm8k.py" in files and "tests/test_protocol_chat.py" in files


@pytest.mark.slow
def test_a_clone_with_nothing_beside_it_passes_the_data_tests(tmp_path: Path) -> None:
    clone = _clone(tmp_path / "empty")
    assert sorted(p.name for p in clone.parent.iterdir()) == ["retool-rl"]  # no ../shared beside it
    env = _bare_env(clone, tmp_path / "cache")
    where = subprocess.run(
        [sys.executable, "-c", "import retool; print(retool.__file__)"],
        cwd=clone,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(clone), where
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            *data_test_files(),
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, run.stdout[-4000:]
