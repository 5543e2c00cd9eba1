"""``ForkServerExecutor``: the default executor — a pool of clean, pre-imported fork-servers, one child per call.

Design (each choice measured against one plain subprocess and one bubblewrap sandbox per call; what the
sandbox must do: docs/spec.md §3):

- **Never fork the trainer.** Each server is a separate interpreter started with ``python -I -S -B`` (no site
  hooks, no user env) running ``_server.py``. It imports a configurable list of modules once (default
  includes sympy and numpy), warms sympy's caches, ``gc.freeze()``-s, and then forks one child per
  execution, so a child starts in milliseconds instead of paying ~0.5 s of imports.
- **Pool = concurrency.** ``workers`` servers (default: CPU count); a call takes an idle server. ``arun``
  runs the blocking exchange on a private thread pool of the same size, so the event loop never blocks.
- **Isolation profile ``strict``** (default when the machine allows it): the server runs inside
  **bubblewrap** (``/usr/bin/bwrap``, ``apt-get install bubblewrap``); run by root, in bwrap's privileged
  mode (no user namespace, so that children can switch to a real unprivileged uid): ``--unshare-pid
  --as-pid-1 --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try --die-with-parent --new-session
  --clearenv``, a tmpfs root holding only read-only binds of what the interpreter needs (its prefix, the
  site-packages in use, the system library directories, ``ld.so.cache``), ``/dev``, ``/proc``, and the
  capabilities cut to the six the server needs. Inside, the server chroots into ``/r`` (a sub-tree of its
  mount namespace; this alone makes ``unshare(CLONE_NEWUSER)`` fail for every child, see unshare(2)). Per
  execution the child becomes pid 1 of a fresh PID namespace, takes private mount and IPC namespaces with a
  fresh size-bounded tmpfs ``/tmp`` and its own ``/proc``, and switches to an unprivileged uid
  (``100000 + slot``; this drops every capability, makes rlimits unraisable and RLIMIT_NPROC a per-sandbox
  fork-bomb limit), with ``no_new_privs``. Killing pid 1 of the namespace kills every descendant,
  double-forked and setsid'd ones included, and waiting for it waits for all of them. The server itself is
  pid 1 of bwrap's namespace (``--as-pid-1``): it never receives orphans (each call's namespace reaps its
  own as that namespace dies), and bwrap then waits for it, so the sandbox's CPU time reaches the caller's
  ``getrusage(RUSAGE_CHILDREN)`` and ``time``; bwrap's own reaper process is never waited for, and with it
  every call's CPU time went unaccounted (measured: a demo's ~55 CPU seconds). No network: the namespace has
  only a down loopback. Not seccomp-filtered (not needed for the listed threats; kernel exploits are out of
  scope: use gVisor/VMs for that).
- **Without root** (``strict_mode() == "userns"``), when the kernel allows unprivileged user namespaces:
  the same bwrap layout plus ``--unshare-user --uid 0``; the server is uid 0 of its own user namespace
  (the caller's uid on the host), and each child, instead of switching uid (only one uid is mapped),
  drops every capability for good (bounding set, ambient set, capset, locked securebits NOROOT /
  NO_SETUID_FIXUP). Everything else (PID/mount/IPC namespaces per call, chroot, rlimits) is identical.
- **Isolation ``none``** (or the fallback, with a loud warning and the reason, when bwrap or namespaces are
  unavailable, or the first server fails to start under bwrap): same servers
  without namespaces; the server is a child sub-reaper that kills every orphan after each call; env is
  still replaced, rlimits still applied.
- Output is drained from pipes by the server, which keeps only a bounded tail (output cap × 4 bytes per
  stream): bounded memory, nothing on disk. The server's own stderr goes to an unlinked temp file.
- **Where the interpreter lives does not matter**: its directories are bound read-only *after* the private
  ``/tmp`` is mounted (and bound back by each child over its own fresh ``/tmp``), so a virtualenv under
  ``/tmp`` is seen as it is on the host. Directories under ``/proc`` or ``/dev`` cannot be shown; strict
  isolation then falls back loudly, naming the path.
- **A pre-import that fails is an error at start** (``SandboxPreimportError``), naming the module, the
  error inside the sandbox and where the module is on the host, so a run never trains with a tool that
  cannot import what the prompt offers.
- **Faults**: a server found dead while idle is restarted before the call (nothing lost); a server that
  dies or hangs with a call in flight is killed and restarted, and that one call raises
  ``SandboxWorkerError`` (the rollout ends its trajectory as ``executor_error``). Counted in
  ``stats.worker_failures`` / ``stats.worker_restarts``. A run ended by its memory cap is reported as
  ``status == "memory_limit"`` (see ``retool.sandbox.base.is_memory_failure``).

Where strict isolation can run and the bubblewrap command line that wraps a server: ``retool.sandbox.bwrap``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict, cast

from retool.errors import UserError
from retool.sandbox.base import ExecResult, Executor, SandboxWorkerError, is_memory_failure
from retool.sandbox.bwrap import (
    CHILD_PRIVATE_DIRS,
    CHROOT,
    SANDBOX_OWNED_DIRS,
    SERVER_ENV,
    bwrap_command,
    find_bwrap,
    is_under,
    python_binary,
    python_paths,
    strict_mode,
)
from retool.sandbox.procfs import descendant_pids

logger = logging.getLogger(__name__)

_SERVER_SOURCE = (Path(__file__).with_name("_server.py")).read_text()
_UID_BASE = 100000
_REPLY_GRACE_S = 10.0  # beyond the timeout, how long the host waits for a server's reply before killing it


class SandboxUnavailableError(UserError, RuntimeError):
    """The requested isolation cannot be provided on this machine."""


# Run in a child at start (see ``_check_child_view``): prints a JSON list of what it could not read.
_CHILD_VIEW_CODE = """import json, os, sys
problems = []
for path in %s:
    try:
        os.listdir(path)
    except OSError as exc:
        problems.append(f"sys.path directory {path}: {type(exc).__name__}: {exc.strerror}")
