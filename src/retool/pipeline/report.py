"""The demo's report: per-difficulty numbers from eval records, the before/after table, the RL gain with
its paired bootstrap interval, ``report.md`` / ``report.json``, and plots through ``retool.analyze``."""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, cast

from retool.analyze import analyze
from retool.data.gsm8k import GSM8K_SOURCE
from retool.data.mathematics import SOURCE_PREFIX as MATHEMATICS_PREFIX
from retool.data.synthetic import parse_source
from retool.evaluate.metrics import PairedGain, paired_gain
from retool.evaluate.store import CandidateRecord, EvalSummary, ProblemRecord, read_problem_records
from retool.jsonl import JsonObject, JsonValue

logger = logging.getLogger(__name__)

FlatSummary = dict[str, JsonValue]  # an eval's metrics and its per-difficulty numbers (``flat_summary``)
Evals = dict[str, dict[str, FlatSummary]]  # {"sft" | "rl": {mode: flat summary}}
TableRow = dict[str, JsonValue]  # model, mode, problems and the table's columns


class DemoGain(TypedDict, total=False):
    """RL over SFT on the same held-out problems (``demo_gain``)."""

    mode: str
    average_at_n: PairedGain
    easy_accuracy: PairedGain
    hard_accuracy: PairedGain
    interpolate_accuracy: PairedGain  # DeepMind Mathematics' two test splits
    extrapolate_accuracy: PairedGain


def difficulty_breakdown(records_path: Path) -> dict[str, float]:
    """Accuracy / tool-call rate / format rate on easy vs hard synthetic problems, on GSM8K, and on DeepMind
    Mathematics' interpolate and extrapolate questions, from an eval's JSONL."""
    buckets: dict[str, list[CandidateRecord]] = {
        "easy": [],
        "hard": [],
        "gsm8k": [],
        "interpolate": [],
        "extrapolate": [],
    }
    for rec in read_problem_records(records_path):
        source = str(rec.get("data_source", ""))
        parsed = parse_source(source)
        split = str(rec["id"]).split("-")[1] if source.startswith(MATHEMATICS_PREFIX) else ""
        if parsed is not None:
            buckets["hard" if parsed[1] else "easy"].extend(rec.get("candidates", []))
        elif source == GSM8K_SOURCE:
            buckets["gsm8k"].extend(rec.get("candidates", []))
        elif split in ("interpolate", "extrapolate"):
            buckets[split].extend(rec.get("candidates", []))
    out: dict[str, float] = {}
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
# Shown when the held-out set has GSM8K problems (real models): accuracy and valid-call rate there, and
# the share of all samples with at least one well-formed call.
GSM8K_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("tool_call_rate", "Valid call", "pct"),
    ("gsm8k_accuracy", "Acc GSM8K", "pct"),
    ("gsm8k_tool_call_rate", "Call GSM8K", "pct"),
)


# Shown when the held-out set is DeepMind Mathematics: accuracy and tool use on each test split.
MATHEMATICS_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("tool_call_rate", "Valid call", "pct"),
    ("interpolate_accuracy", "Acc interpolate", "pct"),
    ("extrapolate_accuracy", "Acc extrapolate", "pct"),
    ("interpolate_tool_call_rate", "Call interpolate", "pct"),
    ("extrapolate_tool_call_rate", "Call extrapolate", "pct"),
)


def _columns(rows: Sequence[TableRow]) -> tuple[tuple[str, str, str], ...]:
    if any(row.get("interpolate_candidates") or row.get("extrapolate_candidates") for row in rows):
        return (
            tuple(c for c in TABLE_COLUMNS if c[0].split("_")[0] not in ("easy", "hard"))
            + MATHEMATICS_COLUMNS
        )
    with_gsm8k = any(row.get("gsm8k_candidates") for row in rows)
    base = TABLE_COLUMNS
    if (
        with_gsm8k
    ):  # a difficulty with nothing held out (a real model's hard-only or GSM8K-only set) is left out
        absent = [d for d in ("easy", "hard") if not any(row.get(f"{d}_candidates") for row in rows)]
        base = tuple(c for c in TABLE_COLUMNS if c[0].split("_")[0] not in absent)
    return base + GSM8K_COLUMNS if with_gsm8k else base


