"""``retool analyze``: eval results and training logs -> a side-by-side table (markdown + CSV) and PNG plots."""

from __future__ import annotations

from pathlib import Path

import typer

from retool.analyze import AnalyzeError, analyze


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    def analyze_command(
        files: list[Path] = typer.Argument(
            ..., help="Eval JSONLs (or their .summary.json), run metrics.jsonl files or run folders."
        ),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for comparison.md/.csv and the PNGs."),
        no_plots: bool = typer.Option(False, "--no-plots", help="Only the tables."),
    ) -> None:
        """Compare checkpoints and modes side by side; warn when evals used different settings."""
        try:
            result = analyze(files, out, plots=not no_plots)
        except (AnalyzeError, OSError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        for warning in result.warnings:
            typer.secho(f"WARNING: {warning}", fg=typer.colors.YELLOW, err=True)
        typer.echo(result.table_markdown)
        typer.echo("wrote: " + ", ".join(str(p) for p in result.files))
