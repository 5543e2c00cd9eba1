"""Test helper: the fork-server processes of an executor, and the process tree below them."""

from __future__ import annotations

from retool.sandbox.forkserver import ForkServerExecutor
from retool.sandbox.procfs import descendant_pids

__all__ = ["descendant_pids", "server_pids"]


def server_pids(executor: ForkServerExecutor) -> list[int]:
    """PIDs of the executor's live server processes (the bwrap process in strict mode). White-box: reads
    the executor's server slots, which only tests need to see."""
    return [s.proc.pid for s in executor._servers if s is not None and s.alive()]
