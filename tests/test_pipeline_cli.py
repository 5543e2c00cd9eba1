"""`retool demo` / `retool sft` command wiring: registered, documented, bad input fails clearly."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from retool.cli import app


def test_commands_are_registered() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "sft" in result.output


def test_sft_rejects_a_missing_model_folder(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["sft", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "no such folder" in result.output
    assert not (tmp_path / "o").exists()


def test_demo_refuses_to_overwrite_a_finished_run(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    (out / "rl").mkdir(parents=True)
    result = CliRunner().invoke(app, ["demo", "--out", str(out)])
    assert result.exit_code == 2
    assert "already holds a demo run" in result.output
