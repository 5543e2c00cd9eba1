"""The fork-server that runs inside the sandbox: a clean, pre-imported interpreter forking one child per call.

This file is executed as a *standalone script* (``python -I -S -B -c <this source> <json config>``), never
imported by the trainer: it must not import ``retool`` (which is not visible inside the sandbox) and it must
only use the standard library plus the configured pre-imports.

Protocol (over the server's stdin/stdout pipes, which it moves to private descriptors at start):
every message is a 4-byte big-endian length followed by UTF-8 JSON. The server first sends
``{"ready": true, ...}``; then, per request ``{"code", "timeout", "auto_print"}``, exactly one reply
``{"stdout", "stderr", "returncode", "timed_out", "truncated", "oom_killed", "exec_time"}``; the ready
message lists the pre-imports that failed as ``preimport_failed: [{"module", "error"}]``.
EOF on the request pipe makes it exit.

Per execution (see ``bwrap.py`` for the bubblewrap layer around this process):
- strict: ``unshare(CLONE_NEWPID)`` then ``fork`` -> the child is pid 1 of a fresh PID namespace, so killing it
  kills every descendant (double-forked, setsid'd ones included) and waiting for it waits for all of them;
  the child then takes a private mount + IPC namespace, mounts fresh size-bounded tmpfs on /tmp and
  /dev/shm (binding back on top the read-only directories of the interpreter that lie below them, e.g. a
  virtualenv under /tmp) and a /proc that only shows its own namespace, and switches to an unprivileged per-server uid
  (as root) or drops every capability (user-namespace mode), with no_new_privs. The server itself was chroot-ed into a sub-directory of its mount
  namespace, which makes ``unshare(CLONE_NEWUSER)`` fail with EPERM for every child (see unshare(2)).
- none: ``fork`` + ``setsid``; the server is a child sub-reaper and kills every orphan that reaches it.
- both: rlimits (CPU, AS, FSIZE, NOFILE, NPROC, CORE; CPU hard = soft + 1 s), stdin = /dev/null,
  stdout/stderr are pipes the server drains while keeping only a bounded tail (bounded memory, nothing on disk), the
  environment is replaced, ``random`` and ``numpy.random`` are reseeded.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import ctypes
import gc
import importlib
import io
import json
import os
import random
import resource
import select
import signal
import struct
import sys
import threading
import time
import traceback
import types

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 1 << 14
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)

CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _setns(fd: int, flags: int) -> None:
    _check(_libc.setns(fd, flags), "setns")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            src.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _drop_all_capabilities() -> None:
    """Leave no capability in any set, for good: lock the securebits so uid 0 never regains them."""
    PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 24, 47, 4
    # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS off, NO_CAP_AMBIENT_RAISE: each with its _LOCKED bit.
    securebits = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
    _prctl(PR_SET_SECUREBITS, securebits)
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            break  # EINVAL past the last capability the kernel knows
    _libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)

    class _Header(ctypes.Structure):
        _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))

    class _Data(ctypes.Structure):
        _fields_ = (
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        )

    header = _Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_Data * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


# ----------------------------------------------------------------------------------------------- framing
def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        b = os.read(fd, n)
        if not b:
            raise EOFError
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _recv(fd: int) -> dict:
    (n,) = struct.unpack(">I", _read_exact(fd, 4))
    return json.loads(_read_exact(fd, n))


def _send(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


# ----------------------------------------------------------------------------------------------- child
def _compile_user(code: str, auto_print: bool):  # -> code object
    tree = ast.parse(code, "<string>", "exec")
    if auto_print and tree.body and isinstance(tree.body[-1], ast.Expr):
        # REPL semantics for a bare last expression: print its repr unless it is None.
        last = tree.body[-1]
        name = ast.Name("__retool_last__", ast.Store())
        assign = ast.Assign([name], last.value)
        test = ast.Compare(ast.Name("__retool_last__", ast.Load()), [ast.IsNot()], [ast.Constant(None)])
        call = ast.Call(
            ast.Name("print", ast.Load()),
            [ast.Call(ast.Name("repr", ast.Load()), [ast.Name("__retool_last__", ast.Load())], [])],
            [],
        )
        stmt_if = ast.If(test, [ast.Expr(call)], [])
        for node in (assign, stmt_if):
            ast.copy_location(node, last)
        tree.body[-1:] = [assign, stmt_if]
        ast.fix_missing_locations(tree)
    return compile(tree, "<string>", "exec")


def _run_user(code: str, auto_print: bool) -> int:
    """Run like ``python -c``: a fresh ``__main__``; traceback on stderr; the exit status returned."""
    atexit._clear()  # only the user's own exit handlers run, not the server's inherited ones
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    rc = 0
    try:
        try:
            compiled = _compile_user(code, auto_print)
        except (SyntaxError, ValueError) as exc:  # like `python -c`: no "Traceback" header (ValueError: NUL)
            traceback.print_exception(type(exc), exc, None)
            return 1
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        rc = _exit_code(exc)
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # hide this runner's frame
        try:
            traceback.print_exception(type(exc), exc, tb)
        except BaseException:
            pass
        rc = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as Python does
        atexit._run_exitfuncs()
    except SystemExit as exc:
        rc = _exit_code(exc)
    except BaseException:
        pass
    return rc


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except BaseException:
        pass
    return 1


def _child(cfg: dict, req: dict, out_w: int, err_w: int, devnull: int) -> None:
    """The forked child that becomes the model's Python. The steps run in this order, in this process:
    namespaces and mounts before the privileges that allow them are dropped, limits before the model's
    code can run, the streams last (after them nothing of the server's is open)."""
    os.setsid()
    if cfg["strict"]:
        _isolate(cfg)
    _limit(cfg)
    _own_streams(out_w, err_w, devnull)
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    gc.enable()
    rc = _run_user(req["code"], bool(req.get("auto_print")))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(rc)


def _isolate(cfg: dict) -> None:
    """Strict mode: private mount and IPC namespaces, fresh /tmp, /proc and /dev/shm, then no privileges."""
    _unshare(CLONE_NEWNS | CLONE_NEWIPC)
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    # Read-only binds below /tmp or /dev/shm (a virtualenv at /tmp/venv) would vanish under the fresh
    # tmpfs mounted next: hold each by an O_PATH descriptor and bind it back on top afterwards.
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)) for path in cfg["rebind"]]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmp_size_mb']}m,mode=1777")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    if os.path.isdir("/dev/shm"):  # POSIX semaphores/shared memory (multiprocessing) need it writable
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmp_size_mb']}m,mode=1777")
    for path, fd in held:
        os.makedirs(path, mode=0o755, exist_ok=True)
        # A bind keeps the source mount's read-only flag; the uid switch below adds the owner check.
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        os.close(fd)
    if cfg.get("drop", "setuid") == "setuid":
        uid = cfg["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # drops every capability
    else:
        _drop_all_capabilities()  # user-namespace mode: only uid 0 is mapped, so drop caps instead


def _limit(cfg: dict) -> None:
    """No new privileges, and the resource limits (CPU hard = soft + 1 s)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_DUMPABLE, 1)  # the server set 0 for itself; the child may read its own /proc/self
    if not cfg["strict"]:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    cpu = int(cfg["cpu_limit"])
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        resource.RLIMIT_AS: (cfg["memory_bytes"], cfg["memory_bytes"]),
        resource.RLIMIT_FSIZE: (cfg["fsize_bytes"], cfg["fsize_bytes"]),
        resource.RLIMIT_NOFILE: (cfg["nofile"], cfg["nofile"]),
        resource.RLIMIT_NPROC: (cfg["nproc"], cfg["nproc"]),
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, (soft, hard) in limits.items():
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            if which != resource.RLIMIT_NPROC:  # NPROC may already be lower; anything else is a bug
                raise


def _own_streams(out_w: int, err_w: int, devnull: int) -> None:
    """stdin /dev/null, stdout/stderr the server's pipes, nothing else open; a clean environment and
    signal dispositions as a fresh interpreter has them."""
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 1 << 16)  # the request/reply pipes and everything else of the server
    os.chdir("/tmp" if os.path.isdir("/tmp") else "/")
    os.environ.clear()
    os.environ.update(CHILD_ENV)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)  # as CPython does at start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------- server
class _Tail:
    """Keeps only the last ``keep`` bytes ever written; counts the rest."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.buf = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > self.keep:
            del self.buf[: len(self.buf) - self.keep]


def _decode_tail(tail: _Tail, cap: int) -> tuple[str, bool]:
    text = bytes(tail.buf).decode("utf-8", errors="replace")
    truncated = tail.total > len(tail.buf)
    if len(text) > cap:
        text, truncated = text[-cap:], True
    return text, truncated


def _kill_strays(me: int) -> None:
    """Sub-reaper cleanup (isolation none): kill and reap every process re-parented to this server."""
    for _ in range(200):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) > 1 and int(fields[1]) == me:
                found = True
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.001)
                continue
            found = True
        if not found:
            return


