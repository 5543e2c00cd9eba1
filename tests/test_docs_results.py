"""Figures in README.md and docs/*.md are the ones the benches wrote: every generated block
(``<!-- generated: docs/results/NAME -->``) names a file under docs/results/ and holds exactly that file's
text (``bench/_results.py``: a bench's ``--write`` writes the file and refills the blocks)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from _results import BLOCK, pages, quoted, render  # noqa: E402  (bench/ is not a package)


def test_every_generated_block_is_its_results_file() -> None:
    for page in pages():
        text = page.read_text()
        for m in BLOCK.finditer(text):
            source = REPO / m.group(2)
            assert source.is_file(), f"{page.name} quotes {m.group(2)}, which no bench has written"
            assert m.group(3) == quoted(source), (
                f"{page.name}: the block from {m.group(2)} was edited by hand or is stale; "
                "rerun the bench with --write (or python -c 'import _results; _results.render_pages()' in bench/)"
            )


def test_render_refills_a_stale_block(tmp_path: Path) -> None:
    source = REPO / "docs" / "results" / "demo.md"
    if not source.is_file():
        source = next((REPO / "docs" / "results").glob("*.md"))
    name = source.relative_to(REPO).as_posix()
    stale = f"intro\n<!-- generated: {name} -->\nhand-typed 99.9%\n<!-- /generated -->\nafter\n"
    fresh = render(stale)
    assert "hand-typed" not in fresh and quoted(source) in fresh
    assert fresh.startswith("intro\n") and fresh.endswith("after\n")


def test_the_readme_is_a_front_door() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "bash scripts/setup.sh && retool demo" in readme
    assert "bash scripts/setup.sh --dev && python3 -m pytest -q" in readme
    for link in ("docs/demo.md", "docs/ARCHITECTURE.md", "docs/results/"):
        assert link in readme


def test_relative_links_in_the_pages_resolve() -> None:
    import re

    for page in pages():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to missing {target}"
