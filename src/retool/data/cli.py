"""``retool prepare dapo``: DAPO-Math-17k to train.jsonl + dev.jsonl, with counts of everything dropped."""

from __future__ import annotations

import typer

from retool.data import DataError, prepare_dapo
from retool.data.dapo import DEV_SEED, DEV_SIZE

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
    typer.echo(f"train:      {report.train} -> {report.train_path}")
    typer.echo(f"dev:        {report.dev} -> {report.dev_path}")


def register(app: typer.Typer) -> None:
    app.add_typer(prepare_app, name="prepare")
