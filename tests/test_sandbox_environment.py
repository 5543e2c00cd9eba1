"""The strict sandbox sees the interpreter's environment wherever it lives, and refuses to start without a
pre-import it cannot load.

The /tmp case is the one a new user met: a virtualenv at ``/tmp/<name>`` was hidden by the sandbox's private
``/tmp``, so ``import sympy`` failed inside while the executor logged "ready". These tests build a real
virtualenv under ``/tmp`` whose sympy, mpmath and numpy are *its own* files (hard links, or copies across
file systems), plus a package that exists only there, and run ``retool sandbox exec`` with its interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.cli import app
from retool.sandbox import ForkServerExecutor, SandboxPreimportError, strict_support
from retool.sandbox import forkserver as fs_mod

STRICT_OK, STRICT_WHY = strict_support()
needs_strict = pytest.mark.skipif(not STRICT_OK, reason=f"strict sandbox unavailable here: {STRICT_WHY}")
SRC = Path(__file__).resolve().parents[1] / "src"


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link a package tree (fast, no data copied); copy where links cannot cross file systems."""
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


@pytest.fixture(scope="module")
def tmp_venv() -> Iterator[Path]:
    """A virtualenv under /tmp holding its own sympy, mpmath, numpy and a package found nowhere else."""
    import numpy
    import sympy

    root = Path(tempfile.mkdtemp(prefix="retool-venv-", dir="/tmp"))
    root.chmod(0o755)  # as `python -m venv /tmp/name` makes it (mkdtemp's 0700 is tested on its own below)
    try:
        # System site-packages only for the CLI's own dependencies (typer, pydantic...); the venv's
        # site-packages comes first on sys.path, so its sympy/numpy shadow the base ones.
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(root)], check=True
        )
        python = root / "bin" / "python"
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        site_dir = Path(site)
        base = Path(sympy.__file__).parent.parent
        for name in ("sympy", "mpmath"):
            _link_tree(base / name, site_dir / name)
        numpy_base = Path(numpy.__file__).parent.parent
        for name in ("numpy", "numpy.libs"):
            if (numpy_base / name).is_dir():
                _link_tree(numpy_base / name, site_dir / name)
        probe = site_dir / "retool_venv_probe"
        probe.mkdir()
        (probe / "__init__.py").write_text("")
        (probe / "lazy.py").write_text("VALUE = 42\n")  # imported only by the child: read inside its /tmp
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _exec_in_venv(venv: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME",)}
    env["PYTHONPATH"] = str(SRC)  # this checkout's retool, run by the venv's interpreter
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "retool", "sandbox", "exec", "--timeout", "20", *args],
        input=code,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.bwrap
