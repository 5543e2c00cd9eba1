"""`retool demo` / `retool sft` command wiring: registered, documented, bad input fails clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.cli import app
from retool.pipeline.settings import DemoSettings
from retool.recipes.tiny import SyntheticOptions


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


def test_sft_flags_set_the_synthetic_sources_options_and_the_recipes_styles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tasks`` sizes the synthetic source (``[data.options]``), ``--hard-tool`` / ``--hard-error-fix`` set
    the tiny recipe's cold-start styles (its options): neither is a key of ``Config``'s own."""
    import retool.recipes.cli as recipes_cli

    seen: list[DemoSettings] = []

    def fake_run_sft(settings: DemoSettings, base: object, **_: object) -> dict[str, object]:
        seen.append(settings)
        return {}

    monkeypatch.setattr(recipes_cli, "run_sft", fake_run_sft)
    flags = ["--tasks", "50", "--hard-tool", "0.5", "--hard-error-fix", "0.2"]
    result = CliRunner().invoke(app, ["sft", "--out", str(tmp_path / "o"), *flags])
    assert result.exit_code == 0, result.output
    (settings,) = seen
    options = settings.options
    assert isinstance(options, SyntheticOptions)
    assert (options.hard_tool, options.hard_error_fix) == (0.5, 0.2)
    assert options.easy_tool == 0.3  # the rest from the demo-tiny preset's [recipe] table
    assert settings.config.data.options["count"] == 50
    assert "hard_tool" not in settings.config.sft.model_dump()
