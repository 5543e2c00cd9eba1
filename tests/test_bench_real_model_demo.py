"""bench/real_model_demo.py --precisions: each dtype's demo gain side by side, and whether the bf16 gain
lies within the fp32 gain's interval (finished runs read back, never run here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import real_model_demo as bench


def _run(folder: Path, gain: float, lo: float, hi: float) -> Path:
    folder.mkdir(parents=True)
    report = {"gain": {"average_at_n": {"gain": gain, "ci95": [lo, hi], "problems": 130}}}
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def test_precision_lines_compare_each_gain_with_the_first_ones_interval(tmp_path: Path) -> None:
    runs = {
        "float32": _run(tmp_path / "f", 0.488, 0.412, 0.562),
        "bfloat16": _run(tmp_path / "b", 0.45, 0.37, 0.53),
    }
    text = bench.precision_lines(runs, {"float32": 1200.0, "bfloat16": None})
    assert "| float32 | +48.8 points | +41.2 to +56.2 | 130 | 20.0 min |" in text
    assert "bfloat16's gain lies within the float32 gain's interval; difference -3.8 points." in text
    runs["bfloat16"] = _run(tmp_path / "b2", 0.2, 0.1, 0.3)
    assert "lies outside" in bench.precision_lines(runs, {})
