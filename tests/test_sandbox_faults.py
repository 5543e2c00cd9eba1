"""Sandbox faults: a server killed with a call in flight, and runs ended by the memory cap.

A dead server is an infrastructure failure: the call in flight raises ``SandboxWorkerError`` (the rollout
ends that trajectory as ``executor_error`` instead of showing the model a fake error), the server is
respawned, and later calls work. A run ended by its memory cap is ``status == "memory_limit"``, counted
apart from other errors, whichever way Python or the kernel reported it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from retool.sandbox import (
    ExecResult,
    ForkServerExecutor,
    SandboxWorkerError,
    SubprocessExecutor,
    is_memory_failure,
    strict_support,
)
from retool.sandbox.base import ExecutorStats
from sandbox_helpers import descendant_pids, server_pids

STRICT_OK, STRICT_WHY = strict_support()
needs_strict = pytest.mark.skipif(not STRICT_OK, reason=f"strict sandbox unavailable here: {STRICT_WHY}")


def _wait_for(condition, what: str, limit: float = 60.0) -> None:
    """Poll until ``condition()`` holds; the limit only stops a broken test from hanging."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def _kill_server_mid_call(ex: ForkServerExecutor, min_descendants: int) -> tuple[BaseException | None, int]:
    """Start a long call, SIGKILL its server once the call's child runs, return what the call raised."""
    (server_pid,) = server_pids(ex)
    box: dict[str, BaseException | ExecResult] = {}

    def call() -> None:
        try:
            box["result"] = ex.run("import time\ntime.sleep(60)")
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=call)
    worker.start()
    _wait_for(lambda: len(descendant_pids(server_pid)) >= min_descendants, "the call's child to start")
    os.kill(server_pid, signal.SIGKILL)
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert "result" not in box, box
    return box.get("error"), server_pid  # type: ignore[return-value]


@pytest.mark.parametrize(
    "isolation", ["none", pytest.param("strict", marks=[pytest.mark.bwrap, needs_strict])]
)
def test_server_killed_mid_call_fails_that_call_only_and_is_respawned(isolation: str) -> None:
    # none: server -> child; strict: bwrap -> server (pid 1 of its namespace) -> child
    depth = 1 if isolation == "none" else 2
    with ForkServerExecutor(timeout=90.0, workers=1, isolation=isolation, preimport=[]) as ex:
        error, old_pid = _kill_server_mid_call(ex, depth)
        assert isinstance(error, SandboxWorkerError), error
        assert "failed mid-call" in str(error)
        assert ex.stats.worker_failures == 1 and ex.stats.worker_restarts == 1
        assert server_pids(ex) and server_pids(ex) != [old_pid]
        r = ex.run("print('back')")
        assert r.ok and r.stdout == "back\n"
        assert ex.stats.calls == 1  # the lost call is not recorded as a result of the model's code


def test_server_killed_while_idle_loses_nothing() -> None:
    with ForkServerExecutor(timeout=5.0, workers=1, isolation="none", preimport=[]) as ex:
        (pid,) = server_pids(ex)
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not server_pids(ex), "the server to die")
        r = ex.run("print(1)")
        assert r.ok and ex.stats.worker_failures == 0 and ex.stats.worker_restarts == 1


# -- memory limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stderr", "returncode", "timed_out", "oom", "expected"),
    [
        ("Traceback (most recent call last):\n  ...\nMemoryError\n", 1, False, False, True),
        ("numpy.core._exceptions._ArrayMemoryError: Unable to allocate 8.0 GiB\n", 1, False, False, True),
        ("OSError: [Errno 12] Cannot allocate memory\n", 1, False, False, True),
        ("terminate called after throwing an instance of 'std::bad_alloc'\n", -6, False, False, True),
        ("Fatal Python error: _PyMem_Malloc: out of memory\n", -6, False, False, True),
        ("", -9, False, True, True),  # the kernel's OOM killer: SIGKILL, no message
        ("", -9, False, False, False),  # another SIGKILL (the code killed itself)
        ("ValueError: no MemoryError here\n", 1, False, False, False),
        ("MemoryError\n", None, True, False, False),  # a timeout stays a timeout
        ("MemoryError\n", 0, False, False, False),  # printed it and succeeded
    ],
)
def test_memory_failure_classification(
    stderr: str, returncode: int | None, timed_out: bool, oom: bool, expected: bool
) -> None:
    assert is_memory_failure(stderr, returncode, timed_out, oom) is expected


MEMORY_BOMBS = {
    "python": "x = bytearray(8 << 30)",
    "numpy": "import numpy\nx = numpy.ones(1 << 31)",
    "mmap": "import mmap\nm = mmap.mmap(-1, 8 << 30)",
    "caught-and-reraised": "try:\n    x = bytearray(8 << 30)\nexcept MemoryError:\n    raise RuntimeError('gave up')",
}


@pytest.fixture(scope="module")
def capped() -> ForkServerExecutor:
    with ForkServerExecutor(
        timeout=10.0, workers=1, isolation="none", memory_mb=512, preimport=["numpy"]
    ) as ex:
        yield ex


@pytest.mark.parametrize("kind", sorted(MEMORY_BOMBS))
def test_memory_capped_run_is_memory_limit(capped: ForkServerExecutor, kind: str) -> None:
    before = capped.stats.memory_kills
    r = capped.run(MEMORY_BOMBS[kind])
    assert not r.ok and r.status == "memory_limit", r
    assert r.to_json_dict()["status"] == "memory_limit"
    assert capped.stats.memory_kills == before + 1


def test_other_failures_are_not_memory_limit(capped: ForkServerExecutor) -> None:
    errors = capped.stats.errors
    assert capped.run("raise ValueError('x')").status == "error"
    assert capped.run("import os\nos.kill(os.getpid(), 9)").status == "error"
    assert capped.run("print('MemoryError')").status == "ok"
    assert capped.stats.errors == errors + 2


def test_subprocess_executor_reports_memory_limit() -> None:
    ex = SubprocessExecutor(timeout=10.0, memory_mb=512)
    r = ex.run(MEMORY_BOMBS["mmap"])
    assert r.status == "memory_limit" and ex.stats.memory_kills == 1 and ex.stats.errors == 0


def test_stats_count_memory_limits_apart_from_errors() -> None:
    stats = ExecutorStats()
    for result in (
        ExecResult(True, "", "", 0, False, 0.1),
        ExecResult(False, "", "MemoryError", 1, False, 0.1, memory_killed=True),
        ExecResult(False, "", "ValueError", 1, False, 0.1),
        ExecResult(False, "", "", None, True, 0.1),
    ):
        stats.record(result)
    assert (stats.successes, stats.memory_kills, stats.errors, stats.timeouts) == (1, 1, 1, 1)
