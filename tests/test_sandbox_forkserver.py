"""ForkServerExecutor behaviour: results, statelessness, options, stats, async concurrency, lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from retool.config import SandboxConfig
from retool.sandbox import (
    ExecResult,
    ForkServerExecutor,
    SandboxFusionExecutor,
    SandboxPreimportError,
    SubprocessExecutor,
    bwrap,
    make_executor,
    strict_support,
)
from retool.sandbox import forkserver as fs_mod
from sandbox_helpers import descendant_pids, server_pids

STRICT_OK, STRICT_WHY = strict_support()
needs_strict = pytest.mark.skipif(not STRICT_OK, reason=f"strict sandbox unavailable here: {STRICT_WHY}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def light():
    """A fast-starting executor (no heavy pre-imports, no namespaces) for behaviour tests."""
    with ForkServerExecutor(timeout=2.0, workers=2, isolation="none", preimport=["numpy"]) as ex:
        yield ex


def test_success_error_and_exit_codes(light):
    r = light.run("print(6 * 7)")
    assert r == ExecResult(True, "42\n", "", 0, False, r.latency)
    r = light.run("import math\nprint(math.factorial(5))\nraise ValueError('boom')")
    assert not r.ok and r.returncode == 1 and r.stdout == "120\n"
    assert r.stderr.startswith('Traceback (most recent call last):\n  File "<string>", line 3')
    assert r.stderr.rstrip().endswith("ValueError: boom")
    r = light.run("x = (")
    assert not r.ok and "SyntaxError" in r.stderr and "Traceback" not in r.stderr
    assert light.run("import sys; sys.exit(3)").returncode == 3
    assert light.run("import sys; sys.exit()").ok
    r = light.run("import sys; sys.exit('bad input')")
    assert r.returncode == 1 and r.stderr == "bad input\n"
    r = light.run("import os; os.kill(os.getpid(), 9)")
    assert r.returncode == -signal.SIGKILL and not r.timed_out


def test_stateless_between_calls(light):
    assert light.run(
        "x = 41\nimport json\nopen('/tmp/retool_state_probe', 'w').close() if False else None"
    ).ok
    r = light.run("print(x)")
    assert not r.ok and "NameError" in r.stderr
    r = light.run("import sys; print('json' in sys.modules and 'x' in dir(sys.modules['__main__']))")
    assert r.stdout == "False\n"


def test_random_and_numpy_reseeded_per_call(light):
    code = "import random, numpy as np\nprint(random.random(), np.random.rand())"
    outs = {light.run(code).stdout for _ in range(4)}
    assert len(outs) == 4


def test_environment_is_replaced(light, monkeypatch):
    r = light.run("import os; print(sorted(os.environ))")
    assert r.ok
    keys = eval(r.stdout)
    assert "OMP_NUM_THREADS" in keys and "HOME" in keys
    assert not any(k in keys for k in ("PYTHONPATH", "VIRTUAL_ENV", "PWD", "USER"))


def test_output_cap_keeps_tail_and_counts_truncations(light):
    before = light.stats.truncations
    r = light.run("for i in range(5000):\n    print(i)")
    assert r.ok and r.truncated
    assert len(r.stdout) <= 4096 and r.stdout.endswith("4998\n4999\n")
    assert light.stats.truncations == before + 1


def test_timeout_and_format_tool_content(light):
    r = light.run("import time; time.sleep(30)")
    assert r.timed_out and r.returncode is None
    assert light.format_tool_content(r) == "Error: execution timed out after 2 seconds."
    ok = light.run("print('hi')")
    assert light.format_tool_content(ok) == "hi\n"
    silent = light.run("import sys; sys.exit(4)")
    assert light.format_tool_content(silent) == "Error: process exited with code 4."
    err = light.run("1/0")
    assert light.format_tool_content(err) == err.stderr and "ZeroDivisionError" in err.stderr


def test_stats_are_counted(light):
    s0 = light.stats.as_dict()
    light.run("print(1)")
    light.run("1/0")
    s1 = light.stats.as_dict()
    assert s1["calls"] == s0["calls"] + 2
    assert s1["successes"] == s0["successes"] + 1
    assert s1["errors"] == s0["errors"] + 1
    assert s1["total_latency"] > s0["total_latency"]


def test_double_fork_cleanup_without_namespaces(light):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
    )
    assert light.run(code).ok
    # only the servers themselves remain: the sub-reaper killed the setsid'd grandchild
    assert descendant_pids(*server_pids(light)) == []


def test_auto_print_last_expression():
    with ForkServerExecutor(timeout=2.0, workers=1, isolation="none", preimport=[], auto_print=True) as ex:
        assert ex.run("x = 3\nx * 7").stdout == "21\n"
        assert ex.run("print('a')\nNone").stdout == "a\n"
        assert ex.run("'s'").stdout == "'s'\n"
        r = ex.run("y = 1\n1/0")
        assert "ZeroDivisionError" in r.stderr and "line 2" in r.stderr
    with ForkServerExecutor(timeout=2.0, workers=1, isolation="none", preimport=[]) as ex:
        assert ex.run("x = 3\nx * 7").stdout == ""  # off by default


def test_arun_is_concurrent_and_does_not_block_the_loop(light):
    async def main() -> tuple[list[ExecResult], int, float]:
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        start = time.perf_counter()
        results = await asyncio.gather(
            *(light.arun("import time; time.sleep(0.8); print('done')") for _ in range(2))
        )
        elapsed = time.perf_counter() - start
        stop = True
        await t
        return list(results), ticks, elapsed

    results, ticks, elapsed = asyncio.run(main())
    assert all(r.ok and r.stdout == "done\n" for r in results)
    assert elapsed < 1.5  # two workers: the two 0.8 s calls overlapped
    assert ticks > 20  # the loop kept running while the calls were in flight


def test_server_crash_is_recovered():
    with ForkServerExecutor(timeout=2.0, workers=1, isolation="none", preimport=[]) as ex:
        (pid,) = server_pids(ex)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        r = ex.run("print('back')")
        assert r.ok and r.stdout == "back\n"
        assert server_pids(ex) != [pid]


def test_close_leaves_no_process_and_no_temp_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ex = ForkServerExecutor(timeout=2.0, workers=2, isolation="none", preimport=[])
    assert ex.run("import time\nprint(1)").ok
    pids = server_pids(ex)
    tree = pids + descendant_pids(*pids)
    assert len(pids) == 2
    ex.close()
    assert not any(_alive(p) for p in tree)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        ex.run("print(1)")


@needs_strict
def test_close_strict_leaves_no_process(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ex = ForkServerExecutor(timeout=2.0, workers=1, isolation="strict", preimport=[])
    assert ex.isolation == "strict"
    assert ex.run("import os\nif os.fork() == 0:\n    os.setsid(); import time; time.sleep(30)\nprint(1)").ok
    tree = server_pids(ex) + descendant_pids(*server_pids(ex))
    assert len(tree) >= 2  # bwrap + the server
    ex.close()
    assert not any(_alive(p) for p in tree)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "isolation", ["none", pytest.param("strict", marks=[pytest.mark.bwrap, needs_strict])]
)
def test_the_code_cpu_time_reaches_the_caller(isolation):
    """The model's code runs in the caller's process tree, reaped link by link, so ``time`` and
    ``getrusage`` count it (strict: bwrap's reaper process was never waited for, and the CPU time was lost)."""
    import resource

    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    before = children_cpu()
    with ForkServerExecutor(timeout=30.0, workers=1, isolation=isolation, preimport=[]) as ex:
        spin = (
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\nprint(1)"
        )
        assert ex.run(spin).ok
    assert children_cpu() - before >= 0.5


def test_strict_unavailable_falls_back_loudly(monkeypatch, caplog):
    monkeypatch.setattr(fs_mod, "strict_mode", lambda: (None, "testing: no namespaces"))
    with (
        pytest.warns(RuntimeWarning, match="SANDBOX NOT ISOLATED.*testing: no namespaces"),
        ForkServerExecutor(timeout=2.0, workers=1, isolation="strict", preimport=[]) as ex,
    ):
        assert ex.isolation == "none" and ex.isolation_reason == "testing: no namespaces"
        assert ex.run("print(1)").ok
    assert any("SANDBOX NOT ISOLATED" in rec.message for rec in caplog.records)


def test_bad_arguments_are_rejected(light):
    with pytest.raises(ValueError, match="isolation"):
        ForkServerExecutor(isolation="paranoid")
    with pytest.raises(ValueError, match="timeout"):
        ForkServerExecutor(timeout=0)
    with pytest.raises(TypeError, match="str"):
        light.run(b"print(1)")  # type: ignore[arg-type]


def test_missing_preimport_fails_the_start_and_leaves_no_process():
    before = set(descendant_pids(os.getpid()))
    with pytest.raises(SandboxPreimportError) as info:
        ForkServerExecutor(timeout=2.0, workers=2, isolation="none", preimport=["math", "no_such_module_xyz"])
    message = str(info.value)
    assert "'no_such_module_xyz': ModuleNotFoundError" in message and "not installed" in message
    assert "'math'" not in message  # only the failing module is named
    leftover = [p for p in set(descendant_pids(os.getpid())) - before if _alive(p)]
    assert leftover == []  # the servers that did start were stopped


def test_the_default_preimport_is_the_configured_one():
    """One default, written once: ``sandbox.preimport``'s."""
    with ForkServerExecutor(timeout=5.0, workers=1, isolation="none") as ex:
        assert ex.preimport == SandboxConfig().preimport
        loaded = ex.run("import sys; print('sympy' in sys.modules, 'numpy' in sys.modules)")
        assert loaded.stdout.split() == ["True", "True"]  # imported by the server, before the call


def test_make_executor_builds_each_backend():
    ex = make_executor(
        SandboxConfig(backend="forkserver", isolation="none", workers=1, preimport=[], timeout=3)
    )
    with ex:
        assert isinstance(ex, ForkServerExecutor) and ex.timeout == 3 and ex.workers == 1
        assert ex.cpu_limit == 8  # timeout + 5
    with make_executor(SandboxConfig(backend="subprocess", timeout=4, cpu_limit=7)) as ex2:
        assert isinstance(ex2, SubprocessExecutor) and ex2.cpu_limit == 7
    with make_executor(SandboxConfig(backend="sandboxfusion", sandboxfusion_url="http://127.0.0.1:9")) as ex3:
        assert isinstance(ex3, SandboxFusionExecutor) and ex3.url == "http://127.0.0.1:9"
    with pytest.raises(TypeError):
        make_executor({"backend": "forkserver"})


@needs_strict
def test_bwrap_command_binds_only_python_and_libs():
    binds, _ = bwrap.python_paths(bwrap.python_binary(None))
    cmd = bwrap.bwrap_command("/usr/bin/bwrap", bwrap.python_binary(None), binds)
    for flag in ("--unshare-net", "--unshare-pid", "--clearenv", "--die-with-parent", "--new-session"):
        assert flag in cmd
    sources = {cmd[i + 1] for i, a in enumerate(cmd) if a == "--ro-bind"}
    assert "/" not in sources and "/etc" not in sources and "/home" not in sources
    assert "--bind" not in cmd  # nothing writable from the host


def test_servers_survive_the_thread_that_created_them():
    """bwrap/PDEATHSIG are tied to the forking thread: servers must not die with a short-lived caller."""
    import threading

    box: dict[str, ForkServerExecutor] = {}
    t = threading.Thread(
        target=lambda: box.setdefault(
            "ex", ForkServerExecutor(timeout=2.0, workers=1, isolation="none", preimport=[])
        )
    )
    t.start()
    t.join()
    with box["ex"] as ex:
        pids = server_pids(ex)
        time.sleep(0.2)
        r = ex.run("print('still here')")
        assert r.ok and server_pids(ex) == pids  # the same server answered: no restart was needed


def test_strict_server_failing_to_start_falls_back_loudly(monkeypatch):
    monkeypatch.setattr(fs_mod, "strict_mode", lambda: ("privileged", "pretend"))
    monkeypatch.setattr(fs_mod, "find_bwrap", lambda: "/bin/false")  # a "bwrap" that cannot start anything
    with (
        pytest.warns(RuntimeWarning, match="SANDBOX NOT ISOLATED.*failed to start"),
        ForkServerExecutor(timeout=2.0, workers=2, isolation="strict", preimport=[]) as ex,
    ):
        assert ex.isolation == "none" and ex.strict_mode is None
        assert ex.run("print(5)").stdout == "5\n"


def test_atexit_nul_bytes_and_multiprocessing(light):
    assert light.run("import atexit; atexit.register(print, 'bye'); print('hi')").stdout == "hi\nbye\n"
    r = light.run("print(1)\x00")
    assert not r.ok and "null bytes" in r.stderr


@needs_strict
def test_strict_multiprocessing_pool_works():
    with ForkServerExecutor(timeout=5.0, workers=1, isolation="strict", preimport=[]) as ex:
        r = ex.run("import multiprocessing as mp\nwith mp.Pool(2) as p:\n    print(p.map(abs, [-1, -2]))")
        assert r.ok and r.stdout == "[1, 2]\n", r
        assert ex.run("import os; print(os.listdir('/dev/shm'))").stdout == "[]\n"  # fresh per call
