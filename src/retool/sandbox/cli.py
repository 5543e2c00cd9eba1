"""``retool sandbox``: run code from stdin in a sandbox (``exec``) and report the active isolation (``check``)."""

from __future__ import annotations

import json
import sys

import typer
from pydantic import ValidationError

from retool.config import SandboxConfig
from retool.sandbox import Executor, SandboxPreimportError, SandboxWorkerError, make_executor
from retool.sandbox.bwrap import find_bwrap, strict_support
from retool.sandbox.probe import PROBE_CODE, import_probe_code, import_rows, probe_rows

sandbox_app = typer.Typer(
    name="sandbox", help="Run model-style Python in the sandbox; check isolation.", no_args_is_help=True
)


def _make(**options: object) -> Executor:
    """The executor of a ``SandboxConfig`` with ``options`` given (None: the config's default)."""
    kwargs = {key: value for key, value in options.items() if value is not None}
    try:
        cfg = SandboxConfig.model_validate(kwargs)
    except ValidationError as exc:  # one clear line per problem, all on the command's last line
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        typer.echo(f"error: invalid sandbox options: {problems}", err=True)
        raise typer.Exit(2) from None
    try:
        return make_executor(cfg)
    except SandboxPreimportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


@sandbox_app.command("exec")
def exec_cmd(
    backend: str | None = typer.Option(
        None, help="forkserver | subprocess | sandboxfusion (default: sandbox.backend)."
    ),
    isolation: str | None = typer.Option(
        None, help="strict | none, forkserver only (default: sandbox.isolation)."
    ),
    timeout: float | None = typer.Option(
        None, help="Wall-clock timeout, seconds (default: sandbox.timeout)."
    ),
    memory_mb: int | None = typer.Option(
        None, "--memory-mb", help="Address-space limit, MiB (default: sandbox.memory_mb)."
    ),
    url: str | None = typer.Option(None, help="SandboxFusion base URL (default: sandbox.sandboxfusion_url)."),
) -> None:
    """Read Python code from stdin, run it once, print the ExecResult as one JSON line.

    Defaults are the ``[sandbox]`` section's; a flag overrides one only when given.
    """
    code = sys.stdin.read()
    options = {"backend": backend, "isolation": isolation, "timeout": timeout, "memory_mb": memory_mb}
    with _make(**options, sandboxfusion_url=url, workers=1) as executor:
        try:
            result = executor.run(code)
        except SandboxWorkerError as exc:  # the sandbox itself failed, not the code: no result to print
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
    typer.echo(json.dumps(result.to_json_dict(), ensure_ascii=False))


@sandbox_app.command("check")
def check_cmd(
    isolation: str = typer.Option("strict", help="Profile to check: strict | none."),
    preimport: str | None = typer.Option(
        None, help="Comma-separated modules to check (default: the configured sandbox.preimport)."
    ),
) -> None:
    """Print which isolation features are active on this machine and whether each pre-import is
    importable by model code (both measured from inside a sandbox). Exit 1 if a probe fails or a module
    cannot be imported there."""
    modules = (
        [m.strip() for m in preimport.split(",") if m.strip()]
        if preimport is not None
        else list(SandboxConfig().preimport)
    )
    ok, reason = strict_support()
    typer.echo(f"bubblewrap: {find_bwrap() or 'not found'}")
    typer.echo(f"strict profile available: {'yes' if ok else 'no'} ({reason})")
    # No pre-imports here: the import probe must read every module's files from inside the child.
    with _make(backend="forkserver", isolation=isolation, workers=1, preimport=[]) as executor:
        strict_mode = getattr(
            executor, "strict_mode", None
        )  # the forkserver's; any executor may run the probe
        mode = f" ({strict_mode} mode)" if strict_mode else ""
        typer.echo(f"active profile: {getattr(executor, 'isolation', '?')}{mode}")
        result = executor.run(PROBE_CODE)
        imports = executor.run(import_probe_code(modules)) if modules else None
    if not result.ok:
        typer.echo(f"probe failed: {result.stderr or result.returncode}", err=True)
        raise typer.Exit(1)
    rows = probe_rows(json.loads(result.stdout))
    for name, active, detail in rows:
        typer.echo(f"  [{'x' if active else ' '}] {name:36s} {detail}")
    if imports is None:
        return
    if not imports.ok:
        typer.echo(f"import probe failed: {imports.stderr or imports.returncode}", err=True)
        raise typer.Exit(1)
    typer.echo("pre-imports, imported afresh inside the sandbox:")
    missing = []
    for label, importable, detail in import_rows(json.loads(imports.stdout)):
        typer.echo(f"  [{'x' if importable else ' '}] {label:36s} {detail}")
        if not importable:
            missing.append(label.removeprefix("import "))
    if missing:
        typer.echo(
            f"error: {', '.join(missing)} cannot be imported inside the sandbox; an executor with these "
            "pre-imports would refuse to start",
            err=True,
        )
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
