"""tools/same_results.py: the comparison of two source trees' figures finds the first difference, wherever it
lies, and says "identical" only when every figure is."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import same_results as bench

FIGURES = {
    "sft losses": [2.5, 1.25],
    "rl: synchronous": {"steps": [{"policy/loss": 0.5, "reward/mean": 0.0}], "rewards": [1.0, -1.0]},
}


def test_identical_figures_read_identical() -> None:
    copy = {
        "sft losses": [2.5, 1.25],
        "rl: synchronous": {"steps": [{"policy/loss": 0.5, "reward/mean": 0.0}], "rewards": [1.0, -1.0]},
    }
    assert bench.first_difference(FIGURES, copy) is None
    text = bench.report({"old": FIGURES, "new": copy})
    assert "| sft losses | 2 | yes |" in text and "| rl: synchronous | 4 | yes |" in text
    assert text.endswith("new against old: every figure identical.")


def test_the_first_difference_is_named_down_to_the_figure() -> None:
    changed = {
        **FIGURES,
        "rl: synchronous": {
            "steps": [{"policy/loss": 0.5000001, "reward/mean": 0.0}],
            "rewards": [1.0, -1.0],
        },
    }
    assert (
        bench.first_difference(FIGURES, changed) == "/rl: synchronous/steps[0]/policy/loss: 0.5 vs 0.5000001"
    )
    assert bench.first_difference([1, 2], [1]) == " (length 2 vs 1)"
    assert bench.first_difference({"a": 1}, {"b": 1}) == "/a (only in the first)"
    text = bench.report({"old": FIGURES, "new": changed})
    assert "| rl: synchronous | 4 | no: /steps[0]/policy/loss: 0.5 vs 0.5000001 |" in text
    assert text.endswith("new against old: they differ.")
