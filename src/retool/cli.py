"""The ``retool`` command line: a thin layer over the library.

Each pipeline stage owns its commands in ``retool.<stage>.cli`` and exposes ``register(app)``; this module
only assembles them, and owns how every command ends on the project's own user-facing errors
(``retool.errors.UserError``: a bad config, a model that cannot be loaded, a backend without
credentials...): one line, exit 2, no traceback unless ``--debug`` or ``RETOOL_DEBUG=1``. Heavy imports
(torch, transformers) happen inside the commands, so ``retool --help`` stays fast.
"""

from __future__ import annotations

import logging
import os
import sys

import typer
from typer import _click as click  # typer vendors click; its Context is the base of typer.Context
from typer.core import TyperGroup

from retool.analyze import cli as analyze_cli
from retool.data import cli as data_cli
from retool.errors import UserError
from retool.evaluate import cli as evaluate_cli
from retool.export import cli as export_cli
from retool.recipes import cli as recipes_cli
from retool.reward import cli as reward_cli
from retool.sandbox import cli as sandbox_cli
from retool.serve import cli as serve_cli
from retool.train import cli as train_cli
from retool.view import cli as view_cli

DEBUG_ENV = "RETOOL_DEBUG"
_DEBUG_KEY = "retool.debug"


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (its own line breaks become spaces)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class RetoolGroup(TyperGroup):
    """Every command runs inside ``invoke``: a ``UserError`` ends it with one line and exit 2."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            if ctx.meta.get(_DEBUG_KEY) or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
                raise
            typer.echo(f"error: {one_line(exc)}", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    name="retool",
    cls=RetoolGroup,
    help="ReTool: reinforcement learning for strategic code-interpreter use in math reasoning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Order is the order of `retool --help`: the pipeline, left to right.
_STAGE_CLIS = (
    data_cli,
    reward_cli,
    sandbox_cli,
    recipes_cli,  # demo, sft, recipes (its import brings pipeline.cli's `retool data coldstart`)
    train_cli,
    evaluate_cli,
    export_cli,
    analyze_cli,
    view_cli,
    serve_cli,
)


@app.callback()
def _root(
    ctx: typer.Context,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages."),
    debug: bool = typer.Option(
        False, "--debug", help=f"Show the traceback of a user-facing error (or set {DEBUG_ENV}=1)."
    ),
) -> None:
    ctx.meta[_DEBUG_KEY] = debug
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


for _stage in _STAGE_CLIS:
    _stage.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
