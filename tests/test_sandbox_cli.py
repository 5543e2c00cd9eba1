"""``retool sandbox exec`` and ``retool sandbox check``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from retool.cli import app
from retool.sandbox import strict_support

KEYS = {"ok", "stdout", "stderr", "returncode", "timed_out", "latency", "status"}
STRICT_OK, STRICT_WHY = strict_support()


def _json_line(output: str) -> dict:
    lines = [ln for ln in output.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, output
    return json.loads(lines[0])


def test_exec_subprocess_prints_one_json_line():
    result = CliRunner().invoke(
        app, ["sandbox", "exec", "--backend", "subprocess", "--timeout", "5"], input="print('hi')\n1/0\n"
    )
    assert result.exit_code == 0, result.output
    d = _json_line(result.stdout)
    assert set(d) == KEYS
    assert d["ok"] is False and d["stdout"] == "hi\n" and "ZeroDivisionError" in d["stderr"]
    assert d["returncode"] == 1 and d["timed_out"] is False and d["latency"] > 0
    assert d["status"] == "error"


def test_exec_rejects_unknown_backend():
    result = CliRunner().invoke(app, ["sandbox", "exec", "--backend", "docker"], input="print(1)")
    assert result.exit_code == 2
    assert "invalid sandbox options" in result.output


@pytest.mark.bwrap
@pytest.mark.skipif(not STRICT_OK, reason=f"strict sandbox unavailable here: {STRICT_WHY}")
def test_exec_forkserver_strict_timeout_and_check():
    runner = CliRunner()
    result = runner.invoke(
        app, ["sandbox", "exec", "--timeout", "1", "--memory-mb", "512"], input="import time\ntime.sleep(9)"
    )
    assert result.exit_code == 0, result.output
    d = _json_line(result.stdout)
    assert set(d) == KEYS and d["timed_out"] is True and d["returncode"] is None and d["latency"] < 5
    assert d["status"] == "timeout"

    result = runner.invoke(app, ["sandbox", "check"])
    assert result.exit_code == 0, result.output
    assert "active profile: strict" in result.output
    feature_lines = [ln for ln in result.output.splitlines() if ln.strip().startswith("[")]
    assert len(feature_lines) == 11 + 5  # isolation features, then the five default pre-imports
    assert all(ln.strip().startswith("[x]") for ln in feature_lines), result.output
    for module in ("math", "fractions", "itertools", "numpy", "sympy"):
        assert f"import {module}" in result.output


def test_exec_sandboxfusion_against_fake_service():
    from test_sandbox_sandboxfusion import FakeSandboxFusion

    fake = FakeSandboxFusion()
    try:
        result = CliRunner().invoke(
            app, ["sandbox", "exec", "--backend", "sandboxfusion", "--url", fake.url], input="print(1)"
        )
    finally:
        fake.close()
    assert result.exit_code == 0, result.output
    d = _json_line(result.stdout)
    assert set(d) == KEYS and d["ok"] is True and d["stdout"] == "1\n"
    assert fake.requests[0]["code"] == "print(1)"
