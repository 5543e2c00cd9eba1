"""bench/mathematics.py's report: its targets judged from the records (met only where the interval's lower
end is above 0; the extrapolation mean against the paper's 50%), and its cost lines (each demo, each
evaluation, the sum against the 2-hour budget)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import mathematics as bench


def _records(split: str, correct: list[bool]) -> list[Any]:
    """One record a question of one module of ``split``, its single greedy answer right or wrong."""
    return [
        {
            "id": f"mathematics-{split}-arithmetic__add_or_sub-{i}",
            "reference": "1",
            "data_source": "mathematics/arithmetic__add_or_sub",
            "candidates": [{"correct": ok, "answer": "1" if ok else "2", "code_calls": 1, "exec_errors": 0}],
            "n_correct": int(ok),
        }
        for i, ok in enumerate(correct)
    ]


def _model(interpolate: list[bool], extrapolate: list[bool]) -> list[Any]:
    return _records("interpolate", interpolate) + _records("extrapolate", extrapolate)


def test_targets_are_met_only_where_the_interval_clears_zero() -> None:
    n = 40
    none, all_ = [False] * n, [True] * n
    half = [i % 2 == 0 for i in range(n)]
    evals = {
        "sft": {"retool": _model(none, none), "text-only": _model(none, none)},
        # seed 0: every answer right with the tool, none without -> every gain clears 0, extrapolation 100%
        "rl-s0": {"retool": _model(all_, all_), "text-only": _model(none, none)},
        # seed 1: no change anywhere -> each interval is [0, 0], nothing met
        "rl-s1": {"retool": _model(none, half[:1] + none[1:]), "text-only": _model(none, none)},
    }
    lines = bench.targets(evals, [0, 1])
    seed0 = [line for line in lines if line.startswith("- seed 0")]
    seed1 = [line for line in lines if line.startswith("- seed 1")]
    assert len(seed0) == len(seed1) == 5  # 2 splits x 2 comparisons, and the extrapolation mean
    assert all(line.endswith("**met**") for line in seed0)
    assert all(line.endswith("**missed**") for line in seed1)
    assert "extrapolation mean 100.0%" in seed0[-1] and "50.0%" in seed0[-1]


def test_a_seed_without_an_rl_model_has_no_targets() -> None:
    evals = {"sft": {"retool": _model([False], [False])}}
    assert bench.targets(evals, [0]) == bench.targets({}, [])


def test_cost_lines_add_the_demos_and_the_evaluations_against_the_budget() -> None:
    demo = {
        "timings": {"sft": 600.0, "rl": 1200.0, "eval_base": 60.0, "eval_rl": 120.0, "total": 1980.0},
        "machine": {"peak_rss_gib": 6.5},
        "sft": {"conversion": {"kept": 13, "sampled": 224}},
        "settings": {},
    }
    reused = {
        "timings": {"rl": 1200.0, "total": 1200.0},
        "machine": {"peak_rss_gib": 4.0},
        "sft": {},
        "settings": {"reuse_sft": "runs/bench-mathematics/seed0"},
    }
    runs = {"base": {"seconds": 600.0, "peak_rss_gib": 3.0}, "sft": {"seconds": 900.0, "peak_rss_gib": 3.5}}
    text = bench.cost_lines({0: demo, 1: reused}, runs, 0)
    assert "| 0 | 33.0 min | 6.5 GiB | 10.0 min | 20.0 min | 3.0 min | 13 of 224 |" in text
    assert "| 1 | 20.0 min | 4.0 GiB | reused (seed0) |" in text
    assert "base 10.0 min, sft 15.0 min" in text
    assert "78 min, within its 120-minute budget" in text  # 33 + 20 + 10 + 15
    runs["rl-s0"] = {"seconds": 3600.0, "peak_rss_gib": 3.0}
    assert "138 min, over its 120-minute budget" in bench.cost_lines({0: demo, 1: reused}, runs, 0)


def test_the_readme_table_tallies_the_targets_it_is_given() -> None:
    evals = {
        "sft": {"text-only": _model([False] * 4, [False] * 4), "retool": _model([True] * 4, [False] * 4)}
    }
    lines = bench.compact_table(
        evals, ["Targets ...", "", "- seed 0, interpolate: A: +1.0 [+0.5, +2.0]: **met**"]
    )
    assert "| sft | 0.0% / 100.0% | 0.0% / 0.0% | 100.0% |" in lines
    assert lines[-1] == "Targets met: 1 of 1: seed 0, interpolate: A."
    assert bench.compact_table(evals, ["- x: +0.0 [+0.0, +0.0]: **missed**"])[-1] == "Targets met: 0 of 1."
