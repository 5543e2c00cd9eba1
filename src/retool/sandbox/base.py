"""The executor interface: run model-written Python statelessly and report what happened.

Every backend (subprocess, forkserver, sandboxfusion) implements ``Executor``. The rollout only
ever calls ``arun`` and ``format_tool_content``. This module also owns the one definition of what an
execution's outcome is (``ExecResult.status``: ok / error / timeout / memory_limit), so that every backend
classifies a memory-capped run alike (``is_memory_failure``).
"""

from __future__ import annotations

import abc
import asyncio
import re
import threading
from dataclasses import asdict, dataclass, field
from typing import Literal

ExecStatus = Literal["ok", "error", "timeout", "memory_limit"]


class SandboxWorkerError(RuntimeError):
    """The executor's own worker (a fork-server, a service) failed while running a call: an infrastructure
    failure, not the model's code failing. The rollout ends that trajectory as ``executor_error``."""


# How a memory cap shows itself in the output of a failed run, whatever reported it: Python's MemoryError
# and its subclasses (numpy's ``_ArrayMemoryError``), at the start of a traceback line; ENOMEM from the
# kernel (mmap, fork); C++ ``std::bad_alloc`` and C libraries' "out of memory" before an abort.
_MEMORY_PATTERN = re.compile(
    r"(?m)^(?:[\w.]+\.)?\w*MemoryError\b|\[Errno 12\]|Cannot allocate memory|std::bad_alloc|"
    r"[Oo]ut of memory"
)


def is_memory_failure(stderr: str, returncode: int | None, timed_out: bool, oom_killed: bool = False) -> bool:
    """Did a finished run fail because of its memory cap?

    ``oom_killed``: the run was SIGKILLed and the kernel counted an OOM kill meanwhile (the OOM killer
    writes nothing to the process's stderr). Otherwise the failure's own stderr decides (see
    ``_MEMORY_PATTERN``). A run that timed out or exited 0 never counts, even if it printed such text.
    """
    if timed_out or returncode == 0:
        return False
    return oom_killed or bool(_MEMORY_PATTERN.search(stderr or ""))


@dataclass
class ExecResult:
    ok: bool
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    latency: float  # seconds, wall clock, as seen by the caller
    # Extra facts for stats; not part of the CLI's JSON line (``status`` summarises them there).
    memory_killed: bool = field(default=False, repr=False)
    truncated: bool = field(default=False, repr=False)

    @property
    def status(self) -> ExecStatus:
        """``timeout``, ``memory_limit`` (the memory cap ended it), ``error`` (any other failure) or ``ok``."""
        if self.timed_out:
            return "timeout"
        if self.memory_killed and not self.ok:
            return "memory_limit"
        return "ok" if self.ok else "error"

    def to_json_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("memory_killed")
        d.pop("truncated")
        d["status"] = self.status
        return d


def format_tool_content(result: ExecResult, timeout: float) -> str:
    """Observation text for the model (docs/spec.md §3)."""
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
    """Counters since the executor started. ``errors`` excludes timeouts and memory-limit kills, which
    are counted apart; ``worker_failures`` counts calls lost to a worker's death (raised as
    ``SandboxWorkerError``, not recorded as results), ``worker_restarts`` the workers started to
    replace dead ones."""

    calls: int = 0
    successes: int = 0
    errors: int = 0
    timeouts: int = 0
    memory_kills: int = 0
    truncations: int = 0
    worker_failures: int = 0
    worker_restarts: int = 0
    total_latency: float = 0.0
    max_latency: float = 0.0

    @property
    def mean_latency(self) -> float:
        return self.total_latency / self.calls if self.calls else 0.0

    def record(self, result: ExecResult) -> None:
        self.calls += 1
        status = result.status
        if status == "timeout":
            self.timeouts += 1
        elif status == "ok":
            self.successes += 1
        elif status == "memory_limit":
            self.memory_kills += 1
        else:
            self.errors += 1
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
