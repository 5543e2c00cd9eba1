"""The static viewer site: finds training runs and evals, and writes ``index.html`` plus data chunks.

Layout of the output folder::

    OUT/index.html            the app: CSS, JS and the index data inline (no network, no CDN)
    OUT/data/c-<hash>.js      trajectory records in chunks, loaded by the page only when one is opened

The index (overview curves, eval metrics, one small row per trajectory for the list and its filters)
is parsed up front; full records (spans, messages, executor output) stay in the chunks, so a run with
thousands of trajectories opens fast. Chunks are ``<script>`` files rather than JSON because a page
opened from ``file://`` may load scripts but not ``fetch`` files. Chunk names hash their content, so an
unchanged chunk keeps its name across rebuilds (``--serve`` rebuilds while a page may still be reading
the previous build's chunks; those are kept for one more build).

Inputs (``discover``): a run folder (``metrics.jsonl`` and/or ``trajectories.jsonl``), an eval JSONL (or
its ``.summary.json``), or any folder holding those up to two levels down (``runs/demo``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from pathlib import Path
from typing import TypedDict, cast

from retool.analyze.report import AnalyzeError, load_training_log, short_label
from retool.errors import UserError
from retool.evaluate.metrics import Interval, headline_intervals, summarize
from retool.evaluate.store import CandidateRecord, EvalSummary, ProblemRecord, summary_path_for
from retool.jsonl import JsonObject, JsonValue, first_jsonl_object
from retool.rollout.records import TrajectoryRecord
from retool.train.records import TRAJECTORIES_FILE, read_json_objects, read_records

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
DATA_DIR = "data"
CHUNK_PREFIX = "c-"
# A chunk closes at whichever comes first; small enough to load in a blink, few enough files.
CHUNK_MAX_BYTES = 1_500_000
CHUNK_MAX_RECORDS = 200
ANSWER_PREVIEW = 48
QUESTION_PREVIEW = 240
# Folders a search below a given folder never enters (weights, checkpoints, tracker files, this site).
_SKIP_DIRS = frozenset(
    {"checkpoints", "tensorboard", "swanlog", "wandb", "view", "data", "analysis", "__pycache__"}
)


class ViewError(UserError, ValueError):
    """An input the viewer cannot use; the message names it and says why."""


class Curves(TypedDict):
    step: list[int]
    series: dict[str, list[float | None]]


class SourceRow(TypedDict):
    """One input of the site (a run or an eval): what the page's source filter lists."""

    kind: str
    label: str
    mode: str
    path: str
    n: int


class RunRow(TypedDict):
    source: int
    label: str
    path: str
    steps_done: int
    sampled_steps: int
    curves: Curves


class EvalRow(TypedDict):
    source: int
    label: str
    mode: str
    path: str
    status: str
    completed: JsonValue
    total: JsonValue
    transcripts: int
    val_n: JsonValue
    dataset: JsonValue
    metrics: JsonObject
    intervals: dict[str, Interval]


@dataclass
class RunInput:
    """One training run folder."""

    folder: Path
    label: str = ""

    @property
    def metrics(self) -> Path:
        return self.folder / METRICS_FILE

    @property
    def trajectories(self) -> Path:
        return self.folder / TRAJECTORIES_FILE


@dataclass
class Inputs:
    runs: list[RunInput] = field(default_factory=list)
    evals: list[Path] = field(default_factory=list)  # eval JSONL files

    def files(self) -> list[Path]:
        """Every file the site is built from (what ``--serve`` watches)."""
        out: list[Path] = []
        for run in self.runs:
            out += [p for p in (run.metrics, run.trajectories) if p.exists()]
        for path in self.evals:
            out += [p for p in (path, _summary_path(path)) if p.exists()]
        return out


def _summary_path(path: Path) -> Path:
    return summary_path_for(path)


