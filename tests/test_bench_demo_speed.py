"""bench/demo_speed.py: the digest of a demo's results table (what a before/after pair of source trees must
print alike) ignores the timings a rerun changes, and the table says whether every run printed the same."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import demo_speed as bench

RESULTS = (
    "| model | mode | Average@N |\n|---|---|---|\n| rl | retool | 93.2% |\n\nRL over SFT: +31.2 points\n"
)
TIMINGS = "\n| phase | wall s |\n|---|---|\n| sft | {} |\n"


def _row(folder: Path, results: str, sft_seconds: int) -> dict[str, object]:
    folder.mkdir(parents=True)
    (folder / "report.md").write_text(results + TIMINGS.format(sft_seconds))
    digest = bench.results_digest(folder / "report.md")
    return {
        "revision": folder.name,
        "wall_s": 61.0,
        "cpu_percent": 180,
        "peak_rss_mb": 900,
        "load_before": 0.1,
        "load_after": 1.9,
        "results": digest,
    }


def test_the_digest_reads_the_results_and_not_the_timings(tmp_path: Path) -> None:
    a = _row(tmp_path / "a", RESULTS, 113)
    b = _row(tmp_path / "b", RESULTS, 140)
    c = _row(tmp_path / "c", RESULTS.replace("93.2%", "93.3%"), 113)
    assert a["results"] == b["results"] != c["results"]
    assert bench.results_digest(tmp_path / "missing.md") is None
    assert bench.table([a, b]).endswith("same results table (report.md before its timings): yes.")
    assert bench.table([a, c]).endswith("same results table (report.md before its timings): no.")
