"""``retool train``: run (or resume) ReTool RL from a config file or preset with ``--set`` overrides."""

from __future__ import annotations

from pathlib import Path

import typer

from retool.config import Config, ConfigError, dump_config
from retool.data import DataError
from retool.errors import UserError
from retool.retry import RetriesExhaustedError, UnsafeRetryError
from retool.sandbox import SandboxPreimportError
from retool.train.checkpoint import CheckpointError, RunWriteError
from retool.train.datasource import DataSourceError
from retool.train.loop import RunDirError, TrainSummary, load_run_config, run_training
from retool.train.metrics import StepLostError
from retool.train.trackers import TrackerError


def train_command(
    config: str | None = typer.Option(
        None, "--config", "-c", help="Config TOML file or preset name (chapter, tiny, demo)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Config override section.key=value (repeatable), e.g. rollout.group_size=4."
    ),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run folder (default: train.run_dir)."),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this folder from its latest checkpoint."
    ),
    show_config: bool = typer.Option(False, "--show-config", help="Print the resolved config and exit."),
) -> None:
    """RL with the code interpreter: rollouts, interpreter-masked PPO steps, metrics, checkpoints."""
    if resume is not None and run_dir is not None and resume != run_dir:
        raise UserError("--resume names the run folder; do not also pass a different --run-dir")
    if resume is None and config is None:
        raise UserError("pass --config FILE|PRESET (or --resume RUN_DIR)")
    try:
        # With --resume and no --config, the run's own config.toml is the base.
        cfg = load_run_config(config, resume, resume is not None, overrides)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    if show_config:
        typer.echo(dump_config(cfg))
        return
    folder = resume if resume is not None else (run_dir or Path(cfg.train.run_dir))
    summary = _train(cfg, folder, resume is not None)
    state = "stopped on signal" if summary.interrupted else "finished"
    typer.echo(
        f"{state} at step {summary.last_step}/{cfg.train.steps} (started at {summary.start_step}); "
        f"run folder: {summary.run_dir}"
    )
    if summary.interrupted:
        typer.echo(f"resume with: retool train --resume {summary.run_dir}")


def _train(cfg: Config, folder: Path, resume: bool) -> TrainSummary:
    """``run_training``, its errors as one line each: exit 2 for bad input, 1 for a fault to resume
    after, 130 for an abort."""
    try:
        return run_training(cfg, folder, resume=resume)
    except (RunDirError, DataSourceError, DataError, TrackerError, ConfigError, CheckpointError) as exc:
        raise UserError(str(exc)) from None
    except (
        RunWriteError,
        SandboxPreimportError,
        StepLostError,
        UnsafeRetryError,
        RetriesExhaustedError,
    ) as exc:
        # Faults the run cannot go on through; what is on disk is consistent, so say how to go on.
        typer.echo(f"error: {exc}", err=True)
        typer.echo(f"resume from the last checkpoint with: retool train --resume {folder}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo(f"aborted; resume from the last checkpoint with: retool train --resume {folder}", err=True)
        raise typer.Exit(130) from None


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
