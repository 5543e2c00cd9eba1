"""Strict isolation for a NON-root caller (bubblewrap inside a user namespace, capabilities dropped).

The test re-runs a small driver as uid 65534 (``setpriv``) with the system interpreter ``/usr/bin/python3``
(the project's interpreter may live under a root-only home) and no pre-imports, and checks what the
sandboxed code could do from inside.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from retool.sandbox.bwrap import find_bwrap, userns_allowed

SYSTEM_PY = "/usr/bin/python3"
SRC = str(Path(__file__).resolve().parents[1] / "src")

DRIVER = r"""
import json, os, sys
from retool.sandbox.forkserver import ForkServerExecutor
from retool.sandbox.probe import PROBE_CODE, probe_rows
from retool.sandbox.procfs import descendant_pids
out = {"uid": os.getuid()}
with ForkServerExecutor(timeout=1.5, workers=1, preimport=[], python=sys.executable) as ex:
    (server,) = [s.proc.pid for s in ex._servers if s is not None]  # white-box: tests/sandbox_helpers.py
    out["isolation"], out["mode"] = ex.isolation, ex.strict_mode
    r = ex.run(PROBE_CODE)
    out["probe_ok"] = r.ok
    out["rows"] = probe_rows(json.loads(r.stdout)) if r.ok else r.stderr
    base = len(descendant_pids(server))
    r = ex.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(60)\n    os._exit(0)\ntime.sleep(0.2)\nprint('ok')")
    out["double_fork_ok"] = r.ok
    out["extra_processes"] = len(descendant_pids(server)) - base
    r = ex.run("while True: pass")
    out["loop_timed_out"], out["loop_latency"] = r.timed_out, r.latency
    r = ex.run("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print([libc.unshare(f) for f in (0x10000000, 0x40000000, 0x20000, 0x20000000)])")
    out["unshare"] = r.stdout.strip()
    out["env_secret_seen"] = "RETOOL_ROOTLESS_SECRET" in ex.run("import os; print(dict(os.environ))").stdout
print("RESULT " + json.dumps(out))
"""


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to re-run the driver as an unprivileged user"
    if shutil.which("setpriv") is None or not os.access(SYSTEM_PY, os.X_OK):
        return "needs setpriv and /usr/bin/python3"
    if find_bwrap() is None:
        return "bubblewrap not installed"
    ok, why = userns_allowed()
    if not ok:
        return why
    if not os.access(SRC, os.R_OK) or (os.stat(SRC).st_mode & 0o005) != 0o005:
        return f"{SRC} is not world-readable"
    return None


@pytest.mark.bwrap
@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_strict_profile_without_root():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": SRC, "RETOOL_ROOTLESS_SECRET": "x"}
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PY, "-c", DRIVER],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd="/",
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None and "No module named" in proc.stderr:
        pytest.skip(f"system python cannot import the driver's needs: {proc.stderr.strip()[-200:]}")
    assert line is not None, proc.stdout + proc.stderr
    out = json.loads(line[len("RESULT ") :])
    assert out["isolation"] == "strict" and out["mode"] == "userns", out
    assert out["probe_ok"], out["rows"]
    inactive = [row for row in out["rows"] if not row[1]]
    assert inactive == [], inactive
    assert out["double_fork_ok"] and out["extra_processes"] == 0
    assert out["loop_timed_out"] and out["loop_latency"] < 6
    assert out["unshare"] == "[-1, -1, -1, -1]"
    assert not out["env_secret_seen"]
    assert out["uid"] == 65534 and os.geteuid() == 0  # the driver ran unprivileged; this process did not
