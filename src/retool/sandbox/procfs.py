"""What the sandbox reads from Linux's ``/proc``: the process tree and the kernel's OOM-kill counter.

Shared by the fork-server pool (``forkserver``: which processes a closing server leaves to wait for) and
the one-interpreter-per-call executor (``subprocess_executor``: was a SIGKILL the OOM killer's?). The
server script that runs inside the sandbox (``_server.py``) keeps its own copies: it runs standalone,
where ``retool`` cannot be imported.
"""

from __future__ import annotations

import os


def parent_of(stat: bytes) -> int | None:
    """The parent pid in a ``/proc/<pid>/stat`` line (the command name, in parentheses, may hold spaces)."""
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def children_by_parent() -> dict[int, list[int]]:
    """Every visible process, grouped under its parent pid (a process gone while reading is left out)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                parent = parent_of(fh.read())
        except OSError:
            continue
        if parent is not None:
            children.setdefault(parent, []).append(int(entry))
    return children


def descendant_pids(*roots: int) -> list[int]:
    """Every descendant of ``roots`` (roots excluded), read from one pass over ``/proc``."""
    children = children_by_parent()
    out: list[int] = []
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def oom_kill_count() -> int:
    """The kernel's count of OOM kills since boot (``/proc/vmstat``, Linux >= 4.13); -1 if unknown.

    The OOM killer leaves no message, only a SIGKILL: a run SIGKILLed while this count rose was its victim.
    """
    try:
        with open("/proc/vmstat", "rb") as fh:
            for line in fh:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1