def _is_run_folder(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() or (path / TRAJECTORIES_FILE).is_file()


def _is_eval_file(path: Path) -> bool:
    if path.suffix != ".jsonl" or path.name in (METRICS_FILE, TRAJECTORIES_FILE):
        return False
    if _summary_path(path).is_file():
        return True
    first = first_jsonl_object(path)
    return first is not None and "candidates" in first


def _search(folder: Path, depth: int, inputs: Inputs) -> None:
    if _is_run_folder(folder):
        inputs.runs.append(RunInput(folder))
        return
    for child in sorted(folder.iterdir()):
        if child.is_file() and _is_eval_file(child):
            inputs.evals.append(child)
        elif child.is_dir() and depth > 0 and child.name not in _SKIP_DIRS and not child.name.startswith("."):
            _search(child, depth - 1, inputs)


def discover(paths: Sequence[str | Path]) -> Inputs:
    """Sort the given paths into training runs and eval files (see the module docstring)."""
    inputs = Inputs()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            before = len(inputs.runs) + len(inputs.evals)
            _search(path, 2, inputs)
            if len(inputs.runs) + len(inputs.evals) == before:
                raise ViewError(
                    f"{path}: no training run (metrics.jsonl, trajectories.jsonl) or eval JSONL in it"
                )
        elif path.is_file():
            if path.name in (METRICS_FILE, TRAJECTORIES_FILE):
                inputs.runs.append(RunInput(path.parent))
            elif path.name.endswith(".summary.json"):
                inputs.evals.append(path.with_name(path.name.removesuffix(".summary.json") + ".jsonl"))
            elif _is_eval_file(path):
                inputs.evals.append(path)
            else:
                raise ViewError(f"{path}: not a metrics.jsonl, trajectories.jsonl or eval JSONL")
        else:
            raise ViewError(f"{path}: no such file or folder")
    # The same file named twice (a folder and a file inside it) is one input.
    seen_runs: dict[Path, RunInput] = {r.folder.resolve(): r for r in inputs.runs}
    inputs.runs = list(seen_runs.values())
    inputs.evals = list(dict.fromkeys(p.resolve() for p in inputs.evals))
    _label_runs(inputs.runs)
    return inputs


def _label_runs(runs: list[RunInput]) -> None:
    """The folder name, or as many trailing path parts as it takes to tell runs apart."""
    for depth in range(1, 8):
        labels = ["/".join(r.folder.resolve().parts[-depth:]) for r in runs]
        if len(set(labels)) == len(labels):
            break
    for run, label in zip(runs, labels, strict=True):
        run.label = label


# -- reading the inputs ------------------------------------------------------------------------------


def _metrics_rows(path: Path) -> list[dict[str, float]]:
    """Numeric columns of a metrics.jsonl, one dict per step (read-only; a partial last line is skipped)."""
    if not path.is_file():
        return []
    try:
        return [dict(r) for r in load_training_log(path).rows]
    except AnalyzeError:
        return []


def _curves(rows: Sequence[dict[str, float]]) -> Curves:
    """Column-wise series: ``{"step": [...], "task/reward_mean": [...], ...}`` (None where missing)."""
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, int | float)})
    steps = [int(r.get("step", i + 1)) for i, r in enumerate(rows)]
    series: dict[str, list[float | None]] = {}
    for key in keys:
        if key == "step" or key.startswith(("rewards/", "problem_ids")):
            continue
        series[key] = [_finite(r.get(key)) for r in rows]
    return {"step": steps, "series": series}


def _finite(value: object) -> float | None:
    if not isinstance(value, int | float) or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(value)


