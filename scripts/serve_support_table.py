"""Write docs/serve.md's ``retool serve`` "SDK call" table from the tests that show each cell (``tests/serve_support.py``):
run them, then replace the table between its markers with what passed.

Usage: python scripts/serve_support_table.py [--page docs/serve.md]   (runs ~3 minutes of serve tests on CPU)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from serve_support import BEGIN, END, named_tests, render  # noqa: E402  (tests/ is not a package)


def outcomes(ids: list[str]) -> dict[str, bool]:
    """Run the tests; a test id passed when every case of it (parametrized ones too) passed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        subprocess.run([*cmd, *[f"tests/{t}" for t in ids]], cwd=REPO, check=False)
        passed: dict[str, bool] = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")[-1]
            name = case.get("name", "").split("[")[0]
            key = f"{module}.py::{name}"
            ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
            passed[key] = passed.get(key, True) and ok
    return passed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", default=str(REPO / "docs" / "serve.md"))
    args = ap.parse_args()
    readme = Path(args.page)
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no table markers ({BEGIN} ... {END})")
    table = render(outcomes(named_tests()))
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + table + rest.split(END, 1)[1])
    print(table)


if __name__ == "__main__":
    main()
