"""``retool view``: build the trajectory viewer site for training runs and evals, or serve it locally."""

from __future__ import annotations

from pathlib import Path

import typer

from retool.view.serve import serve as serve_site
from retool.view.site import ViewError, build_site


def default_out(paths: list[Path]) -> Path:
    """``<folder>/view`` for one folder (``retool view runs/demo`` -> ``runs/demo/view``), else ``./view``."""
    if len(paths) == 1 and paths[0].is_dir():
        return paths[0] / "view"
    return Path("view")


def register(app: typer.Typer) -> None:
    @app.command("view")
    def view_command(
        paths: list[Path] = typer.Argument(
            ...,
            help="Run folders (metrics.jsonl / trajectories.jsonl), eval JSONLs, or folders holding them.",
        ),
        out: Path | None = typer.Option(
            None, "--out", "-o", help="Site folder (default: FOLDER/view for one folder, else ./view)."
        ),
        serve: bool = typer.Option(
            False, "--serve", help="Serve on 127.0.0.1 and rebuild on refresh (a run in progress)."
        ),
        port: int = typer.Option(8000, "--port", help="Port for --serve (0: any free port)."),
    ) -> None:
        """See the rollouts: curves, eval comparisons and every saved trajectory, turn by turn."""
        target = out or default_out(paths)
        if serve:
            try:
                serve_site(
                    paths,
                    target,
                    port=port,
                    on_ready=lambda url: typer.echo(
                        f"serving {target} at {url}  (refresh for new steps; Ctrl-C stops)"
                    ),
                )
            except (ViewError, OSError) as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            return
        try:
            result = build_site(paths, target)
        except (ViewError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(
            f"wrote {result.index}: {result.trajectories} trajectories, {result.runs} training run(s), "
            f"{result.evals} eval(s) in {result.seconds:.1f}s"
        )
        typer.echo(f"open: {result.index.resolve().as_uri()}")
