"""What the demo's commands share, and ``retool data coldstart``.

``Printer`` renders a pipeline run's progress events (``retool.pipeline.settings.DemoEvent``) on stderr;
``quiet_library_progress`` keeps the library's INFO logs from drowning them. The commands that run a
recipe, ``retool demo`` / ``retool sft`` / ``retool recipes``, are ``retool.recipes.cli``'s (they name the
recipes, one layer up); ``retool data coldstart`` joins the data group when this module is imported.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import typer

from retool.data.cli import data_app  # `retool data coldstart` joins the data group
from retool.data.gsm8k import GSM8K_FILE
from retool.data.paths import data_dir as resolve_data_dir
from retool.errors import UserError
from retool.jsonl import JsonValue, as_number, read_jsonl_objects
from retool.pipeline.settings import DemoEvent
from retool.train.annotated import coldstart_protocol, convert_with_sandbox, write_rejects
from retool.train.sft import write_examples


def quiet_library_progress() -> None:
    """The demo prints its own progress lines; per-problem and per-step INFO logs would drown them, and so
    would transformers' own bars ("Loading weights", "Writing model shards": every phase loads or saves a
    model)."""
    # deferred: the CLI imports this module for every command; transformers reads this switch when imported
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    if "transformers" in sys.modules:  # imported already: its own switch too (never imported just for it)
        from transformers.utils import logging as transformers_logging  # deferred: seconds to import

        transformers_logging.disable_progress_bar()
    for name in (
        "retool.evaluate.runner",
        "retool.train.progress",
        "retool.train.loop",
        "retool.backends.local.client",
        "retool.protocol.formats",
        "retool.train.checkpoint",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)


class Printer:
    """Renders the library's progress events on stderr: phase lines, and progress bars for SFT steps,
    evaluation problems and RL steps (redrawn in place on a terminal; one line per ~10% otherwise, so CI
    logs stay readable)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._bar_key: str | None = None
        self._bar_start = 0.0
        self._bar_last = -1.0
        self._bar_first: tuple[float, int] | None = None  # when the bar's first item finished, and its count
        self._last_event = self.t0  # a new bar's work began at the previous event (phase start, last bar)
        self._evals: dict[str, dict[str, tuple[int, int]]] = {}  # model -> mode -> (done, total) problems

    def _line(self, text: str) -> None:
        self._end_bar()
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def _end_bar(self) -> None:
        if self._bar_key is not None and self.tty:
            print(file=sys.stderr, flush=True)
        self._bar_key = None

    def bar(self, key: str, done: int, total: int, label: str, extra: str = "") -> None:
        """One progress bar per ``key``; ETA from the rate since its first item finished (see ``_eta``)."""
        now = time.perf_counter()
        if key != self._bar_key:
            self._end_bar()
            self._bar_key, self._bar_start, self._bar_last = key, self._last_event, -1.0
            self._bar_first = None
        if self._bar_first is None and done > 0:
            self._bar_first = (now, done)
        frac = done / total if total else 1.0
        width = 24
        filled = round(width * frac)
        elapsed = now - self._bar_start
        eta = self._eta(now, done, total) if 0 < frac < 1 else f"{_duration(elapsed)}"
        text = (
            f"[{now - self.t0:6.1f}s]    {label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{total} {eta}{'  ' + extra if extra else ''}"
        )
        if self.tty:
            print("\r" + text.ljust(110), end="", file=sys.stderr, flush=True)
            if done >= total:
                self._end_bar()
        elif done >= total or frac - self._bar_last >= 0.1 or done == 1:
            self._bar_last = frac
            print(text, file=sys.stderr, flush=True)

    def _eta(self, now: float, done: int, total: int) -> str:
        """Time left at the rate items finished since the first one did. Items run concurrently (an
        evaluation's problems, many at once): the first finishes after a whole item's latency, which says
        nothing of the rate at which the rest follow (the rate since the bar started read 82 minutes for
        an evaluation that took a fraction of that). Until a second item finishes: no estimate."""
        first = self._bar_first
        if first is None or done <= first[1]:
            return "eta ..."
        per_item = (now - first[0]) / (done - first[1])
        return f"eta {_duration(per_item * (total - done))}"

    def __call__(self, kind: str, data: DemoEvent) -> None:
        self._render(kind, data)
        self._last_event = time.perf_counter()

    def _render(self, kind: str, data: DemoEvent) -> None:
        if kind == "phase":
            self._line(f"== {data['phase']}: {data.get('detail', '')}")
        elif kind == "phase_done":
            resumed = " (finished in an earlier session)" if data.get("resumed") else ""
            self._line(f"   {data['phase']} done in {data['seconds']:.1f}s{resumed}")
        elif kind == "sft_step":
            self.bar("sft", data["step"], data["steps"], "sft step", f"loss {data['loss']:.3f}")
        elif kind == "eval_progress":  # the modes of one model run side by side: one bar for them all
            counts = self._evals.setdefault(data["model"], {})
            counts[data["mode"]] = (data["done"], data["total"])
            done, total = (sum(c[k] for c in counts.values()) for k in (0, 1))
            self.bar(f"eval/{data['model']}", done, total, f"eval {data['model']} {' + '.join(counts)}")
        elif kind == "rl_step":
            m = data.get("metrics", {})
            self.bar(
                "rl",
                data["step"],
                data["steps"],
                "rl step",
                f"reward {m.get('task/reward_mean', float('nan')):+.2f}"
                f"  correct {_pct(m.get('task/correct_rate'))}  code {_pct(m.get('tool/code_share'))}"
                f"  groups {m.get('sampling/groups_kept', 0):.0f}/{m.get('sampling/groups_sampled', 0):.0f}"
                f"  {m.get('time/step', 0.0):.1f}s",
            )
        elif kind == "eval":
            for mode, s in data["summaries"].items():
                self._line(
                    f"   {data['model']:>4} {mode:<9} Average@N {_pct(s.get('average_at_n'))}  "
                    f"format {_pct(s.get('format_rate'))}  valid call {_pct(s.get('tool_call_rate'))}  "
                    f"tool(hard) {_pct(s.get('hard_tool_call_rate'))}"
                )


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _pct(v: JsonValue) -> str:
    return "  -  " if v is None else f"{100 * float(as_number(v)):5.1f}%"


