"""``retool data fetch NAME`` (datasets into the data folder), ``retool data mathematics`` (DeepMind Mathematics
from its official generator) and ``retool prepare dapo`` (DAPO-Math-17k to
train.jsonl + dev.jsonl, with counts of everything dropped).

``data_app`` is the ``retool data`` group; stages above this one add their own commands to it (``retool
data coldstart``: ``retool.pipeline.cli``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from retool.data import DataError, prepare_dapo
from retool.data.dapo import DEV_SEED, DEV_SIZE
from retool.data.fetch import FETCHABLE, fetch_dataset
from retool.data.paths import DATA_DIR_ENV

data_app = typer.Typer(
    name="data",
    help="Datasets: fetch or generate them into the data folder, build SFT data from annotated solutions.",
    no_args_is_help=True,
)

_NAMES = ", ".join(f"{name} ({spec.about})" for name, spec in FETCHABLE.items())


@data_app.command("fetch")
def fetch_command(
    name: str = typer.Argument(..., help=f"One of: {_NAMES}."),
    source: Path | None = typer.Option(
        None,
        "--from",
        help="Import a local copy from this folder (the same file names, e.g. gsm8k_test.jsonl) instead of "
        "downloading.",
    ),
    config: str | None = typer.Option(
        None,
        "--config",
        help="The Hub dataset's configuration (mathematics: the module, default algebra__linear_1d).",
    ),
    data_dir: Path | None = typer.Option(
        None,
        "--data-dir",
        help=f"Where to write (default ${DATA_DIR_ENV}, else the user cache: ~/.cache/retool/data).",
    ),
) -> None:
    """Download a dataset from the Hugging Face Hub (or import a local copy) into the data folder.

    Every command that reads a dataset by name looks in that folder. `mathematics` fetches one module of
    DeepMind Mathematics from the Hub; `retool data mathematics` generates the dataset locally."""
    result = fetch_dataset(name, data_dir=data_dir, source=source, config=config)
    typer.echo(f"{result.name} from {result.source}")
    for file, rows in result.files.items():
        typer.echo(f"  {rows:>7} rows -> {result.folder / file}")
    if result.prepared is not None:
        typer.echo(f"  prepared (train.jsonl, dev.jsonl) -> {result.prepared}")


prepare_app = typer.Typer(help="Prepare training data (strip, deduplicate, split).", no_args_is_help=True)


@prepare_app.command("dapo")
def prepare_dapo_command(
    input: str = typer.Option(
        ..., "--input", "-i", help="DAPO rows: a .jsonl/.json/.parquet file or a Hub id."
    ),
    out: str = typer.Option(..., "--out", "-o", help="Output folder for train.jsonl and dev.jsonl."),
    dev_size: int = typer.Option(DEV_SIZE, "--dev-size", help="Problems held out in dev.jsonl."),
    seed: int = typer.Option(DEV_SEED, "--seed", help="Seed of the dev sample."),
    split: str = typer.Option("train", "--split", help="Split to read when INPUT is a Hub id."),
) -> None:
    """Strip DAPO's instruction wrapper, deduplicate, hold out a dev split, and print the counts."""
    try:
        report = prepare_dapo(input, out, dev_size=dev_size, seed=seed, split=split)
    except DataError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    dropped = report.dropped
    typer.echo(f"read:       {report.read}")
    typer.echo(f"kept:       {report.kept}")
    typer.echo(f"duplicates: {report.duplicates}")
    typer.echo(
        f"dropped:    {sum(dropped.values())}" + "".join(f"\n  {k}: {v}" for k, v in sorted(dropped.items()))
    )
    typer.echo(f"train:      {report.train} -> {report.train_file}")
    typer.echo(f"dev:        {report.dev} -> {report.dev_file}")


@data_app.command("mathematics")
def mathematics_command(
    out: str = typer.Option(
        None,
        "--out",
        "-o",
        help="Folder for the JSONL files (default: the data folder, as `retool data fetch`).",
    ),
    train_per_module: int = typer.Option(1000, "--train-per-module", help="Train questions per module."),
    test_per_module: int = typer.Option(
        100, "--test-per-module", help="Interpolate / extrapolate per module."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of every module's generator."),
    modules: str = typer.Option("", "--modules", help="Comma-separated module names (default: all)."),
    python: str = typer.Option(
        None, "--python", help="The generator environment's Python (default: .venv-mathematics)."
    ),
) -> None:
    """Generate DeepMind Mathematics (train, interpolate, extrapolate) with its official generator."""
    # deferred: the builder's subprocess plumbing is only needed by this command
    from retool.data.mathematics import build_mathematics, mathematics_dir

    folder = mathematics_dir(out)
    done: list[str] = []

    def on_module(name: str) -> None:
        done.append(name)
        print(f"  generated {name} ({len(done)})", file=sys.stderr, flush=True)

    command = f"retool data mathematics --train-per-module {train_per_module} --test-per-module {test_per_module} --seed {seed}"
    command += f" --modules {modules}" if modules else ""
    try:
        report = build_mathematics(
            folder,
            train_per_module=train_per_module,
            test_per_module=test_per_module,
            seed=seed,
            modules=[m for m in modules.split(",") if m],
            python=python,
            on_module=on_module,
            command=command,
        )
    except DataError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for split, path in report.files.items():
        typer.echo(f"{split:12} {report.total(split):7d} rows, {len(report.counts[split])} modules -> {path}")
    typer.echo(f"train rows dropped as test questions: {report.leaked}")
    typer.echo(f"took {report.seconds:.1f}s; provenance: {folder / 'mathematics_provenance.json'}")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
    app.add_typer(prepare_app, name="prepare")
    app.add_typer(data_app, name="data")
