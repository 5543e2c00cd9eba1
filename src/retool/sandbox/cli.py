"""``retool sandbox``: run code from stdin in a sandbox (``exec``) and report the active isolation (``check``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

sandbox_app = typer.Typer(
    name="sandbox", help="Run model-style Python in the sandbox; check isolation.", no_args_is_help=True
)


def _make(backend: str, isolation: str, timeout: float, memory_mb: int, url: str | None, workers: int) -> Any:
    from retool.config import SandboxConfig
    from retool.sandbox import make_executor

    kwargs: dict[str, Any] = {
        "backend": backend,
        "isolation": isolation,
        "timeout": timeout,
        "memory_mb": memory_mb,
        "workers": workers,
    }
    if url:
        kwargs["sandboxfusion_url"] = url
    try:
        cfg = SandboxConfig(**kwargs)
    except Exception as exc:  # pydantic ValidationError: one clear line
        typer.echo(f"error: invalid sandbox options: {exc}", err=True)
        raise typer.Exit(2) from exc
    return make_executor(cfg)


@sandbox_app.command("exec")
def exec_cmd(
    backend: str = typer.Option("forkserver", help="forkserver | subprocess | sandboxfusion"),
    isolation: str = typer.Option("strict", help="strict | none (forkserver only)"),
    timeout: float = typer.Option(30.0, help="Wall-clock timeout, seconds."),
    memory_mb: int = typer.Option(1024, "--memory-mb", help="Address-space limit, MiB."),
    url: str | None = typer.Option(None, help="SandboxFusion base URL (backend sandboxfusion)."),
) -> None:
    """Read Python code from stdin, run it once, print the ExecResult as one JSON line."""
    code = sys.stdin.read()
    with _make(backend, isolation, timeout, memory_mb, url, workers=1) as executor:
        result = executor.run(code)
    typer.echo(json.dumps(result.to_json_dict(), ensure_ascii=False))


@sandbox_app.command("check")
def check_cmd(
    isolation: str = typer.Option("strict", help="Profile to check: strict | none."),
) -> None:
    """Print which isolation features are active on this machine (measured from inside a sandbox)."""
    from retool.sandbox.forkserver import find_bwrap, strict_support
    from retool.sandbox.probe import PROBE_CODE, probe_rows

    ok, reason = strict_support()
    typer.echo(f"bubblewrap: {find_bwrap() or 'not found'}")
    typer.echo(f"strict profile available: {'yes' if ok else 'no'} ({reason})")
    with _make("forkserver", isolation, 10.0, 1024, None, workers=1) as executor:
        mode = f" ({executor.strict_mode} mode)" if getattr(executor, "strict_mode", None) else ""
        typer.echo(f"active profile: {executor.isolation}{mode}")
        result = executor.run(PROBE_CODE)
    if not result.ok:
        typer.echo(f"probe failed: {result.stderr or result.returncode}", err=True)
        raise typer.Exit(1)
    rows = probe_rows(json.loads(result.stdout))
    for name, active, detail in rows:
        typer.echo(f"  [{'x' if active else ' '}] {name:36s} {detail}")


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
