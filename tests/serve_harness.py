"""Start ``retool serve`` as a real process on 127.0.0.1 (a free port) for the tests, and always stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


class ServeProcess:
    """``python -m retool serve`` on a free port; ``url`` once it answers ``/api/v1/healthz``."""

    def __init__(self, model: Path, root: Path, *extra: str, api_key: str | None = None) -> None:
        self.model, self.root, self.extra, self.api_key = model, root, extra, api_key
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log = root.parent / f"{root.name}-serve.log"

    def start(self, timeout: float = 120.0) -> ServeProcess:
        cmd = [sys.executable, "-m", "retool", "serve", "--port", "0", "--model", str(self.model)]
        cmd += ["--root", str(self.root), "--set", "backend.device=cpu", "--set", "backend.cpu_threads=1"]
        cmd += list(self.extra)
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        log = self.log.open("a")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the announcement lines come before serving starts
            if line.startswith("PYTRIO_BASE_URL="):
                self.url = line.strip().split("=", 1)[1]
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"retool serve did not start; see {self.log}")
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"retool serve did not answer; see {self.log}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs (a crash, as far as the server can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