def table_rows(evals: Evals) -> list[TableRow]:
    rows: list[TableRow] = []
    keys = [key for key, _, _ in TABLE_COLUMNS + GSM8K_COLUMNS + MATHEMATICS_COLUMNS]
    keys += ["easy_candidates", "hard_candidates", "gsm8k_candidates", "interpolate_candidates"]
    keys += ["extrapolate_candidates"]
    for stage, by_mode in evals.items():
        for mode, summary in by_mode.items():
            row: TableRow = {"model": stage, "mode": mode, "problems": summary.get("problems")}
            row.update({key: summary.get(key) for key in keys})
            rows.append(row)
    return rows


def markdown_table(rows: Sequence[TableRow]) -> str:
    columns = _columns(rows)
    header = ["model", "mode"] + [title for _, title, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row["model"]), str(row["mode"])]
        for key, _, kind in columns:
            v = row.get(key)
            cells.append("-" if v is None else _cell(v, kind))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: JsonValue, kind: str) -> str:
    if not isinstance(value, int | float):
        raise TypeError(f"a table cell must be a number, not {type(value).__name__}")
    return f"{100 * value:.1f}%" if kind == "pct" else f"{value:.2f}"


def flat_summary(summary: EvalSummary, records_path: Path) -> FlatSummary:
    """An eval's metrics, flat, next to its per-difficulty numbers (what the table and report show)."""
    # A summary without "metrics" is taken as flat already.
    flat = dict(summary["metrics"] if "metrics" in summary else cast(FlatSummary, summary))
    flat.update(difficulty_breakdown(records_path))
    return flat


def demo_gain(eval_dir: Path, mode: str = "retool") -> DemoGain:
    """RL minus SFT on the same held-out problems: Average@N with its paired 95% bootstrap interval, and
    the accuracy change on easy and hard problems."""

    def records(label: str) -> list[ProblemRecord]:
        path = eval_dir / f"{label}_{mode}.jsonl"
        return read_problem_records(path)

    sft, rl = records("sft"), records("rl")
    out: DemoGain = {"mode": mode, "average_at_n": paired_gain(sft, rl, seed=0)}
    for hard in (False, True):

        def subset(rows: list[ProblemRecord], hard: bool = hard) -> list[ProblemRecord]:
            return [r for r in rows if (parse_source(str(r.get("data_source", ""))) or ("", None))[1] is hard]

        if subset(sft):
            out["hard_accuracy" if hard else "easy_accuracy"] = paired_gain(subset(sft), subset(rl), seed=0)
    for split in ("interpolate", "extrapolate"):
        prefix = f"mathematics-{split}-"
        before = [r for r in sft if str(r["id"]).startswith(prefix)]
        after = [r for r in rl if str(r["id"]).startswith(prefix)]
        if before:
            out[f"{split}_accuracy"] = paired_gain(before, after, seed=0)  # type: ignore[literal-required]
    return out


@dataclass
class DemoResult:
    out: Path
    table: list[TableRow] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sft: JsonObject = field(default_factory=dict)  # the SFT report (``SFTReport.as_dict``)
    plots: list[str] = field(default_factory=list)
    gain: DemoGain = field(default_factory=lambda: DemoGain())  # RL over SFT, retool mode (see ``demo_gain``)
    # Per phase: sampled / trained tokens and seconds of the backend, sandbox execution seconds.
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    machine: JsonObject = field(default_factory=dict)  # see ``machine_facts``


