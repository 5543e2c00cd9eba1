"""``retool sandbox``: run code from stdin in a sandbox (``exec``) and report the active isolation (``check``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

sandbox_app = typer.Typer(
    name="sandbox", help="Run model-style Python in the sandbox; check isolation.", no_args_is_help=True
)

# Runs inside the sandbox and reports what it can observe; every check is an attempt, not a config read.
PROBE_CODE = r"""
import ctypes, json, os, resource, socket
out = {}
out["uid"] = os.getuid()
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


def _make(backend: str, isolation: str, timeout: float, memory_mb: int, url: str | None, workers: int) -> Any:
    from retool.config import SandboxConfig
    from retool.sandbox import make_executor

    kwargs: dict[str, Any] = {
        "backend": backend,
        "isolation": isolation,
        "timeout": timeout,
        "memory_mb": memory_mb,
        "workers": workers,
    }
    if url:
        kwargs["sandboxfusion_url"] = url
    try:
        cfg = SandboxConfig(**kwargs)
    except Exception as exc:  # pydantic ValidationError: one clear line
        typer.echo(f"error: invalid sandbox options: {exc}", err=True)
        raise typer.Exit(2) from exc
    return make_executor(cfg)


@sandbox_app.command("exec")
def exec_cmd(
    backend: str = typer.Option("forkserver", help="forkserver | subprocess | sandboxfusion"),
    isolation: str = typer.Option("strict", help="strict | none (forkserver only)"),
    timeout: float = typer.Option(30.0, help="Wall-clock timeout, seconds."),
    memory_mb: int = typer.Option(1024, "--memory-mb", help="Address-space limit, MiB."),
    url: str | None = typer.Option(None, help="SandboxFusion base URL (backend sandboxfusion)."),
) -> None:
    """Read Python code from stdin, run it once, print the ExecResult as one JSON line."""
    code = sys.stdin.read()
    with _make(backend, isolation, timeout, memory_mb, url, workers=1) as executor:
        result = executor.run(code)
    typer.echo(json.dumps(result.to_json_dict(), ensure_ascii=False))


@sandbox_app.command("check")
def check_cmd(
    isolation: str = typer.Option("strict", help="Profile to check: strict | none."),
) -> None:
    """Print which isolation features are active on this machine (measured from inside a sandbox)."""
    from retool.sandbox.forkserver import find_bwrap, strict_support

    ok, reason = strict_support()
    typer.echo(f"bubblewrap: {find_bwrap() or 'not found'}")
    typer.echo(f"strict profile available: {'yes' if ok else 'no'} ({reason})")
    with _make("forkserver", isolation, 10.0, 1024, None, workers=1) as executor:
        typer.echo(f"active profile: {executor.isolation}")
        result = executor.run(PROBE_CODE)
    if not result.ok:
        typer.echo(f"probe failed: {result.stderr or result.returncode}", err=True)
        raise typer.Exit(1)
    facts = json.loads(result.stdout)
    rows = [
        ("unprivileged uid", facts["uid"] != 0, f"uid {facts['uid']}"),
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
    for name, active, detail in rows:
        typer.echo(f"  [{'x' if active else ' '}] {name:36s} {detail}")


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
