"""Loading eval results and training logs, comparing their settings, and writing the side-by-side table.

Inputs are what the other stages write: an eval's per-problem JSONL (with ``FILE.summary.json`` beside
it) or the summary itself, and a training run's ``metrics.jsonl`` (or its run folder). Rows of the table
are checkpoints, column groups are modes (text-only, retool), so the tool's gain and the training's gain
read off one table.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from retool.errors import UserError
from retool.evaluate.metrics import summarize
from retool.evaluate.settings import setting_value
from retool.evaluate.store import EvalSummary, ProblemRecord, summary_path_for
from retool.jsonl import JsonObject, JsonValue, as_list, as_number, first_jsonl_object, iter_jsonl

logger = logging.getLogger(__name__)

# Settings that must match for two evals to be comparable (mode, model and checkpoint are what is compared).
COMPARED_SETTINGS: tuple[str, ...] = (
    "dataset",
    "dataset_fingerprint",
    "problems",
    "val_n",
    "temperature",
    "top_p",
    "top_k",
    "budgets",
    "verifier",
)
# Only meaningful between evals that use the tool.
COMPARED_TOOL_SETTINGS: tuple[str, ...] = ("tool_format", "sandbox")
MODE_ORDER: tuple[str, ...] = ("text-only", "retool")


CsvRow = dict[str, JsonValue]  # one row of a comparison table, by column


class AnalyzeError(UserError, ValueError):
    """An input that cannot be analysed; the message names the file and the reason."""


@dataclass
class EvalResult:
    path: Path
    settings: JsonObject
    metrics: JsonObject
    status: str
    label: str = ""

    @property
    def mode(self) -> str:
        return str(self.settings.get("mode", "?"))


@dataclass
class TrainingLog:
    path: Path
    rows: list[dict[str, float]] = field(default_factory=list)
    label: str = ""


def _flatten(d: JsonObject, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        elif isinstance(value, int | float):  # bool included
            out[name] = float(value)
    return out


def load_training_log(path: Path) -> TrainingLog:
    rows: list[dict[str, float]] = []
    for obj in iter_jsonl(path, "warn"):
        if isinstance(obj, dict):
            row = _flatten(obj)
            row.setdefault("step", float(len(rows) + 1))
            rows.append(row)
    if not rows:
        raise AnalyzeError(f"{path}: no metrics lines")
    label = path.parent.name if path.name == "metrics.jsonl" else path.stem
    return TrainingLog(path=path, rows=rows, label=label)


def _read_records(path: Path) -> list[ProblemRecord]:
    """Eval records, read-only (analysis never repairs a file; a damaged line is skipped with a warning)."""
    records: dict[str, ProblemRecord] = {}
    for obj in iter_jsonl(path, "warn"):
        if isinstance(obj, dict) and "candidates" in obj:
            records.setdefault(str(obj.get("id")), cast(ProblemRecord, obj))
    return list(records.values())


def load_eval(path: Path) -> EvalResult:
    """An eval from its JSONL or its summary; metrics are recomputed from records when no summary has them."""
    summary: EvalSummary
    if path.name.endswith(".summary.json"):
        summary = json.loads(path.read_text(encoding="utf-8"))
        jsonl = Path(
            summary.get("output") or path.with_name(path.name.removesuffix(".summary.json") + ".jsonl")
        )
    else:
        jsonl = path
        spath = summary_path_for(path)
        summary = json.loads(spath.read_text(encoding="utf-8")) if spath.exists() else {}
    metrics = summary.get("metrics")
    status = str(summary.get("status", "unknown"))
    if not metrics:
        if not jsonl.exists():
            raise AnalyzeError(f"{path}: the summary has no metrics and {jsonl} does not exist")
        records = _read_records(jsonl)
        if not records:
            raise AnalyzeError(f"{path}: no finished problems to analyse")
        metrics = summarize(records)
        logger.warning("%s: no summary beside it; metrics recomputed from %d records", path, len(records))
    if status != "complete":
        logger.warning(
            "%s: eval is %s (%s/%s problems)",
            path,
            status,
            summary.get("completed", "?"),
            summary.get("total", "?"),
        )
    return EvalResult(path=path, settings=dict(summary.get("settings", {})), metrics=metrics, status=status)


def load_inputs(paths: list[Path]) -> tuple[list[EvalResult], list[TrainingLog]]:
    """Sort the given files (or folders) into evals and training logs."""
    evals: list[EvalResult] = []
    logs: list[TrainingLog] = []
    for path in paths:
        if path.is_dir():
            if (path / "metrics.jsonl").is_file():
                logs.append(load_training_log(path / "metrics.jsonl"))
                continue
            found = sorted(path.glob("*.summary.json"))
            if not found:
                raise AnalyzeError(f"{path}: a folder with neither metrics.jsonl nor *.summary.json")
            evals.extend(load_eval(p) for p in found)
            continue
        if not path.is_file():
            raise AnalyzeError(f"{path}: no such file")
        if path.name.endswith(".summary.json") or summary_path_for(path).exists():
            evals.append(load_eval(path))
            continue
        first = first_jsonl_object(path)
        if first is None:
            raise AnalyzeError(
                f"{path}: not an eval JSONL/summary or a metrics.jsonl (first line is not a JSON object)"
            )
        if "candidates" in first:
            evals.append(load_eval(path))
        else:
            logs.append(load_training_log(path))
    _assign_labels(evals)
    _dedupe_training_labels(logs)
    return evals, logs


# Path components that say nothing about which checkpoint it is (the train/backends layouts).
_GENERIC_PARTS = frozenset({"checkpoints", "backend", "state", "weights"})


def short_label(value: str) -> str:
    """``runs/r1/checkpoints/step_000050/backend`` -> ``r1/step_000050``; URIs and names stay readable."""
    parts = [p for p in str(value).replace("\\", "/").rstrip("/").split("/") if p]
    meaningful = [p for p in parts if p not in _GENERIC_PARTS] or parts
    return "/".join(meaningful[-2:]) if meaningful else str(value)


def _assign_labels(evals: list[EvalResult]) -> None:
    models = {str(e.settings.get("model", "")) for e in evals}
    for e in evals:
        ckpt = e.settings.get("checkpoint")
        label = short_label(str(ckpt)) if ckpt else "base"
        if len(models) > 1:
            label = f"{short_label(str(e.settings.get('model', '?')))} | {label}"
        e.label = label
    seen: dict[tuple[str, str], int] = {}
    for e in evals:
        key = (e.label, e.mode)
        seen[key] = seen.get(key, 0) + 1
    for e in evals:
        if seen[(e.label, e.mode)] > 1:
            e.label = f"{e.label} ({e.path.name.removesuffix('.summary.json').removesuffix('.jsonl')})"


def _dedupe_training_labels(logs: list[TrainingLog]) -> None:
    counts: dict[str, int] = {}
    for log in logs:
        counts[log.label] = counts.get(log.label, 0) + 1
    for log in logs:
        if counts[log.label] > 1:
            log.label = str(log.path)


def _leaves(d: JsonValue, prefix: str) -> dict[str, JsonValue]:
    if isinstance(d, dict):
        out: dict[str, JsonValue] = {}
        for k, v in d.items():
            out.update(_leaves(v, f"{prefix}.{k}"))
        return out
    return {prefix: d}


def compare_settings(evals: list[EvalResult]) -> list[str]:
    """One warning per setting whose value differs between evals, naming the setting and each file's value."""
    warnings: list[str] = []

    def check(group: list[EvalResult], keys: tuple[str, ...]) -> None:
        if len(group) < 2:
            return
        names: list[str] = []
        for key in keys:
            for e in group:
                for name in _leaves(setting_value(e.settings, key), key):
                    if name not in names:
                        names.append(name)
        for name in names:
            values = {e.path.name: setting_value(e.settings, name) for e in group}
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
                shown = ", ".join(f"{file}={value!r}" for file, value in values.items())
                warnings.append(f"setting '{name}' differs between evals: {shown}")

    check(evals, COMPARED_SETTINGS)
    check([e for e in evals if e.mode == "retool"], COMPARED_TOOL_SETTINGS)
    return warnings


