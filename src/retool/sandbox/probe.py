"""A self-check that runs *inside* a sandbox and reports what the code can actually do there.

Used by ``retool sandbox check`` and the tests; typer-free so it imports anywhere. Two probes: the
isolation features (``PROBE_CODE``, ``probe_rows``) and whether each pre-import is importable by model code
(``import_probe_code``, ``import_rows``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Runs inside the sandbox and reports what it can observe; every check is an attempt, not a config read.
PROBE_CODE = r"""
import ctypes, json, os, resource, socket
out = {}
out["uid"] = os.getuid()
try:  # "inside outside count": the uid this sandbox's uid is on the host (None: unmapped/unknown)
    inside, outside, _ = open("/proc/self/uid_map").read().split()[:3]
    out["host_uid"] = int(outside) + os.getuid() - int(inside)
except (OSError, ValueError):
    out["host_uid"] = None
out["env_keys"] = sorted(os.environ)
try:
    with open("/proc/net/dev") as f:
        out["net_ifaces"] = [l.split(":")[0].strip() for l in f.readlines()[2:]]
except OSError as e:
    out["net_ifaces"] = repr(e)
s = socket.socket()
s.settimeout(1)
try:
    s.connect(("127.0.0.1", 9)); out["tcp_localhost"] = "connected"
except OSError as e:
    out["tcp_localhost"] = type(e).__name__
try:
    socket.getaddrinfo("example.com", 80); out["dns"] = "resolved"
except OSError as e:
    out["dns"] = type(e).__name__
out["pid"] = os.getpid()
out["visible_pids"] = len([p for p in os.listdir("/proc") if p.isdigit()])
try:
    open("/etc/shadow").read(1); out["etc_shadow"] = "readable"
except OSError as e:
    out["etc_shadow"] = type(e).__name__
try:
    open("/usr/.probe", "w"); out["write_outside_tmp"] = "allowed"
except OSError as e:
    out["write_outside_tmp"] = type(e).__name__
st = os.statvfs("/tmp")
out["tmp_size_mb"] = st.f_blocks * st.f_frsize // (1 << 20)
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
out["cap_eff"] = status.get("CapEff", "").strip()
out["no_new_privs"] = status.get("NoNewPrivs", "").strip()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
try:
    resource.setrlimit(resource.RLIMIT_AS, (hard, resource.RLIM_INFINITY)); out["raise_rlimit"] = "allowed"
except (ValueError, OSError) as e:
    out["raise_rlimit"] = type(e).__name__
out["rlimit_as_mb"] = hard // (1 << 20) if hard > 0 else hard
libc = ctypes.CDLL(None, use_errno=True)
out["unshare_user"] = "allowed" if libc.unshare(0x10000000) == 0 else os.strerror(ctypes.get_errno())
print(json.dumps(out))
"""


def probe_rows(facts: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(feature, active, detail) for each isolation feature, from the probe's JSON output."""
    return [
        (
            "unprivileged uid",
            facts["uid"] != 0 or facts["host_uid"] not in (0, None),
            f"uid {facts['uid']} (host uid {facts['host_uid']})",
        ),
        ("empty environment", len(facts["env_keys"]) <= 12, ",".join(facts["env_keys"])),
        (
            "no network",
            facts["tcp_localhost"] != "connected" and facts["dns"] != "resolved",
            f"interfaces {facts['net_ifaces']}, tcp {facts['tcp_localhost']}, dns {facts['dns']}",
        ),
        ("own PID namespace", facts["pid"] == 1, f"pid {facts['pid']}, {facts['visible_pids']} visible"),
        ("host files hidden", facts["etc_shadow"] != "readable", f"/etc/shadow: {facts['etc_shadow']}"),
        (
            "read-only root",
            facts["write_outside_tmp"] != "allowed",
            f"/usr write: {facts['write_outside_tmp']}",
        ),
        ("private bounded /tmp", 0 < facts["tmp_size_mb"] < 4096, f"{facts['tmp_size_mb']} MiB"),
        ("no capabilities", facts["cap_eff"].strip("0") == "", f"CapEff {facts['cap_eff']}"),
        ("no_new_privs (no ptrace of others)", facts["no_new_privs"] == "1", ""),
        ("rlimits not raisable", facts["raise_rlimit"] != "allowed", f"AS {facts['rlimit_as_mb']} MiB"),
        ("unshare blocked", facts["unshare_user"] != "allowed", f"unshare(NEWUSER): {facts['unshare_user']}"),
    ]


def import_probe_code(modules: Sequence[str]) -> str:
    """Code that imports each module afresh in a sandboxed child and prints ``{name: [ok, detail]}``.

    Run on an executor with no pre-imports, so every import reads its files inside the sandbox (a
    pre-imported module would be inherited from the server and prove nothing about what the child sees).
    """
    return (
        "import importlib, json\n"
        "out = {}\n"
        f"for name in {json.dumps(list(modules))}:\n"
        "    try:\n"
        "        mod = importlib.import_module(name)\n"
        "        out[name] = [True, getattr(mod, '__file__', None) or 'built-in']\n"
        "    except BaseException as exc:\n"
        "        out[name] = [False, f'{type(exc).__name__}: {exc}']\n"
        "print(json.dumps(out))\n"
    )


def import_rows(facts: dict[str, list[Any]]) -> list[tuple[str, bool, str]]:
    """(``import NAME``, importable, file or error) for each module of ``import_probe_code``'s output."""
    return [(f"import {name}", bool(ok), str(detail)) for name, (ok, detail) in facts.items()]