@data_app.command("coldstart")
def coldstart_command(
    input: Path = typer.Option(..., "--input", "-i", help="JSONL with a question and an annotated solution."),
    out: Path = typer.Option(..., "--out", "-o", help="Output JSONL of SFT trajectories (tokens, weights)."),
    model: str = typer.Option(
        ..., "--model", help="Tokenizer (folder or Hub id) whose chat template is used."
    ),
    tool_format: str = typer.Option(
        "auto", "--tool-format", help="auto (from the template), hermes, qwen_xml, markdown."
    ),
    question_field: str = typer.Option("question", "--question-field"),
    solution_field: str = typer.Option(
        "answer", "--solution-field", help="The annotated solution (<<expr=result>>)."
    ),
    answer_field: str | None = typer.Option(
        None, "--answer-field", help="Reference answer (default: after ####)."
    ),
    limit: int | None = typer.Option(None, "--limit", help="Read at most this many rows."),
    system_prompt: str = typer.Option("full", "--system-prompt", help="full or compact."),
    held_out: Path | None = typer.Option(
        None,
        "--held-out",
        help="JSONL of test problems never trained on (default: gsm8k_test.jsonl in the data folder, if any).",
    ),
    per_call: int = typer.Option(
        1,
        "--steps-per-call",
        min=0,
        help="Annotated steps folded into one call (1: a call per step; 0: all).",
    ),
) -> None:
    """Each solution becomes a tool trajectory with REAL sandbox outputs; prints kept and dropped counts."""
    if not input.is_file():
        raise UserError(f"--input {input}: no such file")
    try:
        protocol = coldstart_protocol(model, tool_format, system_prompt)
    except (OSError, ValueError) as exc:  # no such tokenizer, no chat template, an unknown format or prompt
        raise UserError(f"--model {model}: {' '.join(str(exc).split())}") from None
    test_file = held_out or _default_held_out()
    if test_file is not None and not test_file.is_file():
        raise UserError(f"--held-out {test_file}: no such file")
    questions = [str(r.get("question", "")) for r in read_jsonl_objects(test_file)] if test_file else []
    examples, report = convert_with_sandbox(
        input,
        protocol,
        question_field=question_field,
        solution_field=solution_field,
        answer_field=answer_field,
        limit=limit,
        per_call=per_call,
        held_out=questions,
    )
    write_examples(examples, out)
    rejects = out.with_name(out.stem + ".dropped.jsonl")
    write_rejects(report, rejects)
    out.with_name(out.stem + ".report.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    typer.echo(f"held out: {len(questions)} test questions ({test_file or 'none'})")
    typer.echo(f"format:  {protocol.fmt.name} ({protocol.template_name})")
    typer.echo(f"read:    {report.read}")
    typer.echo(f"kept:    {report.kept} ({report.calls} interpreter calls) -> {out}")
    typer.echo(f"dropped: {sum(report.dropped.values())}")
    for reason, n in sorted(report.dropped.items()):
        typer.echo(f"  {reason}: {n}  (first: {report.examples_of[reason]})")
    typer.echo(f"every dropped row and its reason -> {rejects}")


def _default_held_out() -> Path | None:
    path = resolve_data_dir() / GSM8K_FILE
    return path if path.is_file() else None
