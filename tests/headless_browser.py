"""Test helper: headless Chromium for the viewer's browser tests, its bench and the README screenshot.

Uses the Python ``playwright`` package (a dev extra) to drive the system's Chromium (Debian's
``chromium``, installed by ``scripts/setup.sh --dev``); Playwright's own browser downloads are never
used. ``find_chromium`` says why a browser cannot be had, so tests skip with that reason.

The flags keep Chromium off the network: in a closed sandbox its background services (component
updates, sync, QUIC probes) would otherwise try to connect and fail noisily.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM_ARGS: tuple[str, ...] = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm; Chromium then crashes on big pages
)
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class BrowserUnavailable(RuntimeError):
    """No usable headless browser here; the message says what is missing."""


def find_chromium() -> str:
    """Path of a Chromium binary: ``$RETOOL_CHROMIUM`` or the first of the usual names on ``PATH``."""
    env = os.environ.get("RETOOL_CHROMIUM")
    if env:
        if not Path(env).is_file():
            raise BrowserUnavailable(f"RETOOL_CHROMIUM={env} does not exist")
        return env
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise BrowserUnavailable(
        "no Chromium found (install Debian's chromium: `bash scripts/setup.sh --dev` as root, "
        "or `apt-get install chromium`; or set RETOOL_CHROMIUM)"
    )


def check_available() -> str:
    """The Chromium path, after checking that Playwright imports; ``BrowserUnavailable`` otherwise."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        raise BrowserUnavailable(
            f"the playwright package is not installed ({exc}); `pip install -e .[dev]`"
        ) from None
    return find_chromium()


@contextlib.contextmanager
def launch(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A Playwright browser context: headless Chromium with a fresh, throw-away profile."""
    from playwright.sync_api import sync_playwright

    executable = check_available()
    with tempfile.TemporaryDirectory(prefix="retool-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=list(CHROMIUM_ARGS),
            viewport={"width": width, "height": height},
        )
        try:
            yield context
        finally:
            context.close()


class PageWatch:
    """Collects a page's console errors, uncaught exceptions and every request that left the page."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on(
            "console", lambda msg: self.errors.append(f"console: {msg.text}") if msg.type == "error" else None
        )
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("requestfailed", lambda req: self.errors.append(f"requestfailed: {req.url}"))
        page.on("request", lambda req: self.requests.append(req.url))

    def external_requests(self) -> list[str]:
        """Requests to anything but local files, data URLs and 127.0.0.1 (there must be none)."""
        local = ("file://", "data:", "http://127.0.0.1", "about:")
        return [u for u in self.requests if not u.startswith(local)]


def open_site(context: Any, url: str, timeout_ms: int = 30_000) -> tuple[Any, PageWatch]:
    """A new page at ``url``, waited on until the app says it is ready (``body[data-ready]``)."""
    page = context.new_page()
    watch = PageWatch(page)
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=timeout_ms)
    return page, watch
