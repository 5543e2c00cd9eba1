"""``retool verify PRED REF``: one bounded equivalence check, printed as one JSON line."""

from __future__ import annotations

import json

import typer

from retool.config import RewardConfig
from retool.reward.verifier import Verifier


def verify_command(
    pred: str = typer.Argument(..., help="Predicted answer (LaTeX without $...$, e.g. '\\frac{1}{2}')."),
    ref: str = typer.Argument(..., help="Reference answer."),
    timeout: float | None = typer.Option(
        None, "--timeout", help="Hard time limit for the check, in seconds (default: reward.verify_timeout)."
    ),
) -> None:
    """Check PRED against REF with math-verify in a worker process with a hard timeout.

    Prints {"equivalent": bool, "status": "ok"|"timeout"|"error"}; the exit code is 0 in all three cases,
    so scripts read the status from the JSON.
    """
    reward = RewardConfig(verify_workers=1)
    if timeout is not None:
        reward.verify_timeout = timeout
    try:
        with Verifier.from_config(reward) as verifier:
            outcome = verifier.verify(pred, ref)
    except (RuntimeError, OSError) as exc:  # the worker could not start: still one JSON line, status error
        typer.echo(f"error: {exc}", err=True)
        typer.echo(json.dumps({"equivalent": False, "status": "error"}))
        return
    typer.echo(json.dumps({"equivalent": outcome.equivalent, "status": outcome.status}))


def register(app: typer.Typer) -> None:
    # Answers are often negative ("-0", "-1/2"): an unknown dash-word is an answer, not an option.
    app.command("verify", context_settings={"ignore_unknown_options": True})(verify_command)
