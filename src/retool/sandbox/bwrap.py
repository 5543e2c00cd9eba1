"""Where a strict fork-server can run, and the bubblewrap command line that starts one.

The host probe (``strict_mode``: root with bwrap, bwrap in a user namespace, or neither and why), the
interpreter's file layout the sandbox must show (``python_paths``), and ``bwrap_command``, the namespaces,
capabilities and read-only binds around one server. What each profile guarantees, and how the server and
its children use this layout: ``retool.sandbox.forkserver``'s module docstring.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

BWRAP_CANDIDATES: tuple[str, ...] = ("/usr/bin/bwrap", "/usr/local/bin/bwrap")
CHROOT = "/r"  # inside bwrap's root, the sub-tree a server chroots into at once
# The whole environment of a server (and of the code it runs), with or without bwrap.
SERVER_ENV = {
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "random",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
}

# The per-execution private mounts of a strict child: binds below them are bound back on top (see _server).
CHILD_PRIVATE_DIRS: tuple[str, ...] = ("/tmp", "/dev/shm")
# Directories the sandbox replaces wholesale, under which nothing of the host can be shown.
SANDBOX_OWNED_DIRS: tuple[str, ...] = ("/proc", "/dev")


def is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def find_bwrap() -> str | None:
    for cand in BWRAP_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("bwrap")


def userns_allowed() -> tuple[bool, str]:
    try:
        if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0":
            return False, "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone=0)"
    except OSError:
        pass
    try:
        if int(Path("/proc/sys/user/max_user_namespaces").read_text()) == 0:
            return False, "user namespaces are disabled (user.max_user_namespaces=0)"
    except (OSError, ValueError):
        pass
    return True, ""


def strict_mode() -> tuple[str | None, str]:
    """How ``strict`` would run here: ``"privileged"`` (root: bwrap without a user namespace, per-sandbox
    uids), ``"userns"`` (non-root: bwrap in a user namespace, capabilities dropped instead of the uid), or
    None; with the reason."""
    if not sys.platform.startswith("linux"):
        return None, f"strict isolation needs Linux namespaces; this is {sys.platform}"
    if find_bwrap() is None:
        return None, "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    if not hasattr(os, "pidfd_open"):
        return None, "os.pidfd_open is missing (Linux >= 5.3 and Python >= 3.9 needed)"
    if os.geteuid() == 0:
        return "privileged", "bubblewrap found; running as root (per-sandbox unprivileged uids)"
    ok, why = userns_allowed()
    if not ok:
        return None, why
    return "userns", f"bubblewrap found; non-root (uid {os.geteuid()}): user-namespace mode"


def strict_support() -> tuple[bool, str]:
    """Whether the ``strict`` profile can run here, and if not, why."""
    mode, reason = strict_mode()
    return mode is not None, reason


def python_binary(python: str | None) -> str:
    # The real binary, never a pyenv shim (a bash script: +100 ms per start, and invisible in the sandbox).
    return os.path.realpath(python or sys.executable)


def python_paths(python: str) -> tuple[list[str], list[str]]:
    """(directories to bind read-only, sys.path entries for the server) for the interpreter in use."""
    paths = sysconfig.get_paths()
    sys_path = list(
        dict.fromkeys(p for p in (paths.get("purelib"), paths.get("platlib")) if p and os.path.isdir(p))
    )
    # Other site dirs in use (e.g. Debian's dist-packages); not the working dir or src trees.
    for p in sys.path:
        if p and os.path.isdir(p) and ("site-packages" in p or "dist-packages" in p) and p not in sys_path:
            sys_path.append(p)
    binds = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), os.path.dirname(python)}
    binds.update(os.path.realpath(p) for p in sys_path)
    # Keep only top-most directories (a bind below another one adds nothing).
    ordered = sorted(binds, key=len)
    tops: list[str] = []
    for p in ordered:
        if not any(p == t or p.startswith(t.rstrip("/") + "/") for t in tops):
            tops.append(p)
    return tops, sys_path


def bwrap_command(bwrap: str, python: str, binds: Sequence[str], userns: bool = False) -> list[str]:
    """The bubblewrap command line that wraps one strict fork-server (``retool.sandbox.forkserver``'s module
    docstring lists what it does)."""
    cmd = [bwrap]
    if userns:  # non-root: the server is uid 0 of its own user namespace (the caller's uid outside)
        cmd += ["--unshare-user", "--uid", "0", "--gid", "0"]
    cmd += [
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--as-pid-1",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for key, value in SERVER_ENV.items():
        cmd += ["--setenv", key, value]
    cmd += ["--cap-drop", "ALL"]
    for cap in ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_SETPCAP"):
        cmd += ["--cap-add", cap]
    system_dirs = ["/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32"]

    def add_tree(root: str) -> list[str]:
        out: list[str] = []
        made: set[str] = set()

        def ro_bind(src: str) -> None:
            # bwrap would create missing parents with restrictive modes (e.g. /root is 0700 on the host,
            # and /etc came out untraversable): create them explicitly as 0755.
            for parent in [p for p in Path(src).parents if str(p) != "/"][::-1]:
                if str(parent) not in made:
                    made.add(str(parent))
                    out.extend(["--perms", "0755", "--dir", root + str(parent)])
            out.extend(["--ro-bind", src, root + src])

        for d in system_dirs:
            if os.path.islink(d):
                out.extend(["--symlink", os.readlink(d), root + d])
            elif os.path.isdir(d):
                ro_bind(d)
        if os.path.isfile("/etc/ld.so.cache"):
            ro_bind("/etc/ld.so.cache")
        for b in binds:
            ro_bind(b)
        return out

    # Outside /r: just enough to exec the interpreter; the server chroots into /r at once.
    cmd += add_tree("")
    cmd += ["--tmpfs", CHROOT]
    # The private mounts first, the binds after: bwrap mounts in order, so a bind below /tmp (a
    # virtualenv at /tmp/venv) lands on top of the private /tmp instead of being hidden by it.
    cmd += ["--dev", CHROOT + "/dev", "--proc", CHROOT + "/proc", "--tmpfs", CHROOT + "/tmp"]
    cmd += add_tree(CHROOT)
    cmd += ["--remount-ro", CHROOT, "--chdir", "/"]
    cmd += [python]
    return cmd
