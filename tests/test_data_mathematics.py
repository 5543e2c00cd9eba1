"""``retool data mathematics``: DeepMind Mathematics from its official generator, run unchanged in its own
environment (``.venv-mathematics``, built by ``scripts/setup_mathematics.sh``, which ``scripts/setup.sh
--dev`` runs). The generator tests need that environment: under CI they fail without it, elsewhere they skip
and say how to build it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retool.data.mathematics import (
    FILES,
    PROVENANCE_FILE,
    GeneratorMissing,
    build_mathematics,
    generator_python,
    read_split,
)
from retool.data.readers import DataError

REPO = Path(__file__).resolve().parents[1]


def _generator() -> Path:
    try:
        return generator_python()
    except GeneratorMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the generator's environment is not built: {exc}")


def test_a_missing_generator_environment_says_how_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RETOOL_MATHEMATICS_PYTHON", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setattr("retool.data.mathematics._checkout_root", lambda: tmp_path)
    with pytest.raises(GeneratorMissing, match=r"scripts/setup_mathematics\.sh"):
        generator_python()


def test_the_builder_writes_every_split_with_its_provenance_and_is_repeatable(tmp_path: Path) -> None:
    python = _generator()
    modules = ["arithmetic__mul", "arithmetic__mul_big", "numbers__is_prime", "algebra__polynomial_roots"]
    reports = [
        build_mathematics(
            tmp_path / name, train_per_module=3, test_per_module=2, seed=0, modules=modules, python=python
        )
        for name in ("a", "b")
    ]
    a, b = reports
    # arithmetic__mul_big exists only in extrapolate; the others in train and interpolate.
    assert a.counts["train"] == {"arithmetic__mul": 3, "numbers__is_prime": 3, "algebra__polynomial_roots": 3}
    assert a.counts["extrapolate"] == {"arithmetic__mul_big": 2}
    for split in FILES:
        assert (a.files[split]).read_bytes() == (b.files[split]).read_bytes()  # the same seed, the same rows
    provenance = json.loads((tmp_path / "a" / PROVENANCE_FILE).read_text())
    assert provenance["generator"]["mathematics-dataset"] == "1.0.1"
    assert provenance["sha256"]["train"] == hashlib.sha256(a.files["train"].read_bytes()).hexdigest()
    assert provenance["train_rows_dropped_as_test_questions"] == 0
    row = json.loads(a.files["interpolate"].read_text().splitlines()[0])
    assert set(row) == {"id", "question", "answer", "data_source", "module", "split"}
    assert row["data_source"] == "mathematics/" + row["module"]
    problems = read_split("interpolate", tmp_path / "a")
    assert [p.id for p in problems][:2] == [
        "mathematics-interpolate-algebra__polynomial_roots-1",
        "mathematics-interpolate-algebra__polynomial_roots-2",
    ]


def test_the_fixture_is_what_the_generator_makes(tmp_path: Path) -> None:
    """tests/data/mathematics came from the generator as SOURCES.md says: regenerated, the same rows."""
    python = _generator()
    modules = ["comparison__sort", "measurement__time", "numbers__round_number_big"]
    report = build_mathematics(
        tmp_path, train_per_module=2, test_per_module=2, seed=0, modules=modules, python=python
    )
    for split, path in report.files.items():
        fresh = [json.loads(line) for line in path.read_text().splitlines()]
        fixture = REPO / "tests" / "data" / "mathematics" / FILES[split]
        kept = [json.loads(line) for line in fixture.read_text().splitlines()]
        assert fresh == [r for r in kept if r["module"] in modules]


def test_unknown_modules_and_missing_files_are_one_clear_error(tmp_path: Path) -> None:
    python = _generator()
    with pytest.raises(DataError, match="unknown DeepMind Mathematics modules: nonesuch"):
        build_mathematics(
            tmp_path, train_per_module=1, test_per_module=1, modules=["nonesuch"], python=python
        )
    with pytest.raises(DataError, match="retool data mathematics"):
        read_split("train", tmp_path / "empty")


def _retool_data_mathematics(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "retool", "data", "mathematics", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)


def test_the_command_line(tmp_path: Path) -> None:
    python = str(_generator())
    done = _retool_data_mathematics(
        "--out",
        str(tmp_path),
        "--modules",
        "numbers__gcd",
        "--train-per-module",
        "2",
        "--test-per-module",
        "1",
        "--python",
        python,
    )
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout and "2 rows, 1 modules" in done.stdout
    assert "train rows dropped as test questions: 0" in done.stdout
    bad = _retool_data_mathematics("--out", str(tmp_path), "--modules", "x", "--python", python)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr


def _generators_writing_to(folder: Path) -> list[int]:
    """Pids of generator processes writing under ``folder`` (their ``--out`` is in the builder's temporary
    folder, which the test puts under ``folder`` with TMPDIR)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"generator.py") for part in cmd) and str(folder).encode() in b" ".join(cmd):
            pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_builder_leaves_no_generator_running(tmp_path: Path) -> None:
    import signal
    import time

    python = str(_generator())
    cmd = [sys.executable, "-m", "retool", "data", "mathematics", "--out", str(tmp_path / "data")]
    cmd += ["--train-per-module", "100000", "--test-per-module", "0", "--python", python]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the generators' temp folder: under tmp_path, to find them
    builder = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _generators_writing_to(tmp_path) and time.monotonic() < deadline:
            assert builder.poll() is None, "the builder stopped before its generator started"
            time.sleep(0.2)
        assert _generators_writing_to(tmp_path), "no generator started within 2 minutes"
    finally:
        builder.send_signal(signal.SIGKILL)  # no cleanup code of the builder's runs: the kernel's alone
        builder.wait()
    deadline = time.monotonic() + 30
    while _generators_writing_to(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _generators_writing_to(tmp_path)
    for pid in left:  # never leave one behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"generators still running after their builder was killed: {left}"
