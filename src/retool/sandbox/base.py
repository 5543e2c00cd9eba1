"""The executor interface: run model-written Python statelessly and report what happened.

Every backend (subprocess, forkserver, sandboxfusion) implements ``Executor``. The rollout only
ever calls ``arun`` and ``format_tool_content``.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ExecResult:
    ok: bool
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    latency: float  # seconds, wall clock, as seen by the caller
    # Extra facts for stats; not part of the CLI's JSON line.
    memory_killed: bool = field(default=False, repr=False)
    truncated: bool = field(default=False, repr=False)

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("memory_killed")
        d.pop("truncated")
        return d


def format_tool_content(result: ExecResult, timeout: float) -> str:
    """Observation text for the model (SPEC §3)."""
    if result.timed_out:
        return f"Error: execution timed out after {_fmt_seconds(timeout)} seconds."
    if result.ok:
        return result.stdout
    if result.stderr.strip():
        return result.stderr
    return f"Error: process exited with code {result.returncode}."


def _fmt_seconds(timeout: float) -> str:
    return str(int(timeout)) if float(timeout).is_integer() else f"{timeout:g}"


@dataclass
class ExecutorStats:
    calls: int = 0
    successes: int = 0
    errors: int = 0
    timeouts: int = 0
    memory_kills: int = 0
    truncations: int = 0
    total_latency: float = 0.0
    max_latency: float = 0.0

    @property
    def mean_latency(self) -> float:
        return self.total_latency / self.calls if self.calls else 0.0

    def record(self, result: ExecResult) -> None:
        self.calls += 1
        if result.timed_out:
            self.timeouts += 1
        elif result.ok:
            self.successes += 1
        else:
            self.errors += 1
        self.memory_kills += int(result.memory_killed)
        self.truncations += int(result.truncated)
        self.total_latency += result.latency
        self.max_latency = max(self.max_latency, result.latency)

    def as_dict(self) -> dict[str, float]:
        d = {k: float(v) for k, v in asdict(self).items()}
        d["mean_latency"] = self.mean_latency
        return d


class Executor(abc.ABC):
    """Runs code statelessly. Use as a context manager; after ``close()`` nothing of it remains."""

    timeout: float

    def __init__(self) -> None:
        self.stats = ExecutorStats()
        self._stats_lock = threading.Lock()

    @abc.abstractmethod
    def _run(self, code: str) -> ExecResult: ...

    def run(self, code: str) -> ExecResult:
        result = self._run(code)
        with self._stats_lock:
            self.stats.record(result)
        return result

    async def arun(self, code: str) -> ExecResult:
        """Default: run in a worker thread. Backends with native async override this."""
        return await asyncio.to_thread(self.run, code)

    def format_tool_content(self, result: ExecResult) -> str:
        return format_tool_content(result, self.timeout)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