# --- tables -----------------------------------------------------------------------------------------

LONG_COLUMNS: tuple[str, ...] = (
    "checkpoint",
    "mode",
    "model",
    "dataset",
    "problems",
    "val_n",
    "average_at_n",
    "ci95_low",
    "ci95_high",
    "pass_at_n",
    "maj_at_n",
    "format_rate",
    "tool_call_rate",
    "mean_code_calls",
    "mean_turns",
    "self_correction_given_error",
    "executions",
    "mean_exec_latency",
    "tokens_generated",
    "status",
    "file",
)


def long_rows(evals: list[EvalResult]) -> list[CsvRow]:
    rows: list[CsvRow] = []
    for e in evals:
        m = e.metrics
        lo, hi = as_list(m.get("average_at_n_ci95", [None, None]))
        rows.append(
            {
                "checkpoint": e.label,
                "mode": e.mode,
                "model": e.settings.get("model"),
                "dataset": e.settings.get("dataset"),
                "problems": m.get("problems"),
                "val_n": e.settings.get("val_n", m.get("val_n")),
                "average_at_n": m.get("average_at_n"),
                "ci95_low": lo,
                "ci95_high": hi,
                "pass_at_n": m.get("pass_at_n"),
                "maj_at_n": m.get("maj_at_n"),
                "format_rate": m.get("format_rate"),
                "tool_call_rate": m.get("tool_call_rate"),
                "mean_code_calls": m.get("mean_code_calls"),
                "mean_turns": m.get("mean_turns"),
                "self_correction_given_error": m.get("self_correction_given_error"),
                "executions": m.get("executions"),
                "mean_exec_latency": m.get("mean_exec_latency"),
                "tokens_generated": m.get("tokens_generated"),
                "status": e.status,
                "file": str(e.path),
            }
        )
    return rows


