"""The ``retool`` command line: a thin layer over the library.

Each pipeline stage owns its commands in ``retool.<stage>.cli`` and exposes ``register(app)``; this module
only assembles them. Heavy imports (torch, transformers) happen inside the commands, so ``retool --help``
stays fast.
"""

from __future__ import annotations

import importlib
import logging
import sys

import typer

app = typer.Typer(
    name="retool",
    help="ReTool: reinforcement learning for strategic code-interpreter use in math reasoning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Order is the order of `retool --help`: the pipeline, left to right.
_STAGE_CLIS = (
    "retool.data.cli",
    "retool.reward.cli",
    "retool.sandbox.cli",
    "retool.tasks.cli",
    "retool.train.cli",
    "retool.evaluate.cli",
    "retool.analyze.cli",
    "retool.view.cli",
    "retool.serve.cli",
)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages."),
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


for _module_name in _STAGE_CLIS:
    try:
        _module = importlib.import_module(_module_name)
    except ModuleNotFoundError as exc:  # a stage not built yet; never hide a broken one
        if exc.name != _module_name:
            raise
        continue
    _module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