# This and ``_kill_strays``'s /proc scan repeat ``retool.sandbox.procfs``: this script runs standalone inside
# the sandbox, where ``retool`` cannot be imported.
def _oom_kills() -> int:
    """The kernel's count of OOM kills since boot (``/proc/vmstat``, Linux >= 4.13); -1 if unknown."""
    try:
        with open("/proc/vmstat", "rb") as fh:
            for line in fh:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def _execute(cfg: dict, req: dict, devnull: int, pidns_fd: int | None) -> dict:
    """Run one request in a fresh child and return its result: fork, bounded reads until exit or the
    wall-clock kill, the reap of every descendant, and the classification (ok / error / timeout /
    memory_limit). Every path out closes the pipes and the child's pidfd."""
    started = time.perf_counter()
    oom_before = _oom_kills()
    timeout = float(req.get("timeout") or cfg["timeout"])
    pid, out_r, err_r = _fork_child(cfg, req, devnull, pidns_fd)
    keep = cfg["output_cap"] * 4 + 16  # UTF-8: at most 4 bytes per character, so the tail has >= cap chars
    tails = {out_r: _Tail(keep), err_r: _Tail(keep)}
    pidfd = os.pidfd_open(pid)
    try:
        timed_out, status = _collect(pid, pidfd, tails, started + timeout, pidns_fd is None)
    finally:
        for fd in (out_r, err_r, pidfd):
            os.close(fd)
    stdout, t1 = _decode_tail(tails[out_r], cfg["output_cap"])
    stderr, t2 = _decode_tail(tails[err_r], cfg["output_cap"])
    if timed_out:
        returncode = None
    elif os.WIFEXITED(status):
        returncode = os.WEXITSTATUS(status)
    else:
        returncode = -os.WTERMSIG(status)
    # The kernel's OOM killer leaves no message, only a SIGKILL: tell it from other kills by its counter.
    oom_killed = not timed_out and returncode == -signal.SIGKILL and _oom_kills() > oom_before
    return {
        "stdout": stdout,
        "stderr": stderr,
        "returncode": returncode,
        "timed_out": timed_out,
        "truncated": t1 or t2,
        "oom_killed": oom_killed,
        "exec_time": time.perf_counter() - started,
    }


