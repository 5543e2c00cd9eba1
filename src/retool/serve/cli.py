"""``retool serve``: the PyTRIO and Tinker training APIs on this machine, backed by the local backend."""

from __future__ import annotations

from pathlib import Path

import typer

from retool.errors import UserError

DEFAULT_ROOT = "runs/serve"


def serve_command(
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to bind; anything but loopback needs --api-key."
    ),
    port: int = typer.Option(8000, "--port", help="TCP port (0: a free one)."),
    models: list[str] = typer.Option(
        [], "--model", help="A base model to serve: PATH, or NAME=PATH (repeatable). Default: the tiny model."
    ),
    root: Path = typer.Option(Path(DEFAULT_ROOT), "--root", help="Folder for everything clients save."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="RETOOL_SERVE_API_KEY", help="Key clients must send."
    ),
    config: str | None = typer.Option(
        None, "--config", "-c", help="Config TOML or preset (backend, lora, model)."
    ),
    overrides: list[str] = typer.Option([], "--set", help="Config override section.key=value (repeatable)."),
    max_request_mb: float = typer.Option(
        64.0, "--max-request-mb", help="Largest request body accepted (413 above)."
    ),
    gather_ms: float = typer.Option(
        10.0, "--gather-ms", help="How long a sampler waits for concurrent requests to join a batch."
    ),
    shared_base: bool = typer.Option(
        True,
        "--shared-base/--base-per-client",
        help="One copy of each base model's weights for all clients (each adds its LoRA adapter), or a "
        "copy per client (more memory; samples through merged LoRA weights).",
    ),
) -> None:
    """Serve the PyTRIO and Tinker training APIs (sampling, LoRA training, checkpoints) from this machine."""
    # deferred: the server's stack (FastAPI, uvicorn, the SDKs' protocol modules: the serve extra) loads only
    # when serving, so `retool --help` and the other commands never need it.
    from retool.config import ConfigError, load_config
    from retool.serve.server import ServeSetupError, check_bind, parse_models, run_server
    from retool.serve.state import Limits

    try:
        check_bind(host, api_key)
        cfg = load_config(config, overrides)
        served = parse_models(models, cfg, root)
        limits = Limits(max_body_bytes=int(max_request_mb * 1024 * 1024), gather_ms=gather_ms)
        run_server(
            cfg,
            served,
            root,
            host=host,
            port=port,
            api_key=api_key,
            limits=limits,
            announce=typer.echo,
            share_base=shared_base,
        )
    except (ConfigError, ServeSetupError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
