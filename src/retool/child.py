"""Child interpreters on a socketpair: how the verifier's workers and the trainer's replica processes start.

A plain ``python -c`` exec rather than ``multiprocessing`` spawn/forkserver, because those re-import the
caller's ``__main__`` in every child (a trainer script's top-level imports, or a crash for scripts without
an ``if __name__ == "__main__"`` guard) and share one process-wide forkserver with other stages.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def start_child(boot: str) -> tuple[subprocess.Popen[bytes], Connection]:
    """Run ``python -c boot FD`` where FD is the child's end of a socketpair; (the process, our end)."""
    parent_sock, child_sock = socket.socketpair()
    env = dict(os.environ)
    # The child must import this very copy of retool, whatever sys.path tricks the parent used.
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", boot, str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
    finally:
        child_sock.close()
    return process, Connection(parent_sock.detach())


def messages(conn: Connection) -> Iterator[Any]:
    """The messages arriving on ``conn`` until the other side sends ``None`` (stop) or goes away."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        yield message