def _fork_child(cfg: dict, req: dict, devnull: int, pidns_fd: int | None) -> tuple[int, int, int]:
    """Fork the child (strict: as pid 1 of a new PID namespace); returns its pid and the read ends of
    its stdout and stderr pipes."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    if pidns_fd is not None:
        _unshare(CLONE_NEWPID)  # only the next fork lands in the new namespace (as its pid 1)
    try:
        pid = os.fork()
    except BaseException:
        if pidns_fd is not None:
            _setns(pidns_fd, CLONE_NEWPID)
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    if pid != 0 and pidns_fd is not None:
        _setns(pidns_fd, CLONE_NEWPID)  # later forks of the server go back to its own namespace
    if pid == 0:
        try:
            os.close(out_r)
            os.close(err_r)
            _child(cfg, req, out_w, err_w, devnull)
        except BaseException as exc:
            try:
                os.write(err_w, f"sandbox setup failed: {exc!r}\n".encode())
            except BaseException:
                pass
        os._exit(71)
    os.close(out_w)
    os.close(err_w)
    return pid, out_r, err_r


def _collect(pid: int, pidfd: int, tails: dict, deadline: float, reap_strays: bool) -> tuple[bool, int]:
    """Read the child's output into ``tails`` until it exits or ``deadline`` passes (then kill it), reap
    it (and, outside a PID namespace, every stray it left), drain what is left. Returns (timed out,
    wait status)."""
    poller = select.poll()
    for fd in (*tails, pidfd):
        poller.register(fd, select.POLLIN)
    open_fds = set(tails)
    timed_out = exited = False
    while not exited:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(max(1, int(remaining * 1000))):
            if fd == pidfd:
                exited = True
            else:
                _read_into(fd, tails, poller, open_fds)
    if timed_out:
        # Strict: pid 1 of its PID namespace; its death makes the kernel kill every other member.
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    _, status = os.waitpid(pid, 0)
    if reap_strays:
        _kill_strays(os.getpid())
    # Drain what is left; every writer is dead now, so EOF comes at once (bounded anyway).
    drain_deadline = time.perf_counter() + 1.0
    while open_fds and time.perf_counter() < drain_deadline:
        for fd, _ in poller.poll(50):
            if fd != pidfd:
                _read_into(fd, tails, poller, open_fds)
    return timed_out, status


def _read_into(fd: int, tails: dict, poller: select.poll, open_fds: set) -> None:
    data = os.read(fd, 1 << 16)
    if data:
        tails[fd].add(data)
    else:
        poller.unregister(fd)
        open_fds.discard(fd)


def _preimport(cfg: dict) -> list[dict]:
    failed = []
    for name in cfg["preimport"]:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # SystemExit from a module's top level counts as a failure too
            failed.append({"module": name, "error": f"{type(exc).__name__}: {exc}"})
    if cfg.get("warmup") and "sympy" in sys.modules:
        try:  # fill sympy's caches once, so that children inherit them (copy-on-write)
            sympy = sys.modules["sympy"]
            x, y = sympy.symbols("x y")
            sympy.solve([x**2 + y - 3, x - y + 1], [x, y])
            sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2)
        except Exception:
            pass
    if cfg.get("warmup") and "numpy" in sys.modules:
        try:
            np = sys.modules["numpy"]
            np.linalg.det(np.eye(3))
            np.random.seed(0)
        except Exception:
            pass
    return failed


def main() -> None:
    cfg = json.loads(sys.argv[1])
    # Move the protocol pipes away from 0/1 so that nothing the server or a child prints can corrupt them.
    req_fd = os.dup(0)
    rep_fd = os.dup(1)
    sys.path[:0] = [p for p in cfg["sys_path"] if p not in sys.path]
    if cfg["strict"]:
        # A chroot into a sub-directory of this mount namespace: makes CLONE_NEWUSER fail for every child.
        os.chroot(cfg["chroot"])
        os.chdir("/")
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    for fd in (req_fd, rep_fd, devnull):
        os.set_inheritable(fd, False)
    if not cfg["strict"]:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != cfg["parent_pid"]:
            os._exit(0)
    _prctl(PR_SET_DUMPABLE, 0)  # nothing without CAP_SYS_PTRACE can attach to the server
    failed = _preimport(cfg)
    pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if cfg["strict"] else None
    gc.collect()
    gc.freeze()  # children's GC then leaves the pre-imported objects (and their pages) alone
    gc.disable()  # the server allocates little; avoids GC pauses between forks
    _send(rep_fd, {"ready": True, "pid": os.getpid(), "preimport_failed": failed, "uid": os.getuid()})
    while True:
        try:
            req = _recv(req_fd)
        except EOFError:
            break
        try:
            reply = _execute(cfg, req, devnull, pidns_fd)
        except Exception as exc:  # a server-side failure: report it, stay alive
            reply = {
                "stdout": "",
                "stderr": f"sandbox error: {exc!r}",
                "returncode": None,
                "timed_out": False,
                "truncated": False,
                "oom_killed": False,
                "exec_time": 0.0,
                "server_error": True,
            }
        _send(rep_fd, reply)
    os._exit(0)


if __name__ == "__main__":
    main()
