"""docs/serve.md's ``retool serve`` table is the one ``tests/serve_support.py`` defines: every test it names exists,
and its rows are the generated ones (their yes / failing cells written by
``scripts/serve_support_table.py`` from a run of those tests)."""

from __future__ import annotations

import ast
from pathlib import Path

from serve_support import BEGIN, END, named_tests, render

REPO = Path(__file__).resolve().parents[1]


def test_every_named_test_exists() -> None:
    for test_id in named_tests():
        file, name = test_id.split("::")
        tree = ast.parse((REPO / "tests" / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{test_id} is named in the serve support table but does not exist"


def test_readme_holds_the_generated_table() -> None:
    text = (REPO / "docs" / "serve.md").read_text()
    assert BEGIN in text and END in text
    block = BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    # the table as it reads when every named test passed; a page written after a failing run differs
    assert block == render(dict.fromkeys(named_tests(), True)), "run scripts/serve_support_table.py"
