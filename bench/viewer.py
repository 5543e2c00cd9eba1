"""Viewer responsiveness: a synthetic 2,000-trajectory run rendered in headless Chromium.

    python bench/viewer.py [--trajectories 2000] [--chars 300 2500] [--out DIR] [--write]

Writes the run with the real ``TrajectoryLog`` (records of chapter-like size: 2-4 turns, a few thousand
tokens each), builds the site with ``retool.view.site.build_site``, opens it and reports, from the
page's own clock:

- first render: navigation start to the list drawn and the app ready (``RETOOL_READY_MS``), and the
  browser's first contentful paint; goal < 2 s;
- filter: a filter change to the next painted frame, over several filters; goal < 200 ms;
- open: a trajectory picked to its turns rendered (its chunk loaded on first use).

A measurement, not a test: nothing here fails on a slow machine. ``--write`` also writes what it printed to
docs/results/viewer.md and refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' run writer and browser
from _results import recording, write_printed  # bench/, on sys.path when run as a script
from headless_browser import launch, open_site
from retool.view.site import build_site
from synthetic_runs import write_training_run

FILTERS = [
    ("outcome", "correct"),
    ("outcome", "incorrect"),
    ("tool", "none"),
    ("error", "yes"),
    ("step", "7"),
    ("outcome", ""),
    ("tool", ""),
    ("error", ""),
    ("step", ""),
    ("sort", "adv-desc"),
    ("sort", ""),
]

# Change one filter, then resolve with the time to the next painted frame (two rAFs: after paint).
MEASURE_FILTER = """([name, value]) => new Promise(resolve => {
  const el = document.querySelector(`#filters [name=${name}]`);
  const t0 = performance.now();
  el.value = value;
  el.dispatchEvent(new Event('change', {bubbles: true}));
  requestAnimationFrame(() => requestAnimationFrame(() => resolve(performance.now() - t0)));
})"""

MEASURE_TYPING = """(text) => new Promise(resolve => {
  const el = document.querySelector('#filters [name=problem]');
  const t0 = performance.now();
  el.value = text;
  el.dispatchEvent(new Event('input', {bubbles: true}));
  requestAnimationFrame(() => requestAnimationFrame(() => resolve(performance.now() - t0)));
})"""

MEASURE_OPEN = """(i) => new Promise(resolve => {
  const t0 = performance.now();
  location.hash = 'browse/' + i;
  const poll = () => {
    const head = document.querySelector('#detail .traj-head');
    if (head && document.querySelector('#detail .spans .span')) {
      requestAnimationFrame(() => resolve(performance.now() - t0));
    } else requestAnimationFrame(poll);
  };
  poll();
})"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument("--chars", type=int, nargs=2, default=(300, 2500), help="reasoning text per turn")
    parser.add_argument("--out", type=Path, default=None, help="keep the run and the site here")
    parser.add_argument("--write", action="store_true", help="also write docs/results/viewer.md")
    args = parser.parse_args()
    with recording(args.write) as rec:
        run(args)
    if args.write:
        name = "viewer.md" if args.trajectories == 2000 else f"viewer_{args.trajectories}.md"
        write_printed(name, "The trajectory viewer in headless Chromium: `bench/viewer.py`", rec)


def run(args: argparse.Namespace) -> None:
    """Write the synthetic run, build its site, and time it in the browser; prints the figures."""
    group_size, questions = 8, 2
    steps = max(1, args.trajectories // (group_size * questions))
    with tempfile.TemporaryDirectory(prefix="retool-view-bench-") as tmp:
        root = args.out or Path(tmp)
        t0 = time.perf_counter()
        run = write_training_run(
            root / "run",
            steps=steps,
            questions_per_step=questions,
            group_size=group_size,
            groups_per_step="all",
            reasoning_chars=tuple(args.chars),
        )
        t_write = time.perf_counter() - t0
        result = build_site([run], root / "site")
        size = (run / "trajectories.jsonl").stat().st_size
        chunk_bytes = sum((root / "site" / c).stat().st_size for c in result.chunks)
        print(
            f"run: {result.trajectories} trajectories over {steps} steps, trajectories.jsonl {size / 1e6:.1f} MB "
            f"({size / result.trajectories / 1e3:.1f} kB each), written in {t_write:.1f}s"
        )
        print(
            f"site: index.html {result.index.stat().st_size / 1e6:.2f} MB + {len(result.chunks)} chunks "
            f"{chunk_bytes / 1e6:.1f} MB, built in {result.seconds:.2f}s"
        )
        url = result.index.resolve().as_uri()
        with launch() as browser:
            first, fcp = [], []
            for _ in range(3):  # a cold and two warm loads
                page, watch = open_site(browser, f"{url}#browse")
                first.append(page.evaluate("window.RETOOL_READY_MS"))
                fcp.append(
                    page.evaluate(
                        "(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null"
                    )
                )
                if watch.errors:
                    print("console errors:", watch.errors)
                page.close()
            page, watch = open_site(browser, f"{url}#browse")
            filters = [page.evaluate(MEASURE_FILTER, list(f)) for f in FILTERS]
            typing = [page.evaluate(MEASURE_TYPING, t) for t in ("m", "mul-00", "mul-0003", "")]
            opens = [
                page.evaluate(MEASURE_OPEN, i)
                for i in (0, 1, result.trajectories // 2, result.trajectories - 1)
            ]
            page.close()
    print(f"first render (app ready): {', '.join(f'{x:.0f}' for x in first)} ms  (goal < 2000)")
    print(f"first contentful paint:   {', '.join('-' if x is None else f'{x:.0f}' for x in fcp)} ms")
    print(
        f"filter change to paint:   median {statistics.median(filters):.1f} ms, max {max(filters):.1f} ms "
        f"over {len(filters)} changes  (goal < 200)"
    )
    print(f"problem search to paint:  max {max(typing):.1f} ms over {len(typing)} inputs")
    print(
        f"open a trajectory:        {', '.join(f'{x:.0f}' for x in opens)} ms "
        "(first in a chunk loads it; same-chunk neighbours reuse it)"
    )


if __name__ == "__main__":
    main()