def ordered_modes(evals: list[EvalResult]) -> list[str]:
    present = {e.mode for e in evals}
    return [m for m in MODE_ORDER if m in present] + sorted(present - set(MODE_ORDER))


def ordered_checkpoints(evals: list[EvalResult]) -> list[str]:
    out: list[str] = []
    for e in evals:
        if e.label not in out:
            out.append(e.label)
    return out


def _pct(x: JsonValue) -> str:
    return "" if x is None else f"{100 * float(as_number(x)):.2f}%"


def _num(x: JsonValue, digits: int = 2) -> str:
    return "" if x is None else f"{float(as_number(x)):.{digits}f}"


PIVOT_METRICS: tuple[tuple[str, str], ...] = (
    ("average_at_n", "Average@N"),
    ("pass_at_n", "Pass@N"),
    ("maj_at_n", "maj@N"),
    ("format_rate", "Format"),
    ("mean_code_calls", "Code calls"),
)


def pivot(evals: list[EvalResult]) -> tuple[list[str], list[list[str]], list[CsvRow]]:
    """Checkpoints x modes: (markdown header, markdown rows, CSV rows)."""
    modes = ordered_modes(evals)
    by_key = {(e.label, e.mode): e for e in evals}
    both = "text-only" in modes and "retool" in modes
    header = ["checkpoint"]
    for mode in modes:
        header += [f"{mode} {title}" for _, title in PIVOT_METRICS]
    if both:
        header.append("retool - text-only (Average@N)")
    md_rows: list[list[str]] = []
    csv_rows: list[CsvRow] = []
    for ckpt in ordered_checkpoints(evals):
        md = [ckpt]
        row: CsvRow = {"checkpoint": ckpt}
        for mode in modes:
            e = by_key.get((ckpt, mode))
            m: JsonObject = e.metrics if e else {}
            for key, _ in PIVOT_METRICS:
                value = m.get(key)
                row[f"{mode}:{key}"] = value
                if key == "average_at_n" and value is not None:
                    lo, hi = as_list(m.get("average_at_n_ci95", [None, None]))
                    row[f"{mode}:ci95_low"], row[f"{mode}:ci95_high"] = lo, hi
                    md.append(f"{_pct(value)} [{_pct(lo)}, {_pct(hi)}]" if lo is not None else _pct(value))
                elif key == "mean_code_calls":
                    md.append(_num(value))
                else:
                    md.append(_pct(value))
        if both:
            a = row.get("retool:average_at_n")
            b = row.get("text-only:average_at_n")
            delta = None if a is None or b is None else as_number(a) - as_number(b)
            row["delta_average_at_n"] = delta
            md.append("" if delta is None else f"{100 * delta:+.2f} pts")
        md_rows.append(md)
        csv_rows.append(row)
    return header, md_rows, csv_rows


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_report(evals: list[EvalResult], logs: list[TrainingLog], warnings: list[str]) -> str:
    parts = ["# Evaluation comparison", ""]
    if warnings:
        parts += ["**Warning: these evals were not made with the same settings:**", ""]
        parts += [f"- {w}" for w in warnings] + [""]
    if evals:
        n_values = sorted({str(e.settings.get("val_n", e.metrics.get("val_n"))) for e in evals})
        parts += [
            f"N = {', '.join(n_values)}. Average@N is shown with its 95% bootstrap interval over problems.",
            "",
        ]
        header, rows, _ = pivot(evals)
        parts += ["## Checkpoints x modes", "", _md_table(header, rows), ""]
        long = long_rows(evals)
        cols = [c for c in LONG_COLUMNS if c != "file"]
        pct_cols = {
            "average_at_n",
            "ci95_low",
            "ci95_high",
            "pass_at_n",
            "maj_at_n",
            "format_rate",
            "tool_call_rate",
            "self_correction_given_error",
        }
        md_rows = []
        for r in long:
            md_rows.append(
                [
                    _pct(r[c])
                    if c in pct_cols
                    else _num(r[c], 3)
                    if c == "mean_exec_latency"
                    else _num(r[c])
                    if c in {"mean_code_calls", "mean_turns"}
                    else ("" if r[c] is None else str(r[c]))
                    for c in cols
                ]
            )
        parts += ["## All metrics", "", _md_table(cols, md_rows), ""]
    if logs:
        parts += ["## Training runs", ""]
        for log in logs:
            last = log.rows[-1]
            keys = [
                k
                for k in last
                if not k.startswith("stop/") and any(s in k for s in ("reward", "correct_rate", "code_calls"))
            ]
            shown = ", ".join(f"{k}={last[k]:.4g}" for k in keys[:6])
            parts.append(f"- {log.label}: {len(log.rows)} steps (last step {int(last['step'])}: {shown})")
        parts.append("")
    return "\n".join(parts)


def write_csv(path: Path, rows: list[CsvRow], columns: list[str] | None = None) -> None:
    cols = columns or list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r.get(k) for k in cols})
