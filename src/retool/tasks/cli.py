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


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Path = typer.Option(Path("runs/demo"), "--out", help="Run folder: every artefact goes here."),
        seed: int = typer.Option(0, help="Seed of tasks, model, SFT order, sampling."),
        rl_steps: int = typer.Option(_DEFAULTS.rl_steps, "--rl-steps", help="RL steps."),
        sft_steps: int = typer.Option(_DEFAULTS.sft_steps, "--sft-steps", help="Cold-start SFT steps."),
        group_size: int = typer.Option(_DEFAULTS.group_size, "--group-size"),
        questions: int = typer.Option(
            _DEFAULTS.questions_per_step, "--questions", help="Questions per RL step."
        ),
        val_n: int = typer.Option(
            _DEFAULTS.val_n, "--val-n", help="Samples per held-out problem in evaluation."
        ),
        test_tasks: int = typer.Option(_DEFAULTS.test_tasks, "--test-tasks", help="Held-out problems."),
        threads: int = typer.Option(
            _DEFAULTS.threads, help="torch threads (1 leaves a core to the sandbox)."
        ),
        dynamic_sampling: bool = typer.Option(
            _DEFAULTS.dynamic_sampling,
            "--dynamic-sampling/--no-dynamic-sampling",
            help="DAPO: train only on groups whose rewards differ, sampling more questions to refill.",
        ),
        reuse_sft: Path | None = typer.Option(
            None, "--reuse-sft", help="An earlier demo run: start from its SFT model and SFT evaluation."
        ),
        no_plots: bool = typer.Option(False, "--no-plots"),
    ) -> None:
        """The whole pipeline on a tiny local model: build, SFT, eval, RL, eval; table and plots."""
        _quiet_library_progress()
        from retool.tasks.demo import DemoSettings, gain_line, markdown_table, run_demo

        settings = DemoSettings(
            out=str(out),
            seed=seed,
            rl_steps=rl_steps,
            sft_steps=sft_steps,
            group_size=group_size,
            questions_per_step=questions,
            val_n=val_n,
            test_tasks=test_tasks,
            threads=threads,
            dynamic_sampling=dynamic_sampling,
            reuse_sft=str(reuse_sft) if reuse_sft is not None else None,
            plots=not no_plots,
        )
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
