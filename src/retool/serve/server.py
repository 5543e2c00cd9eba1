"""Starting ``retool serve``: which models, which address, and the lines a client needs to reach it.

``run_server`` binds (127.0.0.1 unless an API key is given), then announces each served model and the two
environment lines (``PYTRIO_BASE_URL``, ``TINKER_BASE_URL``) before serving with uvicorn until stopped.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from retool.backends import resolve_model_name
from retool.config import Config
from retool.serve.state import Limits, ServeState

logger = logging.getLogger(__name__)


class ServeSetupError(ValueError):
    """A bad command line: an unsafe bind, a malformed --model."""


def parse_models(specs: list[str], config: Config, root: str | Path) -> dict[str, str]:
    """``--model`` values (``PATH`` or ``NAME=PATH``) as name -> path; none: the tiny model under ``root``."""
    if not specs:
        tiny = config.model_copy(deep=True)
        tiny.train.run_dir = str(root)
        path = resolve_model_name(tiny)
        return {path: path}
    out: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        path = str(Path(path).expanduser().resolve())
        out[name or path] = path
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Anything but a loopback address exposes the server beyond this machine: that needs an API key."""
    if not is_loopback(host) and not api_key:
        raise ServeSetupError(f"binding {host} exposes the server beyond this machine: pass --api-key")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this (Linux): without it a keep-alive client waits ~40 ms per answer
    # (uvicorn's h11 writes head and body apart; Nagle holds the body until the client's delayed ACK).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_server(
    config: Config,
    models: dict[str, str],
    root: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    limits: Limits | None = None,
    announce: Callable[[str], None] = logger.info,
    share_base: bool = True,
) -> None:
    """Serve until interrupted (see the module docstring)."""
    # deferred: uvicorn and FastAPI (the app) are the serve extra, imported only when a server starts
    import uvicorn

    from retool.serve.app import create_app  # deferred: imports FastAPI (see above)

    check_bind(host, api_key)
    state = ServeState(config, models, root, limits, share_base=share_base)
    app = create_app(state, api_key)
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}"
    for served in state.models.values():
        announce(f"serving model {served.name} ({served.path}; context {served.max_context})")
    announce(f"storage: {state.storage.root}")
    announce(f"PYTRIO_BASE_URL={url}")
    announce(f"TINKER_BASE_URL={url}")
    if api_key is None:
        announce("no API key required (loopback only); SDKs still want one set: any value works")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=75))
    server.run(sockets=[sock])
