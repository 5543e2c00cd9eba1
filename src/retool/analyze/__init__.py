"""retool.analyze: compare evals (checkpoints x modes) and training runs; tables and PNG plots.

``analyze(files, out_dir)`` writes ``comparison.md``, ``comparison.csv`` (checkpoints x modes),
``evals.csv`` (one row per eval, every metric), and the plots of ``retool.analyze.plots``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from retool.analyze.plots import plot_evals, plot_training
from retool.analyze.report import (
    LONG_COLUMNS,
    AnalyzeError,
    EvalResult,
    TrainingLog,
    compare_settings,
    load_inputs,
    long_rows,
    markdown_report,
    pivot,
    write_csv,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AnalyzeError",
    "AnalyzeResult",
    "EvalResult",
    "TrainingLog",
    "analyze",
    "compare_settings",
    "load_inputs",
]


@dataclass
class AnalyzeResult:
    evals: list[EvalResult]
    logs: list[TrainingLog]
    warnings: list[str]
    table_markdown: str
    files: list[Path] = field(default_factory=list)


def analyze(paths: list[Path], out_dir: Path, *, plots: bool = True) -> AnalyzeResult:
    """Load ``paths``, compare settings (warnings are logged and returned), write tables and plots."""
    evals, logs = load_inputs([Path(p) for p in paths])
    if not evals and not logs:
        raise AnalyzeError("nothing to analyse")
    warnings = compare_settings(evals)
    for w in warnings:
        logger.warning("%s", w)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    report = markdown_report(evals, logs, warnings)
    (out_dir / "comparison.md").write_text(report, encoding="utf-8")
    files.append(out_dir / "comparison.md")
    if evals:
        _, _, pivot_rows = pivot(evals)
        write_csv(out_dir / "comparison.csv", pivot_rows)
        write_csv(out_dir / "evals.csv", long_rows(evals), list(LONG_COLUMNS))
        files += [out_dir / "comparison.csv", out_dir / "evals.csv"]
    if plots:
        files += plot_evals(evals, out_dir)
        files += plot_training(logs, out_dir)
    return AnalyzeResult(evals=evals, logs=logs, warnings=warnings, table_markdown=report, files=files)