@needs_strict
def test_virtualenv_under_tmp_is_visible_in_the_strict_sandbox(tmp_venv: Path) -> None:
    code = (
        "import sympy, numpy, mpmath, retool_venv_probe.lazy, json, os\n"
        "x = sympy.symbols('x')\n"
        "print(json.dumps({'files': [sympy.__file__, numpy.__file__, mpmath.__file__],\n"
        "    'solve': str(sympy.solve(x**2 - 4, x)), 'det': float(numpy.linalg.det(numpy.eye(2))),\n"
        "    'probe': retool_venv_probe.lazy.VALUE, 'uid': os.getuid()}))\n"
        "try:\n"
        "    open(sympy.__file__ + '.w', 'w')\n"
        "except OSError as e:\n"
        "    print('write refused:', type(e).__name__)\n"
    )
    proc = _exec_in_venv(tmp_venv, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["ok"] and result["status"] == "ok", result
    facts = json.loads(result["stdout"].splitlines()[0])
    # The venv's own copies were imported (not the base interpreter's), from inside the sandbox's /tmp.
    assert all(f.startswith(str(tmp_venv) + "/") for f in facts["files"]), facts
    assert facts["solve"] == "[-2, 2]" and facts["det"] == 1.0 and facts["probe"] == 42
    assert facts["uid"] != 0  # still the strict profile, not a fallback
    assert "write refused" in result["stdout"]  # bound read-only
    assert "isolation=strict" in proc.stderr


@pytest.mark.bwrap
@needs_strict
def test_check_lists_each_preimport_inside_the_sandbox(tmp_venv: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    modules = "sympy,numpy,retool_venv_probe.lazy,no_such_module_xyz"
    proc = subprocess.run(
        [str(tmp_venv / "bin" / "python"), "-m", "retool", "sandbox", "check", "--preimport", modules],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {
        m.group(1): ln for ln in proc.stdout.splitlines() if (m := re.match(r"\s*\[[x ]\] import (\S+)", ln))
    }
    assert set(rows) == {"sympy", "numpy", "retool_venv_probe.lazy", "no_such_module_xyz"}
    for module in ("sympy", "numpy", "retool_venv_probe.lazy"):
        assert rows[module].strip().startswith("[x]") and str(tmp_venv) in rows[module], rows[module]
    assert (
        rows["no_such_module_xyz"].strip().startswith("[ ]")
        and "ModuleNotFoundError" in rows["no_such_module_xyz"]
    )
    assert "no_such_module_xyz cannot be imported inside the sandbox" in proc.stderr


@pytest.mark.parametrize(
    "isolation", ["none", pytest.param("strict", marks=[pytest.mark.bwrap, needs_strict])]
)
def test_missing_preimport_fails_the_start_naming_module_and_path(
    isolation: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module on the host's sys.path through PYTHONPATH-like entries is not in the sandbox's sys.path.
    extra = tmp_path / "src_tree"
    extra.mkdir()
    (extra / "retool_hostonly_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(extra))
    with pytest.raises(SandboxPreimportError) as info:
        ForkServerExecutor(
            timeout=5.0,
            workers=1,
            isolation=isolation,
            preimport=["math", "retool_hostonly_mod", "nosuchmod_q"],
        )
    message = str(info.value)
    assert f"isolation={isolation}" in message
    assert "'retool_hostonly_mod': ModuleNotFoundError" in message
    assert str(extra / "retool_hostonly_mod.py") in message and "not in the sandbox's sys.path" in message
    assert "'nosuchmod_q': ModuleNotFoundError" in message and "not installed" in message
    assert "'math'" not in message


@pytest.mark.bwrap
@needs_strict
def test_preimport_hidden_by_the_sandbox_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site-packages directory the sandbox does not bind: the message names the file it could not see."""
    site = tmp_path / "site-packages"
    (site / "retool_hidden_pkg").mkdir(parents=True)
    (site / "retool_hidden_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    real = fs_mod.python_paths

    def without_site(python: str) -> tuple[list[str], list[str]]:
        binds, sys_path = real(python)
        return [b for b in binds if not str(site).startswith(b)], sys_path

    monkeypatch.setattr(fs_mod, "python_paths", without_site)  # as the executor looks it up
    with pytest.raises(SandboxPreimportError) as info:
        ForkServerExecutor(timeout=5.0, workers=1, isolation="strict", preimport=["retool_hidden_pkg"])
    message = str(info.value)
    assert "'retool_hidden_pkg': ModuleNotFoundError" in message
    assert f"{site / 'retool_hidden_pkg' / '__init__.py'}, a path the sandbox could not see" in message


@pytest.mark.bwrap
@needs_strict
def test_check_reports_missing_preimport_with_exit_1() -> None:
    result = CliRunner().invoke(app, ["sandbox", "check", "--preimport", "math,no_such_module_xyz"])
    assert result.exit_code == 1, result.output
    assert "[x] import math" in result.output
    assert "[ ] import no_such_module_xyz" in result.output


@pytest.mark.bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="only the root-run sandbox switches model code to another uid")
@needs_strict
def test_environment_closed_to_the_sandbox_uid_is_refused_at_start(tmp_path: Path) -> None:
    """A virtualenv whose folder is mode 0700: the root-run server imports from it, model code could not."""
    venv = Path(tempfile.mkdtemp(prefix="retool-venv-closed-", dir="/tmp"))  # mode 0700
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True
        )
        proc = _exec_in_venv(venv, "print(1)")
    finally:
        shutil.rmtree(venv, ignore_errors=True)
    assert proc.returncode == 1, proc.stdout
    assert "cannot read the environment" in proc.stderr
    assert f"sys.path directory {venv}/lib/" in proc.stderr and "PermissionError" in proc.stderr


ROOTLESS_DRIVER = """
import json, sys
from retool.sandbox.forkserver import ForkServerExecutor
with ForkServerExecutor(timeout=5.0, workers=1, preimport=["retool_uvenv_probe"], python=sys.executable) as ex:
    r = ex.run("import os, retool_uvenv_probe.lazy as m; print(m.__file__, m.VALUE, os.getuid())")
    print("RESULT " + json.dumps({"mode": ex.strict_mode, "ok": r.ok, "out": r.stdout, "err": r.stderr}))
"""


@pytest.mark.bwrap
def test_virtualenv_under_tmp_without_root(tmp_path: Path) -> None:
    """The same for a non-root caller (bubblewrap in a user namespace): the system interpreter's venv
    under /tmp, used by uid 65534."""
    from test_sandbox_rootless import SYSTEM_PY, _skip_reason

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    venv = Path(tempfile.mkdtemp(prefix="retool-uvenv-", dir="/tmp"))
    try:
        venv.chmod(0o755)
        subprocess.run([SYSTEM_PY, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        probe = Path(site) / "retool_uvenv_probe"
        probe.mkdir()
        (probe / "__init__.py").write_text("")
        (probe / "lazy.py").write_text("VALUE = 7\n")
        subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
        as_nobody = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "env",
            f"PYTHONPATH={SRC}",
        ]
        proc = subprocess.run(
            [*as_nobody, str(venv / "bin" / "python"), "-c", ROOTLESS_DRIVER],
            capture_output=True,
            text=True,
            timeout=300,
            cwd="/",
        )
    finally:
        shutil.rmtree(venv, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["mode"] == "userns" and result["ok"], result
    path, value, uid = result["out"].split()
    assert path.startswith(str(venv) + "/") and value == "7" and uid == "0"  # uid 0 of its own namespace
