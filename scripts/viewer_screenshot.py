"""Screenshots of the trajectory viewer for the README, taken with the browser tests' tooling.

    python scripts/viewer_screenshot.py runs/demo --out docs/viewer.png [--overview docs/viewer-overview.png]

Builds the site for the given run/eval paths into a temporary folder, opens it in headless Chromium
(``tests/headless_browser.py``), picks a trajectory from the last sampled training step that called the tool
and got the answer right (so the picture shows code, interpreter output marked masked, and the boxed
answer against the reference), and saves the viewport as PNG. Fails if the page logged a console error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the browser tests' tooling
from headless_browser import launch, open_site
from retool.view.site import build_site


def pick_row(data: dict) -> int:
    rows, sources = data["rows"], data["sources"]
    train = [i for i, r in enumerate(rows) if sources[r["s"]]["kind"] == "train" and r["t"]]
    # Best: an execution failed, the model called again and got it right; then any correct call.
    pool = (
        [i for i in train if rows[i]["e"] and rows[i]["k"] >= 2 and rows[i]["c"]]
        or [i for i in train if rows[i]["k"] >= 1 and rows[i]["c"]]
        or train
        or list(range(len(rows)))
    )
    if not pool:
        raise SystemExit("no trajectories to show")
    last = max(rows[i]["st"] or 0 for i in pool)
    return next(i for i in pool if (rows[i]["st"] or 0) == last)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="PNG of a trajectory in the browser")
    parser.add_argument("--overview", type=Path, default=None, help="PNG of the overview tab too")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retool-view-shot-") as tmp:
        result = build_site(args.paths, Path(tmp) / "site")
        html = result.index.read_text(encoding="utf-8")
        data = json.loads(re.search(r'id="retool-data">(.*?)</script>', html, re.S).group(1))
        row = pick_row(data)
        url = result.index.resolve().as_uri()
        with launch(args.width, args.height) as browser:
            page, watch = open_site(browser, f"{url}#browse/{row}")
            page.wait_for_selector("#detail .spans .span")
            page.wait_for_timeout(200)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            if args.overview is not None:
                page.goto(f"{url}#overview")
                page.wait_for_selector("#charts .chart")
                page.wait_for_timeout(200)
                page.screenshot(path=str(args.overview))
            if watch.errors:
                sys.exit(f"console errors: {watch.errors}")
    for path in filter(None, (args.out, args.overview)):
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
