"""The viewer in a real headless Chromium (Debian's ``chromium`` driven by Playwright).

The page loads with no console errors and no request leaving the machine, filters change what is
listed, a trajectory's masked spans are in the DOM and match the datum it was trained on, model output
stays text, the compare view lines a problem up across sources, and ``--serve`` shows new steps on
refresh. Skipped (with the reason) where no browser is installed, unless ``RETOOL_REQUIRE_BROWSER=1``
turns that into a failure; ``scripts/setup.sh --dev`` installs one.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from headless_browser import BrowserUnavailable, check_available, launch, open_site
from retool.train.records import TRAJECTORIES_FILE, TrajectoryLog, read_records
from retool.train.step import build_step_data, trajectory_tokens
from retool.view.site import build_site
from synthetic_runs import HOSTILE, decode, make_problems, make_trajectory, write_demo_like


@pytest.fixture(scope="module")
def browser() -> Any:
    # Playwright's sync API runs an event loop on this thread: data that needs asyncio.run (the evals)
    # is built before the browser starts, which is why tests name ``built`` before ``browser``.
    try:
        check_available()
    except BrowserUnavailable as exc:
        if os.environ.get("RETOOL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"RETOOL_REQUIRE_BROWSER=1 but {exc}")
        pytest.skip(str(exc))
    with launch() as context:
        yield context


class Built:
    """A site over a demo-like folder plus one run whose groups and datums the test keeps."""

    def __init__(self, root: Path) -> None:
        self.demo = write_demo_like(root / "demo", hostile=True)
        rng = random.Random(7)
        self.groups = []
        for p in make_problems(3, 11, prefix="exact"):
            while True:  # a group with both rewards, so its datums are trained
                group = [make_trajectory(p, b, rng) for b in range(4)]
                if len({t.reward for t in group}) > 1:
                    break
            self.groups.append(group)
        self.data = build_step_data(self.groups)
        TrajectoryLog(root / "exact" / TRAJECTORIES_FILE, "all").write_step(
            1, self.groups, self.data, decode=decode
        )
        result = build_site([self.demo, root / "exact"], root / "site")
        self.index = result.index
        self.url = result.index.resolve().as_uri()
        html = result.index.read_text(encoding="utf-8")
        self.page_data = json.loads(re.search(r'id="retool-data">(.*?)</script>', html, re.S).group(1))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("viewer"))


def visible_rows(page: Any) -> list[dict[str, Any]]:
    return page.eval_on_selector_all(
        "#list .row",
        "rows => rows.map(r => ({i: +r.dataset.i, ok: !!r.querySelector('.ok'), text: r.textContent}))",
    )


def count(page: Any) -> int:
    return int(page.text_content("#count").split()[0])


def test_page_loads_clean_and_stays_offline(built: Built, browser: Any) -> None:
    for tab in ("overview", "browse", "compare"):
        page, watch = open_site(browser, f"{built.url}#{tab}")
        page.wait_for_timeout(200)
        assert watch.errors == [], watch.errors
        assert watch.external_requests() == []
        page.close()
    page, _ = open_site(browser, f"{built.url}#overview")
    # The curves of the run and the evals' interval bars are drawn.
    assert page.locator("#charts .chart path.line").count() >= 6
    assert page.locator("#evalcharts .chart").count() == 4
    assert page.locator("table.evals tr").count() == 1 + 4
    page.hover("#charts .chart svg >> nth=0")
    assert "step" in page.text_content("#charts .chart .tip >> nth=0")
    # the KL to the start, measured every other step, is one line through the steps that have it
    kl = page.locator("#charts .chart", has_text="KL to the starting policy").locator("path.line").first
    d = kl.get_attribute("d") or ""
    assert d.count("M") == 1 and d.count("L") >= 1, d
    page.close()


def test_filters_change_what_is_listed(built: Built, browser: Any) -> None:
    rows = built.page_data["rows"]
    sources = built.page_data["sources"]
    stops = built.page_data["stops"]
    page, watch = open_site(browser, f"{built.url}#browse")
    assert count(page) == len(rows)
    demo_run = next(i for i, s in enumerate(sources) if s["kind"] == "train" and s["label"].endswith("rl"))

    page.select_option("#filters select[name=source]", str(demo_run))
    page.select_option("#filters select[name=step]", "2")
    want = [i for i, r in enumerate(rows) if r["s"] == demo_run and r["st"] == 2]
    assert count(page) == len(want) and 0 < len(want) < len(rows)
    assert [r["i"] for r in visible_rows(page)] == want
    assert all("step 2" in r["text"] for r in visible_rows(page))

    page.select_option("#filters select[name=outcome]", "incorrect")
    want = [i for i in want if not rows[i]["c"]]
    assert [r["i"] for r in visible_rows(page)] == want and not any(r["ok"] for r in visible_rows(page))

    page.select_option("#filters select[name=step]", "")
    page.select_option("#filters select[name=outcome]", "")
    page.select_option("#filters select[name=tool]", "none")
    assert count(page) == sum(1 for r in rows if r["s"] == demo_run and r["k"] == 0) > 0
    assert all("⚙0" in r["text"] for r in visible_rows(page))

    page.select_option("#filters select[name=tool]", "")
    page.select_option("#filters select[name=error]", "yes")
    assert count(page) == sum(1 for r in rows if r["s"] == demo_run and r["e"] > 0) > 0

    page.select_option("#filters select[name=error]", "")
    page.select_option("#filters select[name=source]", "")
    invalid = stops.index("invalid")
    page.select_option("#filters select[name=stop]", str(invalid))
    assert count(page) == sum(1 for r in rows if r["x"] == invalid) > 0
    assert all("invalid" in r["text"] for r in visible_rows(page))

    page.select_option("#filters select[name=stop]", "")
    page.fill("#filters input[name=problem]", "exact-0001")
    assert count(page) == 4 and all("exact-0001" in r["text"] for r in visible_rows(page))
    page.fill("#filters input[name=problem]", "")
    assert count(page) == len(rows)
    assert watch.errors == []
    page.close()


def test_masked_spans_are_shown_and_match_the_datum(built: Built, browser: Any) -> None:
    rows = built.page_data["rows"]
    exact = next(i for i, s in enumerate(built.page_data["sources"]) if s["label"].endswith("exact"))
    first_row = next(i for i, r in enumerate(rows) if r["s"] == exact)
    page, watch = open_site(browser, f"{built.url}#browse")
    checked = 0
    for g, group in enumerate(built.groups):
        for b, traj in enumerate(group):
            tokens = trajectory_tokens(traj)[0]
            datum = next(d for d in built.data.datums if [*d.input_tokens, d.target_tokens[-1]] == tokens)
            page.evaluate("h => { location.hash = h; }", f"browse/{first_row + g * 4 + b}")
            page.wait_for_selector(f"#detail .traj-head:has-text('exact-{g:04d}')")
            spans = page.eval_on_selector_all(
                "#detail .span[data-start]",
                "els => els.map(e => ({start: +e.dataset.start, end: +e.dataset.end, role: e.dataset.role,"
                " trained: e.dataset.trained === '1', masked: e.classList.contains('masked'),"
                " text: e.querySelector('pre.text').textContent}))",
            )
            trained = {j for s in spans if s["trained"] for j in range(s["start"], s["end"])}
            assert trained == {j + 1 for j, w in enumerate(datum.weights) if w != 0.0}
            assert spans[0]["start"] == 0 and spans[-1]["end"] == len(tokens)
            assert "".join(s["text"] for s in spans) == decode(tokens)  # the exact sequence, as text
            observations = [s for s in spans if s["role"] == "observation"]
            assert len(observations) == traj.outcome.code_calls
            for s in observations:  # interpreter output: visibly masked
                assert s["masked"] and not s["trained"]
            if traj.outcome.code_calls:
                assert "MASKED · NOT TRAINED" in page.text_content(
                    "#detail .span.masked[data-role=observation]"
                )
                assert page.locator("#detail code.py .tk-b").count() >= 1  # the code is highlighted
            checked += 1
    assert checked == 12
    assert watch.errors == []
    page.close()


def test_model_output_stays_text(built: Built, browser: Any) -> None:
    train = list(read_records(built.demo / "rl" / TRAJECTORIES_FILE))
    hostile_row = next(i for i, r in enumerate(train) if HOSTILE.split(" ")[0] in r["turns"][0]["text"])
    page, watch = open_site(browser, f"{built.url}#browse/{hostile_row}")
    page.wait_for_selector("#detail .span[data-role=completion]")
    text = page.text_content("#detail .span[data-role=completion]")
    assert "<script>window.__pwned = 1</script>" in text and 'onerror="window.__pwned = 2"' in text
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#detail img, #detail script").count() == 0
    assert watch.errors == []
    page.close()


def test_compare_lines_a_problem_up_across_sources(built: Built, browser: Any) -> None:
    page, watch = open_site(browser, f"{built.url}#compare")
    page.wait_for_selector(".cmp-col .traj-head")
    columns = page.eval_on_selector_all(".cmp-col h3", "els => els.map(e => e.textContent)")
    assert sorted(columns) == ["rl · retool", "rl · text-only", "sft · retool", "sft · text-only"]
    problem = page.eval_on_selector("#cmp-problem", "s => s.options[s.selectedIndex].textContent")
    heads = page.eval_on_selector_all(".cmp-col .traj-head h2", "els => els.map(e => e.textContent)")
    assert len(heads) == 4 and all(h.split()[0] == problem.split()[0] for h in heads)
    page.click(".cmp-col >> nth=1 >> .chip >> nth=2")
    page.wait_for_selector(".cmp-col >> nth=1 >> .traj-head h2:has-text('#2')")
    assert watch.errors == []
    page.close()


def test_serve_shows_new_steps_on_refresh(browser: Any, tmp_path: Path) -> None:
    from retool.view.serve import LiveSite, make_server
    from synthetic_runs import write_training_run

    run = write_training_run(tmp_path / "run", steps=1)
    site = LiveSite([run], tmp_path / "site")
    site.refresh()
    server = make_server(site, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        page, watch = open_site(browser, f"http://{host}:{port}/#browse")
        before = count(page)
        more = write_training_run(tmp_path / "more", steps=2)
        with (run / TRAJECTORIES_FILE).open("a", encoding="utf-8") as fh:
            fh.writelines(
                json.dumps(r) + "\n" for r in read_records(more / TRAJECTORIES_FILE) if r["step"] == 2
            )
        page.reload()
        page.wait_for_selector("body[data-ready='1']")
        assert count(page) > before
        page.select_option("#filters select[name=step]", "2")
        page.click("#list .row >> nth=0")
        page.wait_for_selector("#detail .span[data-role=completion]")
        assert watch.errors == [] and watch.external_requests() == []
        page.close()
    finally:
        server.shutdown()
        server.server_close()
