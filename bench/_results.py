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

Most benches print a plain-text report; with ``--write`` they run inside ``recording()``, which copies
what they print, and ``write_printed()`` turns that copy into the results file (the report verbatim, with
the machine's load average at the start and the end of the run: a busy 2-core machine moves the absolute
numbers, and the reader should know how busy it was).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import TextIO

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


# An absolute path in text (not the tail of a relative path, a URL or a unit such as tok/s).
_ABSOLUTE = re.compile(r"(?<![\w.~:/-])/(?:[\w.+@-]+/)*[\w.+@-]+")
# Where a path names this machine: its work folders, home folders and scratch space.
_MACHINE_ROOTS = frozenset({"work", "root", "home", "Users", "tmp", "mnt", "scratch"})


def user_path(path: str) -> str:
    """``path`` as a user would type it, naming nothing of the machine that ran the bench: an installed
    package's file from ``<site-packages>``, a run folder from ``runs/``, a path in or beside this checkout
    (wherever it was cloned) relative to it, any other path of a work or home folder relative to the checkout.
    System paths stay."""
    parts = PurePosixPath(path).parts[1:]
    for packages in ("site-packages", "dist-packages"):
        if packages in parts:
            return "/".join(("<site-packages>", *parts[parts.index(packages) + 1 :]))
    # A checkout cloned at the file system's root has no folder "beside" it worth writing relative to.
    beside_checkout = len(REPO.parent.parts) > 1 and PurePosixPath(path).is_relative_to(REPO.parent)
    if not beside_checkout and (not parts or parts[0] not in _MACHINE_ROOTS):
        return path
    if "runs" in parts:
        return "/".join(parts[parts.index("runs") :])
    return os.path.relpath(path, REPO)


def user_paths(text: str) -> str:
    """``text`` with every absolute path written by ``user_path``."""
    return _ABSOLUTE.sub(lambda m: user_path(m.group(0)), text)


def text_files() -> list[Path]:
    """The results files benches write as text (the PNGs a report links sit beside them)."""
    return sorted(p for p in RESULTS.iterdir() if p.suffix in (".md", ".txt"))


def normalise_results() -> list[Path]:
    """Rewrite every results file's paths as ``write_result`` now writes them (``user_paths``), then refill
    the pages: for files written before the benches named paths that way. Returns the files changed."""
    changed = []
    for path in text_files():
        text = path.read_text()
        if user_paths(text) != text:
            path.write_text(user_paths(text))
            changed.append(path)
    render_pages()
    return changed


def write_result(name: str, title: str, body: str, packages: tuple[str, ...] = ()) -> Path:
    """``docs/results/NAME``: the title, what wrote it (this process's command line, as a user would type
    it: ``user_paths``), the date, the machine and versions, then ``body``. Returns the path."""
    command = user_paths(" ".join(["python", *(shlex.quote(a) for a in sys.argv)]))
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
    """The pages that quote results files: the README, docs/, and each recipe's README."""
    recipes = sorted((REPO / "src" / "retool" / "recipes").glob("*/README.md"))
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *recipes]


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


def load_average() -> str:
    """The 1 / 5 / 15-minute load averages, as ``a b c``."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


class _Tee(io.TextIOBase):
    """Writes go to the terminal and to the recording alike."""

    def __init__(self, terminal: TextIO, copy: io.StringIO) -> None:
        self.terminal, self.copy = terminal, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.terminal.flush()


@dataclass
class Recording:
    """What a bench printed to stdout while ``recording()`` ran, and the load around it."""

    load_start: str = field(default_factory=load_average)
    load_end: str = ""
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    buffer: io.StringIO = field(default_factory=io.StringIO)

    @property
    def text(self) -> str:
        return self.buffer.getvalue()


@contextlib.contextmanager
def recording(enabled: bool = True, stderr: bool = False) -> Iterator[Recording]:
    """Copy everything printed to stdout (and to stderr with ``stderr``) inside the block, still printed
    as before; with ``enabled`` false nothing is copied, so a bench without ``--write`` behaves exactly as
    it did."""
    rec = Recording()
    original = sys.stdout, sys.stderr
    if enabled:
        sys.stdout = _Tee(original[0], rec.buffer)
        if stderr:
            sys.stderr = _Tee(original[1], rec.buffer)
    try:
        yield rec
    finally:
        sys.stdout, sys.stderr = original
        rec.load_end = load_average()
        rec.seconds = time.monotonic() - rec.started


def write_printed(
    name: str,
    title: str,
    rec: Recording,
    note: str = "",
    packages: tuple[str, ...] = (),
    markdown: bool = False,
) -> Path:
    """``docs/results/NAME`` holding what the bench printed (verbatim: in a text block, or as it is when
    the bench prints ``markdown``) after the load line and an optional ``note`` (what the run's settings
    mean); then every page's blocks refilled."""
    cores = os.cpu_count()
    load = (
        f"Load average (1 / 5 / 15 min) on the {cores} cores: {rec.load_start} at the start, "
        f"{rec.load_end} at the end; the bench ran {rec.seconds / 60:.1f} min."
    )
    text = user_paths(rec.text.strip())  # a model file or run folder named without this machine's paths
    printed = text if markdown else f"```text\n{text}\n```"
    body = "\n\n".join(part for part in (load, note.strip(), printed) if part)
    path = write_result(name, title, body, packages)
    print(f"written to {path}", file=sys.stderr)
    for page in render_pages():
        print(f"refilled {page}", file=sys.stderr)
    return path
