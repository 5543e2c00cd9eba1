"""tools/demo_speed.py: the digests of a demo's results table ignore the timings a rerun changes; the rows
evaluated before RL have a digest of their own; the table says whether every run printed the same."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import demo_speed as bench

RESULTS = (
    "| model | mode | Average@N |\n|---|---|---|\n| sft | retool | 62.0% |\n| rl | retool | 93.2% |\n"
    "\nRL over SFT: +31.2 points\n"
)
TIMINGS = "\n| phase | wall s |\n|---|---|\n| sft | {} |\n"


def _row(folder: Path, results: str, sft_seconds: int) -> dict[str, object]:
    folder.mkdir(parents=True)
    (folder / "report.md").write_text(results + TIMINGS.format(sft_seconds))
    return {
        "revision": folder.name,
        "wall_s": 61.0,
        "cpu_percent": 180,
        "peak_rss_mb": 900,
        "load_before": 0.1,
        "load_after": 1.9,
        "results": bench.results_digest(folder / "report.md"),
        "before_rl": bench.results_digest(folder / "report.md", before_rl=True),
    }


def test_the_digests_read_the_results_and_not_the_timings(tmp_path: Path) -> None:
    a = _row(tmp_path / "a", RESULTS, 113)
    b = _row(tmp_path / "b", RESULTS, 140)
    rl = _row(tmp_path / "c", RESULTS.replace("93.2%", "93.3%"), 113)
    sft = _row(tmp_path / "d", RESULTS.replace("62.0%", "62.5%"), 113)
    assert a["results"] == b["results"] != rl["results"]
    assert a["before_rl"] == b["before_rl"] == rl["before_rl"] != sft["before_rl"]
    assert bench.results_digest(tmp_path / "missing.md") is None
    tail = "(report.md before its timings): {}."
    assert bench.table([a, b]).endswith(
        "before RL (base, SFT): yes; the same whole results table " + tail.format("yes")
    )
    assert bench.table([a, rl]).endswith(
        "before RL (base, SFT): yes; the same whole results table " + tail.format("no")
    )
    assert "before RL (base, SFT): no;" in bench.table([a, sft])
