"""The files under ``docs/results/``: written by the benches (``--write``), never by hand, and the blocks of
README.md and docs/*.md that are read from them.

A results file is a title, one line saying which command wrote it, when and on what machine, then the
body. A page quotes one with a generated block, whose text is that file without its title::

    <!-- generated: docs/results/demo.md -->
    ...
    <!-- /generated -->

``render_pages()`` rewrites every such block from its file (a bench calls it after writing); the suite
checks that each block still equals its file (``tests/test_docs_results.py``), so a figure in the README
is always the one a bench wrote.
"""

from __future__ import annotations

import datetime
import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

from _machine import machine  # bench/, on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
BLOCK = re.compile(r"(<!-- generated: (docs/results/[\w.-]+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def versions(*packages: str) -> str:
    """``name version`` of each of ``packages`` (``name (absent)`` where it is not installed)."""
    out = []
    for name in packages:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} (absent)")
    return ", ".join(out)


def write_result(name: str, title: str, body: str, packages: tuple[str, ...] = ()) -> Path:
    """``docs/results/NAME``: the title, what wrote it (this process's command line), the date, the
    machine and versions, then ``body``. Returns the path."""
    command = " ".join(["python", *(shlex.quote(a) for a in sys.argv)])
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    installed = versions("retool-rl", "torch", "transformers", *packages)
    provenance = f"Written by `{command}` on {today}. Machine: {machine()}. Versions: {installed}."
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(f"# {title}\n\n{provenance}\n\n{body.strip()}\n")
    return path


def quoted(path: Path) -> str:
    """What a page's generated block holds for this results file: the file without its title line."""
    lines = path.read_text().splitlines()
    return "\n".join(lines[2:] if lines and lines[0].startswith("# ") else lines).strip() + "\n"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def render(text: str) -> str:
    """``text`` with every generated block refilled from its results file (a missing file leaves the
    block as it is)."""

    def fill(m: re.Match[str]) -> str:
        source = REPO / m.group(2)
        return m.group(1) + quoted(source) + m.group(4) if source.is_file() else m.group(0)

    return BLOCK.sub(fill, text)


def render_pages() -> list[Path]:
    """Refill every page's generated blocks; returns the pages that changed."""
    changed = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed
