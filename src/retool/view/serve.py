"""``retool view --serve``: the site on 127.0.0.1, rebuilt when its inputs change (a run in progress).

A request for the page (``/`` or ``/index.html``) first looks at the inputs again: new eval files or
run folders under the given paths, and the size / modification time of every input file. If anything
changed, the site is rebuilt before the page is sent, so a browser refresh shows the new steps. Every
response says ``Cache-Control: no-store`` for the same reason. Chunks the page before the rebuild
referenced stay on disk for one more build, so a page still open keeps working.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from retool.view.site import SiteResult, build_site, discover

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"  # never another interface: the records hold model output and local paths


def _signature(paths: Sequence[str | Path]) -> tuple[tuple[str, int, int], ...]:
    inputs = discover(paths)
    out = []
    for f in inputs.files():
        try:
            st = f.stat()
        except OSError:
            continue
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


class LiveSite:
    """The built site plus what it was built from; ``refresh`` rebuilds only when the inputs changed."""

    def __init__(self, paths: Sequence[str | Path], out_dir: str | Path) -> None:
        self.paths = list(paths)
        self.out_dir = Path(out_dir)
        self._lock = threading.Lock()
        self._signature: tuple[tuple[str, int, int], ...] = ()
        self._previous_chunks: list[str] = []
        self.result: SiteResult | None = None
        self.builds = 0

    def refresh(self) -> bool:
        """Rebuild if an input changed; returns whether it did."""
        with self._lock:
            signature = _signature(self.paths)
            if self.result is not None and signature == self._signature:
                return False
            result = build_site(self.paths, self.out_dir, keep=self._previous_chunks)
            self._previous_chunks = result.chunks
            self._signature = signature
            self.result = result
            self.builds += 1
            logger.info(
                "built %s: %d trajectories (%.2fs)", result.index, result.trajectories, result.seconds
            )
            return True


class _Handler(SimpleHTTPRequestHandler):
    site: LiveSite

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] in ("/", "/index.html"):
            try:
                self.site.refresh()
            except Exception:  # serve the last good build rather than an error page
                logger.exception("rebuilding the site failed; serving the previous build")
        super().do_GET()

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("%s " + format, self.address_string(), *args)


def make_server(site: LiveSite, port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for ``site`` on 127.0.0.1 (``port=0``: any free port; see ``server_address``)."""
    handler = functools.partial(type("Handler", (_Handler,), {"site": site}), directory=str(site.out_dir))
    return ThreadingHTTPServer((HOST, port), handler)


def serve(
    paths: Sequence[str | Path],
    out_dir: str | Path,
    port: int = 8000,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Build, then serve until interrupted (Ctrl-C); ``on_ready`` gets the URL once it listens."""
    site = LiveSite(paths, out_dir)
    site.refresh()
    server = make_server(site, port)
    host, bound = server.server_address[:2]
    if on_ready is not None:
        name = host.decode() if isinstance(host, bytes) else str(host)
        on_ready(f"http://{name}:{bound}/")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