def _eval_summary(path: Path) -> EvalSummary:
    spath = _summary_path(path)
    if not spath.is_file():
        return {}
    try:
        data = json.loads(spath.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        logger.warning("%s: unreadable summary; metrics recomputed from the records", spath)
        return {}
    return cast(EvalSummary, data) if isinstance(data, dict) else {}


def _eval_records(path: Path) -> list[ProblemRecord]:
    """Per-problem records (first one per id, as the eval keeps them); unreadable lines skipped."""
    out: dict[str, ProblemRecord] = {}
    if not path.is_file():
        return []
    for obj in read_json_objects(path):
        if "candidates" in obj:
            out.setdefault(str(obj.get("id")), cast(ProblemRecord, obj))
    return list(out.values())


def _object(value: JsonValue) -> JsonObject:
    """A JSON object read from a summary; anything else (absent, null) reads as empty."""
    return value if isinstance(value, dict) else {}


def _int(value: JsonValue) -> int:
    if isinstance(value, str | int | float):
        return int(value)
    raise TypeError(f"expected a number, not {type(value).__name__}")


def _eval_label(summary: EvalSummary, path: Path) -> str:
    settings = _object(summary.get("settings"))
    ckpt = settings.get("checkpoint")
    if ckpt:
        return short_label(str(ckpt))  # the label `retool analyze` uses for the same eval
    model = settings.get("model")
    if model:
        return Path(str(model)).name or str(model)
    return path.stem


def candidate_as_record(record: ProblemRecord, cand: CandidateRecord, mode: str) -> TrajectoryRecord:
    """A candidate's trajectory record; without a saved transcript, the summary fields it does have."""
    saved = cand.get("trajectory")
    if isinstance(saved, dict):
        return saved
    messages = cand.get("messages") or []
    question = next((m.get("content", "") for m in messages if m.get("role") == "user"), "")
    return {
        "version": 0,
        "source": "eval",
        "step": None,
        "mode": mode,
        "problem_id": str(record.get("id")),
        "group_index": int(cand.get("index", 0)),
        "question": question,
        "reference": str(record.get("reference", "")),
        "answer": cand.get("answer"),
        "correct": bool(cand.get("correct")),
        "valid_format": bool(cand.get("valid_format")),
        "reward": float(cand.get("reward", 1.0 if cand.get("correct") else -1.0)),
        "advantage": None,
        "stop_reason": str(cand.get("stop_reason", "")),
        "code_calls": int(cand.get("code_calls", 0)),
        "exec_errors": int(cand.get("exec_errors", 0)) + int(cand.get("exec_timeouts", 0)),
        "mask_source": "none",
        "tokens": {
            "completion": int(cand.get("completion_tokens", 0)),
            "total": int(cand.get("total_tokens", 0)),
        },
        "messages": messages,
        "turns": [],
        "spans": [],
        "final_text_tail": cand.get("final_text_tail", ""),
        "transcript": False,
    }


# -- building ----------------------------------------------------------------------------------------


class _Index:
    """The small per-trajectory rows, the problem table and the vocabularies the rows point into."""

    def __init__(self) -> None:
        self.rows: list[dict[str, JsonValue]] = []
        self.problems: list[dict[str, str]] = []
        self._problem_of: dict[str, int] = {}
        self.stops: list[str] = []
        self._stop_of: dict[str, int] = {}

    def problem(self, rec: TrajectoryRecord) -> int:
        pid = str(rec.get("problem_id", ""))
        if pid not in self._problem_of:
            self._problem_of[pid] = len(self.problems)
            question = str(rec.get("question") or "")
            self.problems.append(
                {"id": pid, "ref": str(rec.get("reference", "")), "q": question[:QUESTION_PREVIEW]}
            )
        else:
            entry = self.problems[self._problem_of[pid]]
            if not entry["q"] and rec.get("question"):  # an eval without transcripts knows no question
                entry["q"] = str(rec["question"])[:QUESTION_PREVIEW]
        return self._problem_of[pid]

    def stop(self, reason: str) -> int:
        if reason not in self._stop_of:
            self._stop_of[reason] = len(self.stops)
            self.stops.append(reason)
        return self._stop_of[reason]

    def add(self, rec: TrajectoryRecord, source: int, chunk: int, offset: int) -> None:
        answer = rec.get("answer")
        tokens = rec.get("tokens") or {}
        self.rows.append(
            {
                "s": source,
                "st": rec.get("step"),
                "p": self.problem(rec),
                "g": int(rec.get("group_index", 0)),
                "c": 1 if rec.get("correct") else 0,
                "r": _round(rec.get("reward")),
                "a": _round(rec.get("advantage")),
                "k": int(rec.get("code_calls", 0) or 0),
                "x": self.stop(str(rec.get("stop_reason", ""))),
                "e": int(rec.get("exec_errors", 0) or 0),
                "n": int(tokens.get("total", 0) or 0),
                "ans": None if answer is None else str(answer)[:ANSWER_PREVIEW],
                "t": 1 if rec.get("spans") else 0,
                "ch": chunk,
                "o": offset,
            }
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


class _ChunkWriter:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.files: list[str] = []
        self._parts: list[str] = []
        self._bytes = 0

    @property
    def index(self) -> int:
        return len(self.files)

    @property
    def offset(self) -> int:
        return len(self._parts)

    def add(self, record: TrajectoryRecord) -> None:
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        self._parts.append(text)
        self._bytes += len(text)
        if self._bytes >= CHUNK_MAX_BYTES or len(self._parts) >= CHUNK_MAX_RECORDS:
            self.flush()

    def flush(self) -> None:
        if not self._parts:
            return
        body = "[" + ",".join(self._parts) + "]"
        # The chunk's position is part of its content (the page asks for chunk i by position).
        digest = hashlib.sha256(f"{self.index}:{body}".encode()).hexdigest()[:16]
        name = f"{CHUNK_PREFIX}{digest}.js"
        path = self.data_dir / name
        if not path.exists():
            text = f"RETOOL_CHUNK({self.index},{body});\n"
            _write_atomic(path, text)
        self.files.append(f"{DATA_DIR}/{name}")
        self._parts = []
        self._bytes = 0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _run_records(run: RunInput) -> Iterator[TrajectoryRecord]:
    if run.trajectories.is_file():
        yield from read_records(run.trajectories)


@dataclass
class SiteResult:
    index: Path
    trajectories: int
    runs: int
    evals: int
    chunks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def build_site(
    paths: Sequence[str | Path] | Inputs, out_dir: str | Path, *, keep: Iterable[str] = ()
) -> SiteResult:
    """Write the site for ``paths`` into ``out_dir``; returns where ``index.html`` is and what it holds.

    One index and one chunk writer are filled source by source (each run, then each eval), then written
    together. ``keep``: chunk files (``data/c-….js``) a previous build referenced that must survive this one.
    """
    t0 = time.perf_counter()
    inputs = paths if isinstance(paths, Inputs) else discover(paths)
    out = Path(out_dir)
    data_dir = out / DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    site = _SiteParts(_Index(), _ChunkWriter(data_dir))
    for run in inputs.runs:
        _add_run(site, run)
    for path in inputs.evals:
        _add_eval(site, path)
    site.chunks.flush()
    _dedupe_eval_labels(site.evals, site.sources)
    index, chunks = site.index, site.chunks
    data = {
        "version": 1,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "title": _title(inputs),
        "sources": site.sources,
        "runs": site.runs,
        "evals": site.evals,
        "problems": index.problems,
        "stops": index.stops,
        "rows": index.rows,
        "chunks": chunks.files,
    }
    index_path = out / "index.html"
    _write_atomic(index_path, render_html(data))
    _remove_stale_chunks(data_dir, set(chunks.files) | set(keep))
    return SiteResult(
        index=index_path,
        trajectories=len(index.rows),
        runs=len(site.runs),
        evals=len(site.evals),
        chunks=list(chunks.files),
        seconds=time.perf_counter() - t0,
    )


@dataclass
class _SiteParts:
    """What ``build_site`` fills source by source: the row index, the chunk files, the sources' tables."""

    index: _Index
    chunks: _ChunkWriter
    sources: list[SourceRow] = field(default_factory=list)
    runs: list[RunRow] = field(default_factory=list)
    evals: list[EvalRow] = field(default_factory=list)

    def add(self, rec: TrajectoryRecord, source: int) -> None:
        self.index.add(rec, source, self.chunks.index, self.chunks.offset)
        self.chunks.add(rec)


def _add_run(site: _SiteParts, run: RunInput) -> None:
    """A training run: its sampled trajectories and its curves."""
    source = len(site.sources)
    steps: set[int] = set()
    count = 0
    for rec in _run_records(run):
        site.add(rec, source)
        count += 1
        step = rec.get("step")
        if step is not None:
            steps.add(int(step))
    rows = _metrics_rows(run.metrics)
    site.sources.append(
        {"kind": "train", "label": run.label, "mode": "retool", "path": str(run.folder), "n": count}
    )
    site.runs.append(
        {
            "source": source,
            "label": run.label,
            "path": str(run.folder),
            "steps_done": int(rows[-1].get("step", len(rows))) if rows else 0,
            "sampled_steps": len(steps),
            "curves": _curves(rows),
        }
    )


def _add_eval(site: _SiteParts, path: Path) -> None:
    """An evaluation: every candidate as a trajectory, and its metrics with their intervals."""
    summary = _eval_summary(path)
    records = _eval_records(path)
    settings = _object(summary.get("settings"))
    mode = str(settings.get("mode") or (records[0].get("mode") if records else "") or "?")
    source = len(site.sources)
    label = _eval_label(summary, path)
    count = transcripts = 0
    for record in records:
        for cand in record.get("candidates") or []:
            rec = candidate_as_record(record, cand, mode)
            site.add(rec, source)
            count += 1
            transcripts += 1 if rec.get("spans") else 0
    site.sources.append({"kind": "eval", "label": label, "mode": mode, "path": str(path), "n": count})
    metrics = _object(summary.get("metrics"))
    if not metrics and records:
        metrics = summarize(records, bootstrap_resamples=200)
    site.evals.append(
        {
            "source": source,
            "label": label,
            "mode": mode,
            "path": str(path),
            "status": str(summary.get("status", "unknown")),
            "completed": summary.get("completed", len(records)),
            "total": summary.get("total", len(records)),
            "transcripts": transcripts,
            "val_n": settings.get("val_n", metrics.get("val_n")),
            "dataset": settings.get("dataset", ""),
            "metrics": _eval_metric_subset(metrics),
            "intervals": headline_intervals(records, seed=_int(settings.get("seed", 0) or 0)),
        }
    )


def _dedupe_eval_labels(evals: list[EvalRow], sources: list[SourceRow]) -> None:
    """Two evals of one checkpoint and mode (other datasets, other seeds) get their file name added."""
    seen: dict[tuple[str, str], int] = {}
    for ev in evals:
        seen[(ev["label"], ev["mode"])] = seen.get((ev["label"], ev["mode"]), 0) + 1
    for ev in evals:
        if seen[(ev["label"], ev["mode"])] > 1:
            ev["label"] = f"{ev['label']} ({Path(ev['path']).stem})"
            sources[ev["source"]]["label"] = ev["label"]


def write_view(paths: Sequence[str | Path], out_dir: str | Path) -> Path | None:
    """``build_site`` for pipelines such as the demo: returns ``index.html``, or None after logging why not.

    The site is a by-product of a run, so a failure here must never lose the run's own results.
    """
    try:
        return build_site(paths, out_dir).index
    except Exception:
        logger.exception("building the viewer site in %s failed", out_dir)
        return None


_EVAL_KEYS = (
    "problems",
    "val_n",
    "average_at_n",
    "average_at_n_ci95",
    "pass_at_n",
    "maj_at_n",
    "format_rate",
    "tool_call_rate",
    "mean_code_calls",
    "mean_turns",
    "exec_error_rate",
    "self_correction_given_error",
    "mean_completion_tokens",
    "stop_reasons",
)


def _eval_metric_subset(metrics: JsonObject) -> JsonObject:
    return {k: metrics[k] for k in _EVAL_KEYS if k in metrics}


def _title(inputs: Inputs) -> str:
    names = [r.label for r in inputs.runs] + [p.stem for p in inputs.evals[:3]]
    return "retool view: " + (", ".join(names[:4]) + (" …" if len(names) > 4 else "") if names else "empty")


def _remove_stale_chunks(data_dir: Path, wanted: set[str]) -> None:
    for path in data_dir.glob(f"{CHUNK_PREFIX}*.js"):
        if f"{DATA_DIR}/{path.name}" not in wanted:
            path.unlink(missing_ok=True)


# -- the page ----------------------------------------------------------------------------------------


def _asset(name: str) -> str:
    return (resources.files("retool.view") / "assets" / name).read_text(encoding="utf-8")


def script_json(data: object) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` survives, so model
    output cannot close the element or open a comment, whatever it contains."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render_html(data: Mapping[str, object]) -> str:
    """The page: the template with the CSS, the JS and the index data inline.

    One pass over the template: substituted text is never searched again, so a placeholder that turns
    up inside model output stays text.
    """
    parts = {
        "__TITLE__": escape(str(data.get("title", "retool view"))),
        "__NONCE__": secrets.token_hex(12),
        "/*__CSS__*/": _asset("app.css"),
        "/*__JS__*/": _asset("app.js"),
        "__DATA__": script_json(data),
    }
    pattern = re.compile("|".join(re.escape(k) for k in parts))
    return pattern.sub(lambda m: parts[m.group(0)], _asset("index.html"))
