"""SubprocessExecutor: the chapter's reference executor, faithful, and loud about not being isolation."""

from __future__ import annotations

import logging
import os
import tempfile
import time

import pytest

from retool.sandbox import SubprocessExecutor
from retool.sandbox.subprocess_executor import _BOOTSTRAP


@pytest.fixture(scope="module")
def ref():
    with SubprocessExecutor(timeout=2.0, max_concurrency=2) as ex:
        yield ex


def test_warns_that_it_is_not_isolation(caplog):
    with caplog.at_level(logging.WARNING), SubprocessExecutor(timeout=1.0):
        pass
    assert any("NOT isolation" in rec.getMessage() for rec in caplog.records)


def test_bootstrap_is_the_chapters(ref):
    assert "resource.setrlimit(resource.RLIMIT_CPU" in _BOOTSTRAP
    assert "exec(compile(" in _BOOTSTRAP
    assert ref.cpu_limit == 7  # timeout + 5
    r = ref.run("import resource; print(resource.getrlimit(resource.RLIMIT_CPU))")
    assert r.ok and r.stdout == "(7, 7)\n"
    r = ref.run("import os; print(os.environ['OMP_NUM_THREADS'], os.environ['OPENBLAS_NUM_THREADS'])")
    assert r.stdout == "1 1\n"


def test_results_and_observations(ref):
    r = ref.run("print(2 + 2)")
    assert r.ok and r.stdout == "4\n" and r.returncode == 0
    assert ref.format_tool_content(r) == "4\n"
    r = ref.run("1/0")
    assert not r.ok and r.returncode == 1 and "ZeroDivisionError" in r.stderr
    assert ref.format_tool_content(r) == r.stderr
    r = ref.run("import sys; sys.exit(5)")
    assert ref.format_tool_content(r) == "Error: process exited with code 5."


def test_timeout_kills_process_group(ref):
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\ntime.sleep(30)"
    t = time.perf_counter()
    r = ref.run(code)
    assert r.timed_out and r.returncode is None and time.perf_counter() - t < 5
    assert ref.format_tool_content(r) == "Error: execution timed out after 2 seconds."


def test_output_capped_to_tail(ref):
    r = ref.run("print('x' * 100000 + 'TAIL')")
    assert r.ok and r.truncated and len(r.stdout) == 4096 and r.stdout.endswith("TAIL\n")


def test_temp_files_are_removed(ref, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert ref.run("print(1)").ok
    assert list(tmp_path.iterdir()) == []


def test_not_isolated_environment_leaks(ref, monkeypatch):
    """The reason it is only a reference: the host's environment is visible."""
    monkeypatch.setenv("RETOOL_REF_LEAK_PROBE", "visible")
    r = ref.run("import os; print(os.environ.get('RETOOL_REF_LEAK_PROBE'))")
    assert r.stdout == "visible\n"


def test_memory_limit_and_auto_print():
    with SubprocessExecutor(timeout=3.0, memory_mb=256, auto_print=True) as ex:
        r = ex.run("b = bytearray(1 << 30)")
        assert not r.ok and r.memory_killed and "MemoryError" in r.stderr
        assert ex.run("x = 2\nx ** 10").stdout == "1024\n"
        assert ex.run("None").stdout == ""


def test_concurrency_cap_and_async():
    import asyncio

    with SubprocessExecutor(timeout=3.0, max_concurrency=1) as ex:

        async def both():
            return await asyncio.gather(*(ex.arun("import time; time.sleep(0.5)") for _ in range(2)))

        t = time.perf_counter()
        results = asyncio.run(both())
        assert all(r.ok for r in results)
        assert time.perf_counter() - t >= 0.95  # the semaphore serialised them
        assert ex.stats.calls == 2


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        SubprocessExecutor(timeout=-1)
    with SubprocessExecutor(timeout=1.0) as ex, pytest.raises(TypeError):
        ex.run(None)  # type: ignore[arg-type]
    assert os.path.isfile(SubprocessExecutor(timeout=1.0).python)
