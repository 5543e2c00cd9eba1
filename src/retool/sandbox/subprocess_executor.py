"""``SubprocessExecutor``: the chapter's reference executor (8.4.5), kept faithful on purpose.

One fresh ``python -B -c <bootstrap>`` per call, argument list (no shell); the bootstrap sets RLIMIT_CPU to
timeout + 5 s and execs the code; BLAS/OpenMP threads forced to 1; its own session, and on the wall-clock
timeout the whole process group is SIGKILLed; stdout/stderr go to temp files of which only the tail is read
back (capped to ``output_cap`` chars); a semaphore caps concurrent executions.

It is NOT isolation: the child inherits the host's environment (API keys included), network, files and
uid, and a double-forked + setsid child escapes ``killpg``. It logs a warning saying so when created.
Deviations from the chapter, all additive: the optional memory limit (RLIMIT_AS) and a file-size limit
(RLIMIT_FSIZE, so that endless output cannot fill the disk), an opt-in auto-print of a bare last
expression, and the wait uses a pidfd instead of ``Popen.wait(timeout)`` (which polls with sleeps).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from retool.sandbox.base import ExecResult, Executor, is_memory_failure
from retool.sandbox.procfs import oom_kill_count

logger = logging.getLogger(__name__)

_CHILD_ENV_OVERRIDES = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}

# The chapter's three lines, plus the optional limits (a limit of -1 means "leave as is").
_BOOTSTRAP = """import resource
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
if {mem} > 0: resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
if {fsize} > 0: resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))
exec(compile({code}, '<sandbox>', 'exec'))
"""

_BOOTSTRAP_AUTO_PRINT = """import resource
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
if {mem} > 0: resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
if {fsize} > 0: resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))
import ast as _ast
_tree = _ast.parse({code}, '<sandbox>', 'exec')
if _tree.body and isinstance(_tree.body[-1], _ast.Expr):
    _last = _tree.body.pop()
    exec(compile(_tree, '<sandbox>', 'exec'))
    _value = eval(compile(_ast.Expression(_last.value), '<sandbox>', 'eval'))
    if _value is not None:
        print(repr(_value))
else:
    exec(compile(_tree, '<sandbox>', 'exec'))
"""


def _read_capped(fh: IO[bytes], cap_chars: int) -> tuple[str, bool]:
    """Decode only the tail of a temp file: at most ``cap_chars`` characters (4 bytes each, at most)."""
    fh.seek(0, os.SEEK_END)
    size = fh.tell()
    keep = cap_chars * 4
    fh.seek(max(0, size - keep))
    text = fh.read(keep).decode("utf-8", errors="replace")
    truncated = size > keep
    if len(text) > cap_chars:
        text, truncated = text[-cap_chars:], True
    return text, truncated


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait up to ``timeout`` seconds on a pidfd (no polling loop); None if still running."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return proc.wait() if ready else None


class SubprocessExecutor(Executor):
    """The chapter's ``LocalPythonSandbox``: one fresh interpreter per call, no isolation (see module doc)."""

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        cpu_limit: float | None = None,
        memory_mb: int | None = None,
        output_cap: int = 4096,
        max_concurrency: int = 0,
        auto_print: bool = False,
        python: str | None = None,
        file_size_mb: int = 16,
    ) -> None:
        super().__init__()
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.timeout = float(timeout)
        self.cpu_limit = int(cpu_limit) if cpu_limit else int(self.timeout) + 5
        self.memory_bytes = (int(memory_mb) << 20) if memory_mb else -1
        self.fsize_bytes = (int(file_size_mb) << 20) if file_size_mb else -1
        self.output_cap = int(output_cap)
        self.auto_print = bool(auto_print)
        # The real binary (a pyenv shim is a bash script that adds ~100 ms per call).
        self.python = os.path.realpath(python or sys.executable)
        self.max_concurrency = max_concurrency if max_concurrency > 0 else (os.cpu_count() or 1)
        self._semaphore = threading.BoundedSemaphore(self.max_concurrency)
        logger.warning(
            "SubprocessExecutor is the chapter's reference executor and is NOT isolation: model code sees "
            "this machine's environment variables, files and network, and background processes can outlive "
            "the timeout. Use backend='forkserver' with isolation='strict'."
        )

    def _run(self, code: str) -> ExecResult:
        started = time.perf_counter()
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        template = _BOOTSTRAP_AUTO_PRINT if self.auto_print else _BOOTSTRAP
        bootstrap = template.format(
            cpu=self.cpu_limit, mem=self.memory_bytes, fsize=self.fsize_bytes, code=repr(code)
        )
        env = {**os.environ, **_CHILD_ENV_OVERRIDES}
        oom_before = oom_kill_count()
        with (
            self._semaphore,
            tempfile.TemporaryFile() as stdout_file,
            tempfile.TemporaryFile() as stderr_file,
        ):
            process = subprocess.Popen(
                [self.python, "-B", "-c", bootstrap],
                stdin=subprocess.DEVNULL,
                stdout=stdout_file,
                stderr=stderr_file,
                env=env,
                start_new_session=True,
            )
            returncode = _wait(process, self.timeout)
            timed_out = returncode is None
            if timed_out:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
            stdout, t1 = _read_capped(stdout_file, self.output_cap)
            stderr, t2 = _read_capped(stderr_file, self.output_cap)
        ok = not timed_out and returncode == 0
        return ExecResult(
            ok=ok,
            stdout=stdout,
            stderr=stderr,
            returncode=returncode,
            timed_out=timed_out,
            latency=time.perf_counter() - started,
            memory_killed=is_memory_failure(
                stderr, returncode, timed_out, returncode == -signal.SIGKILL and oom_kill_count() > oom_before
            ),
            truncated=t1 or t2,
        )
