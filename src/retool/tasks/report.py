"""The demo's report: per-difficulty numbers from eval records, the before/after table, the RL gain with
its paired bootstrap interval, ``report.md`` / ``report.json``, and plots through ``retool.analyze``."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retool.data.synthetic import parse_source

logger = logging.getLogger(__name__)

Evals = dict[str, dict[str, dict[str, Any]]]  # {"sft" | "rl": {mode: flat summary}}


def difficulty_breakdown(records_path: Path) -> dict[str, Any]:
    """Accuracy / tool-call rate / format rate on easy vs hard problems, from an eval's JSONL."""
    buckets: dict[str, list[dict[str, Any]]] = {"easy": [], "hard": []}
    with records_path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            parsed = parse_source(str(rec.get("data_source", "")))
            if parsed is None:
                continue
            buckets["hard" if parsed[1] else "easy"].extend(rec.get("candidates", []))
    out: dict[str, Any] = {}
    for name, cands in buckets.items():
        n = len(cands)
        out[f"{name}_candidates"] = n
        out[f"{name}_accuracy"] = sum(bool(c["correct"]) for c in cands) / n if n else 0.0
        out[f"{name}_tool_call_rate"] = sum(int(c["code_calls"]) > 0 for c in cands) / n if n else 0.0
        out[f"{name}_format_rate"] = sum(bool(c["valid_format"]) for c in cands) / n if n else 0.0
    return out


TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("average_at_n", "Average@N", "pct"),
    ("pass_at_n", "Pass@N", "pct"),
    ("format_rate", "Format", "pct"),
    ("mean_code_calls", "Code calls", "num"),
    ("easy_accuracy", "Acc easy", "pct"),
    ("hard_accuracy", "Acc hard", "pct"),
    ("easy_tool_call_rate", "Tool easy", "pct"),
    ("hard_tool_call_rate", "Tool hard", "pct"),
)


def table_rows(evals: Evals) -> list[dict[str, Any]]:
    rows = []
    for stage, by_mode in evals.items():
        for mode, summary in by_mode.items():
            row: dict[str, Any] = {"model": stage, "mode": mode}
            row.update({key: summary.get(key) for key, _, _ in TABLE_COLUMNS})
            rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ["model", "mode"] + [title for _, title, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["model"]), str(row["mode"])]
        for key, _, kind in TABLE_COLUMNS:
            v = row.get(key)
            cells.append("-" if v is None else (f"{100 * v:.1f}%" if kind == "pct" else f"{v:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flat_summary(summary: dict[str, Any], records_path: Path) -> dict[str, Any]:
    """An eval's metrics, flat, next to its per-difficulty numbers (what the table and report show)."""
    flat = dict(summary.get("metrics", summary))
    flat.update(difficulty_breakdown(records_path))
    return flat


def demo_gain(eval_dir: Path, mode: str = "retool") -> dict[str, Any]:
    """RL minus SFT on the same held-out problems: Average@N with its paired 95% bootstrap interval, and
    the accuracy change on easy and hard problems."""
    from retool.evaluate.metrics import paired_gain

    def records(label: str) -> list[dict[str, Any]]:
        path = eval_dir / f"{label}_{mode}.jsonl"
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]

    sft, rl = records("sft"), records("rl")
    out: dict[str, Any] = {"mode": mode, "average_at_n": paired_gain(sft, rl, seed=0)}
    for name, hard in (("easy", False), ("hard", True)):

        def subset(rows: list[dict[str, Any]], hard: bool = hard) -> list[dict[str, Any]]:
            return [r for r in rows if (parse_source(str(r.get("data_source", ""))) or ("", None))[1] is hard]

        if subset(sft):
            out[f"{name}_accuracy"] = paired_gain(subset(sft), subset(rl), seed=0)
    return out


@dataclass
class DemoResult:
    out: Path
    table: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sft: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)
    gain: dict[str, Any] = field(default_factory=dict)  # RL over SFT, retool mode (see ``demo_gain``)


def write_report(out: Path, settings: dict[str, Any], result: DemoResult, evals: Evals) -> None:
    """``report.json`` (settings, table, gain, timings, SFT report, every eval) and ``report.md``."""
    report_json = {
        "settings": settings,
        "table": result.table,
        "gain": result.gain,
        "timings": result.timings,
        "sft": result.sft,
        "evals": evals,
    }
    (out / "report.json").write_text(json.dumps(report_json, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown_table(result.table) + "\n\n" + gain_line(result.gain) + "\n")


def gain_line(gain: dict[str, Any]) -> str:
    """One sentence: the RL gain with its interval (the demo's claim, as the report and CLI state it)."""
    if not gain:
        return ""
    avg = gain["average_at_n"]
    lo, hi = avg["ci95"]
    text = (
        f"RL over SFT ({gain['mode']} mode, {avg['problems']} held-out problems): Average@N "
        f"{100 * avg['gain']:+.1f} points (95% paired bootstrap CI {100 * lo:+.1f} to {100 * hi:+.1f})"
    )
    if "hard_accuracy" in gain:
        text += f"; hard problems {100 * gain['hard_accuracy']['gain']:+.1f} points"
    return text + "."


def make_plots(out: Path) -> list[str]:
    """Comparison table + plots through ``retool.analyze`` (evals and the RL metrics log)."""
    try:
        from retool.analyze import analyze
    except ImportError:
        logger.warning("retool.analyze not available: no plots")
        return []
    inputs = sorted((out / "eval").glob("*.jsonl"))
    metrics = out / "rl" / "metrics.jsonl"
    if metrics.exists():
        inputs.append(metrics)
    try:
        res = analyze(inputs, out / "analysis", plots=True)
    except Exception:  # plots are a by-product; never lose the run's numbers over them
        logger.exception("retool.analyze failed; the report files are still in %s", out)
        return []
    return [str(p) for p in res.files if str(p).endswith(".png")]