for name in %s:
    path = getattr(sys.modules.get(name), "__file__", None)
    if path:
        try:
            open(path, "rb").close()
        except OSError as exc:
            problems.append(f"pre-import {name!r} at {path}: {type(exc).__name__}: {exc.strerror}")
print(json.dumps(problems))
"""


class SandboxPreimportError(RuntimeError):
    """A configured pre-import fails inside the sandbox: the executor refuses to start (a tool that cannot
    import what the prompt promises would silently turn every such call into an error)."""


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("sandbox server did not reply in time")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        b = os.read(fd, n)
        if not b:
            raise EOFError("sandbox server closed its pipe")
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


class ServerRequest(TypedDict, total=False):
    """One call to a server (``_server.py``'s request): the code, its timeout, whether to echo the last
    expression."""

    code: str
    timeout: float
    auto_print: bool


class ServerMessage(TypedDict, total=False):
    """What a server sends (``_server.py``): first its ready message (``ready``, ``pid``, ``uid``,
    ``preimport_failed``), then one reply per request (the rest)."""

    ready: bool
    pid: int
    uid: int
    preimport_failed: list[dict[str, str]]
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    oom_killed: bool
    exec_time: float
    server_error: bool


class _Server:
    """One fork-server process and its pipes. Used by one thread at a time (the pool guarantees it)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - unlinked at once; closed in close()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
        self.ready_info: ServerMessage | None = None

    def wait_ready(self, timeout: float) -> ServerMessage:
        if self.ready_info is None:
            try:
                self.ready_info = self._recv(time.monotonic() + timeout)
            except (EOFError, TimeoutError, OSError) as exc:
                raise SandboxUnavailableError(
                    f"sandbox server failed to start: {exc}; {self.log_tail()}"
                ) from exc
        return self.ready_info

    def log_tail(self, n: int = 2000) -> str:
        try:
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - n))
            return self._log.read().decode("utf-8", "replace").strip() or "(no server output)"
        except (OSError, ValueError):
            return "(server log unavailable)"

    def _recv(self, deadline: float) -> ServerMessage:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        (n,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
        return cast(ServerMessage, json.loads(_read_exact(fd, n, deadline)))  # the server's own shape

    def request(self, msg: ServerRequest, timeout: float) -> ServerMessage:
        assert self.proc.stdin is not None
        data = json.dumps(msg).encode()
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()
        return self._recv(time.monotonic() + timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, graceful: bool = True) -> None:
        # The sandbox's inner processes are not our children: hold pidfds to wait for their actual exit.
        pidfds = []
        for pid in descendant_pids(self.proc.pid):
            try:
                pidfds.append(os.pidfd_open(pid))
            except OSError:
                pass
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # EOF: the server exits after its current child
        except OSError:
            pass
        if graceful:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap leads this session; its sandbox dies with it
            except OSError:
                pass
            self.proc.wait()
        deadline = time.monotonic() + 5.0
        for fd in pidfds:
            try:
                select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class ForkServerExecutor(Executor):
    """Pool of fork-servers; see the module docstring for what each isolation profile guarantees."""

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        cpu_limit: float | None = None,
        memory_mb: int = 1024,
        output_cap: int = 4096,
        auto_print: bool = False,
        preimport: Sequence[str] | None = None,
        workers: int = 0,
        isolation: str = "strict",
        python: str | None = None,
        tmp_size_mb: int = 64,
        file_size_mb: int = 16,
        max_processes: int = 64,
        max_open_files: int = 256,
        warmup: bool = True,
        start_timeout: float = 120.0,
    ) -> None:
        """Validate and record the limits, choose the isolation (strict, or a loud fallback: it needs the
        interpreter's paths and the first start attempt), start the pool (see the class docstring).
        ``preimport`` None: the configured default, ``sandbox.preimport`` (``retool.config.SandboxConfig``)."""
        super().__init__()
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if isolation not in ("strict", "none"):
            raise ValueError(f"isolation must be 'strict' or 'none', got {isolation!r}")
        self.timeout = float(timeout)
        self.cpu_limit = float(cpu_limit) if cpu_limit else self.timeout + 5.0
        self.memory_mb = int(memory_mb)
        self.output_cap = int(output_cap)
        self.auto_print = bool(auto_print)
        if preimport is None:
            # deferred: pydantic (retool.sandbox imports with the standard library alone)
            from retool.config import SandboxConfig

            preimport = SandboxConfig().preimport
        self.preimport = list(preimport)
        self.workers = int(workers) if workers and workers > 0 else (os.cpu_count() or 1)
        self.python = python_binary(python)
        self._choose_isolation(isolation)
        self._limits = {
            "tmp_size_mb": int(tmp_size_mb),
            "fsize_bytes": int(file_size_mb) << 20,
            "nproc": int(max_processes),
            "nofile": int(max_open_files),
        }
        self._warmup = warmup
        self._start_timeout = start_timeout
        self._closed = False
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._servers: list[_Server | None] = [None] * self.workers
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix="sandbox"
        )
        self._spawner = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sandbox-spawn"
        )
        try:
            try:
                self._start_all()
            except SandboxUnavailableError as exc:
                if self.isolation != "strict":
                    raise
                self._stop_all()
                self._fallback(str(exc))
                self._start_all()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ lifecycle
    def _choose_isolation(self, isolation: str) -> None:
        """``strict`` where this machine and the interpreter's file layout allow it, else a loud fallback."""
        self.requested_isolation = isolation
        self.isolation = isolation
        self.isolation_reason = ""
        self.strict_mode: str | None = None
        if isolation == "strict":
            self.strict_mode, reason = strict_mode()
            if self.strict_mode is None:
                self._fallback(reason, stacklevel=4)
        self._binds, self._sys_path = python_paths(self.python)
        self._rebind = [b for b in self._binds if any(is_under(b, d) for d in CHILD_PRIVATE_DIRS)]
        unshowable = [
            b
            for b in self._binds
            if b not in self._rebind and any(is_under(b, d) for d in SANDBOX_OWNED_DIRS)
        ]
        if unshowable and self.isolation == "strict":
            self._fallback(
                f"the interpreter's files at {', '.join(unshowable)} lie below a directory the strict "
                "sandbox replaces (/proc, /dev); install the environment elsewhere (e.g. /opt)",
                stacklevel=4,
            )

    def _fallback(self, reason: str, stacklevel: int = 3) -> None:
        self.isolation = "none"
        self.strict_mode = None
        self.isolation_reason = reason
        msg = (
            f"SANDBOX NOT ISOLATED: strict isolation is unavailable ({reason}); falling back to "
            "isolation='none': model code can read this machine's files and use its network."
        )
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)  # at the executor's creator

    def _server_cmd(self, slot: int) -> tuple[list[str], dict[str, str] | None]:
        cfg = {
            "strict": self.isolation == "strict",
            "drop": "setuid" if self.strict_mode == "privileged" else "caps",
            "chroot": CHROOT,
            "uid": _UID_BASE + slot,
            "timeout": self.timeout,
            "cpu_limit": max(1, int(self.cpu_limit)),
            "memory_bytes": self.memory_mb << 20,
            "output_cap": self.output_cap,
            "preimport": self.preimport,
            "warmup": self._warmup,
            "sys_path": self._sys_path,
            "rebind": self._rebind,
            "parent_pid": os.getpid(),
            **self._limits,
        }
        py = [self.python, "-I", "-S", "-B", "-c", _SERVER_SOURCE, json.dumps(cfg)]
        if self.isolation == "strict":
            bwrap = find_bwrap()
            assert bwrap is not None
            cmd = bwrap_command(bwrap, self.python, self._binds, userns=self.strict_mode == "userns")
            return cmd + py[1:], None
        return py, dict(SERVER_ENV)

    def _spawn(self, slot: int) -> _Server:
        # Always from the one long-lived spawner thread: bwrap's --die-with-parent (and the server's own
        # PDEATHSIG) fire when the *thread* that forked them exits, so a server started from a short-lived
        # caller thread would die with it.
        cmd, env = self._server_cmd(slot)
        return self._spawner.submit(_Server, cmd, env).result()

    def _start_all(self) -> None:
        for slot in range(self.workers):  # start all first: their imports overlap
            self._servers[slot] = self._spawn(slot)
        for server in self._servers:
            assert server is not None
            info = server.wait_ready(self._start_timeout)
            if info.get("preimport_failed"):
                raise SandboxPreimportError(self._preimport_message(info["preimport_failed"]))
        self._check_child_view()
        for slot in range(self.workers):
            self._idle.put(slot)
        logger.info(
            "forkserver sandbox ready: %d workers, isolation=%s, preimport=%s",
            self.workers,
            self.isolation,
            self.preimport,
        )

    def _check_child_view(self) -> None:
        """Refuse to start if model code could not read what the server imported.

        The server imports as root (or its namespace's root); a child runs as an unprivileged uid, so a
        directory the server reads (a virtualenv made with mode 0700, a home directory) may be closed to
        the child: lazily imported submodules would then fail in every call. One call on the first
        server lists each sys.path directory and opens each pre-imported module's file, as model code.
        """
        server = self._servers[0]
        assert server is not None
        code = _CHILD_VIEW_CODE % (json.dumps(self._sys_path), json.dumps(self.preimport))
        try:
            reply = server.request({"code": code, "timeout": 30}, 30 + _REPLY_GRACE_S)
        except (OSError, EOFError, TimeoutError, ValueError) as exc:
            raise SandboxUnavailableError(
                f"sandbox server failed its first call: {exc}; {server.log_tail()}"
            ) from exc
        try:
            problems = json.loads(reply["stdout"])
        except (TypeError, ValueError):
            raise SandboxPreimportError(
                f"sandbox self-check failed at start: {reply.get('stderr') or reply.get('returncode')}"
            ) from None
        if problems:
            who = f"uid {_UID_BASE}+" if self.strict_mode == "privileged" else "model code"
            lines = [f"sandbox start refused: model code (run as {who}) cannot read the environment:"]
            lines += [f"  - {item}" for item in problems]
            lines.append(
                "Fix: make those directories readable by everyone (chmod -R o+rX DIR), or install the "
                "environment where they are (e.g. /opt/venv)."
            )
            raise SandboxPreimportError("\n".join(lines))

    def _preimport_message(self, failed: list[dict[str, str]]) -> str:
        """Why each pre-import failed inside the sandbox, and where the module is on the host (if it is)."""
        lines = [
            f"sandbox pre-import failed (isolation={self.isolation}); the executor does not start, since "
            "model code could not import what the prompt offers:"
        ]
        for item in failed:
            name, error = item.get("module", "?"), item.get("error", "?")
            lines.append(f"  - {name!r}: {error} inside the sandbox; {self._host_location(name)}")
        lines.append(
            "Fix: install the module into the interpreter's site-packages "
            f"({', '.join(self._sys_path) or 'none found'}), or remove it from sandbox.preimport."
        )
        return "\n".join(lines)

    def _host_location(self, name: str) -> str:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            return f"on the host it cannot be found either ({type(exc).__name__}: {exc})"
        if spec is None:
            return f"it is not installed for {self.python} on the host either"
        where = spec.origin if spec.origin not in (None, "built-in", "frozen") else None
        where = where or next(iter(spec.submodule_search_locations or []), None)
        if where is None:
            return "on the host it is a built-in module"
        where = os.path.realpath(where)
        visible = self.isolation == "none" or any(is_under(where, b) for b in self._binds)
        on_path = any(is_under(where, os.path.realpath(p)) for p in self._sys_path)
        if visible and on_path:
            return f"on the host it is {where}, which the sandbox sees, so it fails to import there"
        if not on_path:
            return (
                f"on the host it is {where}, which is not in the sandbox's sys.path "
                "(only the interpreter's site-packages are; PYTHONPATH and source trees are not)"
            )
        return f"on the host it is {where}, a path the sandbox could not see"

    def _stop_all(self) -> None:
        for slot, server in enumerate(self._servers):
            if server is not None:
                server.close(graceful=False)
                self._servers[slot] = None
        while True:
            try:
                self._idle.get_nowait()
            except queue.Empty:
                break

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        for server in self._servers:  # EOF to all first: they exit in parallel
            if server is not None and server.proc.stdin is not None:
                try:
                    server.proc.stdin.close()
                except OSError:
                    pass
        for slot, server in enumerate(self._servers):
            if server is not None:
                server.close(graceful=True)
                self._servers[slot] = None
        self._spawner.shutdown(wait=True)

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------ running
    def _run(self, code: str) -> ExecResult:
        started = time.perf_counter()
        if self._closed:
            raise RuntimeError("executor is closed")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        while True:  # wait for an idle server, but notice a close() meanwhile
            try:
                slot = self._idle.get(timeout=0.5)
                break
            except queue.Empty:
                if self._closed:
                    raise RuntimeError("executor is closed") from None
        try:
            reply = self._exchange(slot, code)
        finally:
            self._idle.put(slot)
        timed_out = bool(reply["timed_out"])
        return ExecResult(
            ok=(not timed_out) and reply["returncode"] == 0,
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            returncode=reply["returncode"],
            timed_out=timed_out,
            latency=time.perf_counter() - started,
            memory_killed=is_memory_failure(
                reply["stderr"], reply["returncode"], timed_out, bool(reply.get("oom_killed"))
            ),
            truncated=bool(reply.get("truncated")),
        )

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def _exchange(self, slot: int, code: str) -> ServerMessage:
        server = self._servers[slot]
        if server is None or not server.alive():
            if server is not None:  # died while idle (killed from outside): nothing was lost
                logger.warning("sandbox server %d died (%s); restarting it", slot, server.log_tail(300))
                server.close(graceful=False)
            server = self._servers[slot] = self._spawn(slot)
            self._count(worker_restarts=1)
        try:
            server.wait_ready(self._start_timeout)
            return server.request(
                {"code": code, "timeout": self.timeout, "auto_print": self.auto_print},
                self.timeout + _REPLY_GRACE_S,
            )
        except (OSError, EOFError, TimeoutError, ValueError, SandboxUnavailableError) as exc:
            # The server hung or died with this call in flight: kill it (its sandbox dies with it), start
            # a fresh one for the next call, and fail this call as the infrastructure failure it is (it
            # must not reach the model as if its own code had failed).
            log = server.log_tail(300)
            server.close(graceful=False)
            self._count(worker_failures=1)
            if not self._closed:
                self._servers[slot] = self._spawn(slot)
                self._count(worker_restarts=1)
            else:
                self._servers[slot] = None
            logger.error("sandbox server %d failed mid-call (%s; %s); restarted it", slot, exc, log)
            raise SandboxWorkerError(f"sandbox server {slot} failed mid-call: {exc}") from exc

    async def arun(self, code: str) -> ExecResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.run, code)
