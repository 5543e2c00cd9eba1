"""The viewer site without a browser: which inputs it finds, what the page embeds, escaping, the CLI and
the live server's rebuild-on-change."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.cli import app
from retool.train.records import TRAJECTORIES_FILE, read_records
from retool.view.site import ViewError, build_site, discover, render_html, script_json
from synthetic_runs import HOSTILE, write_demo_like, write_training_run


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_like(tmp_path_factory.mktemp("demo") / "demo", hostile=True)


def page_data(index: Path) -> dict:
    html = index.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="retool-data">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_discover_a_demo_folder(demo: Path) -> None:
    inputs = discover([demo])
    assert [r.folder.name for r in inputs.runs] == ["rl"]
    assert sorted(p.name for p in inputs.evals) == [
        "rl_retool.jsonl",
        "rl_text-only.jsonl",
        "sft_retool.jsonl",
        "sft_text-only.jsonl",
    ]
    # Files and folders name the same inputs; naming one twice counts once.
    again = discover([demo / "rl" / "metrics.jsonl", demo / "rl", demo / "eval" / "sft_retool.summary.json"])
    assert len(again.runs) == 1 and [p.name for p in again.evals] == ["sft_retool.jsonl"]


def test_discover_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.jsonl").write_text('{"hello": 1}\n')
    for bad, why in (
        (tmp_path / "nope", "no such"),
        (tmp_path / "empty", "no training run"),
        (tmp_path / "notes.jsonl", "not a"),
    ):
        with pytest.raises(ViewError, match=why):
            discover([bad])


def test_site_indexes_every_trajectory_and_chunks_hold_the_records(demo: Path, tmp_path: Path) -> None:
    result = build_site([demo], tmp_path / "site")
    data = page_data(result.index)
    train = list(read_records(demo / "rl" / TRAJECTORIES_FILE))
    n_eval = sum(
        len(json.loads(line)["candidates"]) for f in (demo / "eval").glob("*.jsonl") for line in f.open()
    )
    assert result.trajectories == len(data["rows"]) == len(train) + n_eval
    assert [s["kind"] for s in data["sources"]] == ["train"] + ["eval"] * 4
    assert {e["label"] for e in data["evals"]} == {"sft", "rl"}
    assert data["runs"][0]["curves"]["step"] == [1, 2, 3, 4]
    assert "task/reward_mean" in data["runs"][0]["curves"]["series"]
    # Every row points at its own record in a chunk file.
    chunks = {}
    for i, name in enumerate(data["chunks"]):
        text = (tmp_path / "site" / name).read_text(encoding="utf-8")
        assert text.startswith(f"RETOOL_CHUNK({i},")
        chunks[i] = json.loads(text[len(f"RETOOL_CHUNK({i},") : -3])
    for row, rec in zip(data["rows"][: len(train)], train, strict=True):
        got = chunks[row["ch"]][row["o"]]
        assert (
            got == rec and row["st"] == rec["step"] and data["problems"][row["p"]]["id"] == rec["problem_id"]
        )
    for ev in data["evals"]:
        iv = ev["intervals"]["average_at_n"]
        assert iv["lo"] <= ev["metrics"]["average_at_n"] <= iv["hi"]
        assert iv["value"] == pytest.approx(ev["metrics"]["average_at_n"])


def test_evals_of_one_checkpoint_and_mode_are_told_apart(demo: Path, tmp_path: Path) -> None:
    import shutil

    for name in ("sft_retool.jsonl", "sft_retool.summary.json"):
        shutil.copy(demo / "eval" / name, tmp_path / name.replace("sft_retool", "again"))
    data = page_data(
        build_site([demo / "eval" / "sft_retool.jsonl", tmp_path / "again.jsonl"], tmp_path / "s").index
    )
    assert sorted(s["label"] for s in data["sources"]) == ["sft (again)", "sft (sft_retool)"]


def test_hostile_text_cannot_leave_the_data_block(demo: Path, tmp_path: Path) -> None:
    index = build_site([demo], tmp_path / "site").index
    html = index.read_text(encoding="utf-8")
    data_block = re.search(r'id="retool-data">(.*?)</script>', html, re.S).group(1)
    assert "<" not in data_block and ">" not in data_block and "&" not in data_block
    assert html.count("</script>") == 2  # the data block and the app, nothing from the records
    text = json.dumps({"q": HOSTILE})
    assert json.loads(script_json({"q": HOSTILE})) == json.loads(text)
    # A placeholder inside the data is not substituted (one pass over the template).
    page = render_html({"title": "t", "rows": [], "x": "/*__JS__*/ __DATA__ __NONCE__"})
    assert "/*__JS__*/ __DATA__ __NONCE__" in page


def test_cli_writes_the_site_next_to_the_run(demo: Path) -> None:
    result = CliRunner().invoke(app, ["view", str(demo)])
    assert result.exit_code == 0, result.output
    assert (demo / "view" / "index.html").is_file()
    assert "open: file://" in result.output
    bad = CliRunner().invoke(app, ["view", str(demo / "missing")])
    assert bad.exit_code == 2 and "no such file" in bad.output


def test_rebuilds_keep_unchanged_chunks_and_drop_stale_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retool.view import site as site_module

    monkeypatch.setattr(site_module, "CHUNK_MAX_RECORDS", 8)
    run = write_training_run(tmp_path / "run", steps=2)
    first = build_site([run], tmp_path / "site")
    assert len(first.chunks) > 1
    write_training_run(tmp_path / "more", steps=3)
    with (run / TRAJECTORIES_FILE).open("a", encoding="utf-8") as fh:
        for rec in read_records(tmp_path / "more" / TRAJECTORIES_FILE):
            if rec["step"] == 3:
                fh.write(json.dumps(rec) + "\n")
    second = build_site([run], tmp_path / "site", keep=first.chunks)
    assert second.trajectories > first.trajectories
    assert first.chunks[0] == second.chunks[0]  # an unchanged chunk keeps its name (and its cache)
    on_disk = {f"data/{p.name}" for p in (tmp_path / "site" / "data").iterdir()}
    assert on_disk == set(first.chunks) | set(second.chunks)
    third = build_site([run], tmp_path / "site")
    assert {f"data/{p.name}" for p in (tmp_path / "site" / "data").iterdir()} == set(third.chunks)


def test_live_server_rebuilds_on_refresh_when_inputs_change(tmp_path: Path) -> None:
    from retool.view.serve import LiveSite, make_server

    run = write_training_run(tmp_path / "run", steps=1)
    site = LiveSite([run], tmp_path / "site")
    assert site.refresh() and not site.refresh()  # built once, then only on change
    server = make_server(site, port=0)
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:

        def get() -> tuple[dict, str]:
            with urllib.request.urlopen(f"http://{host}:{port}/") as resp:
                html = resp.read().decode("utf-8")
                cache = resp.headers["Cache-Control"]
            m = re.search(r'id="retool-data">(.*?)</script>', html, re.S)
            return json.loads(m.group(1)), cache

        before, cache = get()
        assert cache == "no-store"
        more = write_training_run(tmp_path / "more", steps=2)
        with (run / TRAJECTORIES_FILE).open("a", encoding="utf-8") as fh:
            fh.writelines(
                json.dumps(r) + "\n" for r in read_records(more / TRAJECTORIES_FILE) if r["step"] == 2
            )
        after, _ = get()
        assert len(after["rows"]) > len(before["rows"]) and site.builds == 2
        assert {r["st"] for r in after["rows"]} == {1, 2}
    finally:
        server.shutdown()
        server.server_close()


def test_overview_charts_the_instruments(demo: Path, tmp_path: Path) -> None:
    """Entropy, sampled-token NLL, KL to the start (measured every other step: null between, drawn as one
    line), tool-call, void-turn and truncation rates and the informative share reach the index as curves
    and the overview names them among its charts."""
    data = page_data(build_site([demo], tmp_path / "site").index)
    series = data["runs"][0]["curves"]["series"]
    keys = (
        "policy/entropy",
        "policy/sampled_nll",
        "tool/code_share",
        "task/void_turn_rate",
        "task/truncated_rate",
        "sampling/informative_share",
    )
    for key in keys:
        assert key in series and len(series[key]) == 4 and all(v is not None for v in series[key])
    assert [v is not None for v in series["policy/ref_kl"]] == [False, True, False, True]
    app_js = (resources.files("retool.view") / "assets" / "app.js").read_text(encoding="utf-8")
    charts = app_js[app_js.index("const CHARTS") : app_js.index("function renderOverview")]
    for key in (*keys, "policy/ref_kl"):
        assert f'"{key}"' in charts
    assert 'keys: ["policy/ref_kl"], sparse: true' in charts


def test_overview_charts_the_tool_error_rates_calls_and_response_length(demo: Path, tmp_path: Path) -> None:
    """The RoC metrics (``tool/error_rate_correct`` / ``_wrong``), calls per trajectory and response length
    reach the index as curves, and the overview names them among its charts."""
    data = page_data(build_site([demo], tmp_path / "site").index)
    series = data["runs"][0]["curves"]["series"]
    keys = (
        "tool/error_rate_correct",
        "tool/error_rate_wrong",
        "tool/mean_code_calls",
        "policy/response_length",
    )
    for key in keys:
        assert key in series and len(series[key]) == 4 and all(v is not None for v in series[key])
    app_js = (resources.files("retool.view") / "assets" / "app.js").read_text(encoding="utf-8")
    charts = app_js[app_js.index("const CHARTS") : app_js.index("function renderOverview")]
    for key in keys:
        assert f'"{key}"' in charts
