"""The demo's progress printer (``retool.pipeline.cli.Printer``): the ETA of a bar whose items run concurrently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retool.pipeline import cli


def test_eta_reads_the_rate_after_the_first_item_not_its_latency(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """100 problems, 10 at a time, each taking 60 s: the first finishes at 60 s, then one every 6 s. The
    rate since the bar started would say 99 minutes left at the first; the estimate waits for a second
    item and reads the rate since the first: 6 s a problem x the problems left."""
    clock = [0.0]
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    printer = cli.Printer()
    clock[0] = 60.0
    printer.bar("eval/sft", 1, 100, "eval sft retool")
    assert capsys.readouterr().err.strip().endswith("1/100 eta ...")
    clock[0] = 66.0
    assert printer._eta(clock[0], 2, 100) == "eta 9m48s"  # 6 s a problem x 98
    clock[0] = 120.0
    printer.bar("eval/sft", 11, 100, "eval sft retool")  # a line per 10% off a terminal
    assert capsys.readouterr().err.strip().endswith("11/100 eta 8m54s")  # (120 - 60) / 10 = 6 s x 89
    printer.bar("eval/rl", 1, 100, "eval rl retool")  # a new bar starts its own estimate
    assert capsys.readouterr().err.strip().endswith("1/100 eta ...")


def test_the_demo_turns_transformers_progress_bars_off(tiny_model_dir: Path) -> None:
    """Every phase loads or saves a model: transformers' own bars would land between the demo's lines. A
    fresh process, as ``retool demo`` starts: transformers not yet imported when the bars are turned off."""
    script = (
        "import sys; from retool.pipeline.cli import quiet_library_progress; quiet_library_progress(); "
        "assert 'transformers' not in sys.modules; from transformers import AutoModelForCausalLM; "
        f"AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})"
    )
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "Loading weights" not in quiet.stderr
    loud = script.replace("quiet_library_progress(); ", "")
    shown = subprocess.run([sys.executable, "-c", loud], capture_output=True, text=True, check=True)
    assert "Loading weights" in shown.stderr  # the check sees the bar where nothing turns it off