def write_report(out: Path, settings: JsonObject, result: DemoResult, evals: Evals) -> None:
    """``report.json`` (settings, table, gain, timings, SFT report, every eval) and ``report.md``."""
    report_json = {
        "settings": settings,
        "table": result.table,
        "gain": result.gain,
        "timings": result.timings,
        "throughput": result.throughput,
        "machine": result.machine,
        "sft": result.sft,
        "evals": evals,
    }
    (out / "report.json").write_text(json.dumps(report_json, indent=2, default=str) + "\n")
    parts = [markdown_table(result.table), gain_line(result.gain)]
    if result.throughput:
        parts.append(time_split_markdown(result.timings, result.throughput))
    (out / "report.md").write_text("\n\n".join(parts) + "\n")


def time_split_markdown(timings: dict[str, float], throughput: dict[str, dict[str, float]]) -> str:
    """Per phase: wall seconds, and the backend's sampling / training seconds, tokens and tokens/s (with
    the prompts' share of sampling: prefill seconds, and prompt tokens run per sampled token, which the
    prefix cache lowers), and the sandbox's execution seconds (the sandbox runs beside sampling, so the
    parts may overlap)."""
    lines = [
        "| phase | wall s | sampling s | prefill s | sampled tok | tok/s | prefilled / sampled | training s "
        "| trained tok | tok/s | exec s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total: dict[str, float] = {}
    for phase, seconds in timings.items():
        if phase in ("total", "rl_share"):
            continue
        w = throughput.get(phase, {})
        for k, v in w.items():
            total[k] = total.get(k, 0.0) + v
        lines.append(_split_row(phase, seconds, w))
    lines.append(_split_row("**total**", timings.get("total", 0.0), total))
    return "\n".join(lines)


def _split_row(name: str, seconds: float, w: dict[str, float]) -> str:
    def rate(tokens: str, secs: str) -> str:
        return f"{w[tokens] / w[secs]:.1f}" if w.get(secs) else "-"

    def num(key: str, fmt: str = "{:.0f}") -> str:
        return fmt.format(w[key]) if w.get(key) else "-"

    # "-" too for a phase recorded before prefill was counted (a run resumed across versions).
    prefilled = (
        f"{w['prefill_tokens'] / w['sampled_tokens']:.2f}"
        if w.get("sampled_tokens") and "prefill_tokens" in w
        else "-"
    )
    return (
        f"| {name} | {seconds:.0f} | {num('sample_seconds')} | {num('prefill_seconds')} | {num('sampled_tokens')} | "
        f"{rate('sampled_tokens', 'sample_seconds')} | {prefilled} | {num('train_seconds')} | "
        f"{num('trained_tokens')} | {rate('trained_tokens', 'train_seconds')} | {num('exec_seconds', '{:.1f}')} |"
    )


def machine_facts() -> JsonObject:
    """What the run's numbers depend on: CPUs, memory, torch, peak memory of this process and its
    children (sandbox, verifier), and the load average when the report was written."""
    import torch  # deferred: torch (~2 s); the CLI imports this module for every command

    facts: JsonObject = {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # ru_maxrss is in KiB on Linux
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "children_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
    }
    try:
        facts["load_average"] = [round(x, 2) for x in os.getloadavg()]
        with open("/proc/meminfo", encoding="ascii") as fh:
            facts["memory_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            names = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        if names:
            facts["cpu"] = names[0]
    except OSError:
        pass
    return facts


def gain_line(gain: DemoGain) -> str:
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
    for split in ("interpolate", "extrapolate"):
        part = gain.get(f"{split}_accuracy")
        if isinstance(part, dict):
            lo, hi = part["ci95"]
            text += f"; {split} {100 * part['gain']:+.1f} points (CI {100 * lo:+.1f} to {100 * hi:+.1f})"
    return text + "."


def make_plots(out: Path) -> list[str]:
    """Comparison table + plots through ``retool.analyze`` (evals and the RL metrics log)."""
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
