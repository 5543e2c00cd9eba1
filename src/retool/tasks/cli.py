"""``retool demo`` and ``retool sft``: the embedded default (tiny local model, synthetic tasks)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import typer

from retool.config import load_config

# The flags' defaults, shown in --help, are the demo preset's: a flag only overrides the config when given.
_DEMO = load_config("demo")


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _quiet_library_progress() -> None:
    """The demo prints its own progress lines; per-problem and per-step INFO logs would drown them."""
    import logging

    for name in (
        "retool.evaluate.runner",
        "retool.train.progress",
        "retool.train.loop",
        "retool.backends.local",
        "retool.protocol.formats",
        "retool.train.checkpoint",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)


class _Printer:
    """Renders the library's progress events as plain lines on stderr (readable in CI logs too)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def _line(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "phase":
            self._line(f"== {data['phase']}: {data.get('detail', '')}")
        elif kind == "phase_done":
            self._line(f"   {data['phase']} done in {data['seconds']:.1f}s")
        elif kind == "sft_step":
            step, steps = data["step"], data["steps"]
            if step == 1 or step % 25 == 0 or step == steps:
                self._line(f"   sft step {step}/{steps}  loss {data['loss']:.3f}")
        elif kind == "rl_step":
            m = data.get("metrics", {})
            self._line(
                f"   rl step {data['step']}/{data['steps']}  reward {m.get('task/reward_mean', float('nan')):+.2f}"
                f"  correct {_pct(m.get('task/correct_rate'))}  code {_pct(m.get('tool/code_share'))}"
                f"  groups {m.get('sampling/groups_kept', 0):.0f}/{m.get('sampling/groups_sampled', 0):.0f}"
                f"  {m.get('time/step', 0.0):.1f}s"
            )
        elif kind == "eval":
            for mode, s in data["summaries"].items():
                self._line(
                    f"   {data['model']:>3} {mode:<9} Average@N {_pct(s.get('average_at_n'))}  "
                    f"format {_pct(s.get('format_rate'))}  tool(hard) {_pct(s.get('hard_tool_call_rate'))}"
                )


def _pct(v: Any) -> str:
    return "  -  " if v is None else f"{100 * float(v):5.1f}%"


def _settings(
    config: str, overrides: list[str], seed: int | None, flags: dict[str, Any], **fields: Any
) -> Any:
    """The demo's settings: ``config`` + ``--set`` + the flags that were given (+ demo-only fields)."""
    from retool.config import ConfigError, flag_overrides
    from retool.tasks.demo import DemoSettings, seed_overrides

    sets = [*overrides, *(seed_overrides(seed) if seed is not None else []), *flag_overrides(flags)]
    try:
        return DemoSettings.load(sets, config=config, **fields)
    except ConfigError as exc:
        _fail(str(exc))


_CONFIG_HELP = "Preset or TOML file the settings start from."
_SET_HELP = "Override section.key=value (repeatable), or a demo field: size, eval_modes, plots."


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Run folder: every artefact goes here."),
    config: str = typer.Option("demo", "--config", help=_CONFIG_HELP),
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
    """The whole pipeline on a tiny local model: build, SFT, eval, RL, eval; table and plots."""
    _quiet_library_progress()
    from retool.tasks.demo import run_demo
    from retool.tasks.report import gain_line, markdown_table

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
    own: dict[str, Any] = {"out": str(out), "reuse_sft": None if reuse_sft is None else str(reuse_sft)}
    if no_plots:
        own["plots"] = False
    settings = _settings(config, overrides, seed, flags, **own)
    try:
        result = run_demo(settings, on_event=_Printer())
    except (FileExistsError, ValueError) as exc:
        _fail(str(exc))
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
    from retool.tasks.demo import run_sft

    if model != "tiny" and not Path(model).exists():
        _fail(f"--model {model}: no such folder")
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
        _fail(str(exc))
    typer.echo(json.dumps(result, indent=2))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
    app.command("sft")(sft_command)
