"""The demo's plumbing on a minute-sized run: phases, report, paired gain, reusing an earlier SFT."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from retool.jsonl import read_jsonl
from retool.pipeline.report import gain_line, time_split_markdown
from retool.pipeline.settings import DemoSettings
from retool.recipes.demo import run_demo
from retool.recipes.tiny import SyntheticOptions


def small(out: Path) -> DemoSettings:
    """The demo preset, shrunk to a minute: the same path through every phase."""
    sets = [
        "data.options.count=40",
        "data.options.test_count=8",
        "sft.steps=3",
        "sft.batch_size=4",
        "eval.val_n=2",
        "train.steps=2",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "filters.max_extra_rounds=1",
    ]
    return DemoSettings.load(sets, out=str(out), size="test", plots=False).with_seed(3)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoSettings, Path]:
    settings = small(tmp_path_factory.mktemp("demo") / "a")
    run_demo(settings)
    return settings, Path(settings.out)


def test_demo_writes_report_with_paired_gain_and_time_split(first_run: tuple[DemoSettings, Path]) -> None:
    _, out = first_run
    report = json.loads((out / "report.json").read_text())
    gain = report["gain"]["average_at_n"]

    # The gain and its interval, recomputed from the two evals' records: per problem, the change in the
    # share of correct candidates; the percentile bootstrap of their mean (2000 resamples, seed 0).
    def accuracy(label: str) -> dict[str, float]:
        rows = read_jsonl(out / "eval" / f"{label}_retool.jsonl")
        return {r["id"]: sum(c["correct"] for c in r["candidates"]) / len(r["candidates"]) for r in rows}

    before, after = accuracy("sft"), accuracy("rl")
    diffs = np.array([after[i] - before[i] for i in sorted(before)])
    means = diffs[np.random.default_rng(0).integers(0, len(diffs), size=(2000, len(diffs)))].mean(axis=1)
    assert gain == {
        "gain": pytest.approx(diffs.mean()),
        "ci95": pytest.approx(list(np.quantile(means, [0.025, 0.975]))),
        "problems": 8,
    }
    sft = report["evals"]["sft"]["retool"]["average_at_n"]
    rl = report["evals"]["rl"]["retool"]["average_at_n"]
    assert gain["gain"] == pytest.approx(rl - sft)
    t = report["timings"]
    assert {"tasks", "model", "sft", "eval_sft", "rl", "eval_rl", "total", "rl_share"} <= set(t)
    assert t["rl_share"] == pytest.approx(t["rl"] / t["total"], abs=1e-3)
    assert "95% paired bootstrap CI" in (out / "report.md").read_text()
    rows = read_jsonl(out / "rl" / "metrics.jsonl")
    assert len(rows) == 2 and all("sampling/groups_sampled" in r for r in rows)
    assert "dynamic_sampling = true" in (out / "rl" / "config.toml").read_text()


def test_reuse_sft_redoes_only_rl_from_the_same_model(
    first_run: tuple[DemoSettings, Path], tmp_path: Path
) -> None:
    settings, first = first_run
    again = replace(settings, out=str(tmp_path / "b"), reuse_sft=str(first)).with_overrides(
        ["filters.dynamic_sampling=false"]
    )
    result = run_demo(again)
    assert "sft" not in result.timings and "reuse_sft" in result.timings
    for mode in ("retool", "text-only"):
        name = f"sft_{mode}.jsonl"
        assert (tmp_path / "b" / "eval" / name).read_bytes() == (first / "eval" / name).read_bytes()
    # Same SFT start, same problems: the SFT row is identical; RL ran with the other setting.
    a = json.loads((first / "report.json").read_text())["evals"]["sft"]
    b = json.loads((tmp_path / "b" / "report.json").read_text())["evals"]["sft"]
    assert a["retool"]["average_at_n"] == b["retool"]["average_at_n"]
    rows = [json.loads(x) for x in (tmp_path / "b" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sampling/rounds"] == 1 for r in rows)


def test_a_run_of_another_settings_shape_is_refused_in_one_line(
    first_run: tuple[DemoSettings, Path], tmp_path: Path
) -> None:
    """A run folder whose ``settings.json`` has no ``options`` (as versions before the recipes' own options
    wrote it) is neither resumed nor reused: one line says so, and nothing is written."""
    import shutil

    settings, first = first_run
    old = tmp_path / "old"
    shutil.copytree(first, old)
    recorded = json.loads((old / "settings.json").read_text())
    options = recorded.pop("options")
    (old / "settings.json").write_text(json.dumps({**recorded, **options}))
    for attempt in (
        replace(settings, out=str(old), resume=True),
        replace(settings, out=str(tmp_path / "g"), reuse_sft=str(old)),
    ):
        with pytest.raises(ValueError, match=r"another version of retool \(no .options.\): start a new run"):
            run_demo(attempt)
    assert not (tmp_path / "g" / "report.json").exists()


def test_reuse_sft_refuses_other_tasks_or_missing_runs(
    first_run: tuple[DemoSettings, Path], tmp_path: Path
) -> None:
    settings, first = first_run
    with pytest.raises(ValueError, match=r"differ in seed, config\.data\.seed"):
        run_demo(replace(settings, out=str(tmp_path / "c"), reuse_sft=str(first)).with_seed(4))
    with pytest.raises(ValueError, match="not a finished demo run"):
        run_demo(replace(settings, out=str(tmp_path / "d"), reuse_sft=str(tmp_path / "nowhere")))


def test_settings_are_the_preset_plus_demo_fields() -> None:
    from retool.config import ConfigError, load_config

    settings = DemoSettings.load(
        ["train.steps=7", "pipeline.size=test", "pipeline.eval_modes=['retool']"], plots=False
    )
    assert settings.config == load_config("demo-tiny", ["train.steps=7"])
    assert (settings.size, settings.eval_modes, settings.plots) == ("test", ("retool",), False)
    seeded = settings.with_seed(5)
    assert (seeded.seed, seeded.config.data.seed, seeded.config.eval.seed) == (5, 5, 5)
    recorded = seeded.as_dict()
    assert recorded["seed"] == 5 and recorded["config"]["train"]["steps"] == 7
    with pytest.raises(ConfigError, match="demo field"):
        DemoSettings.load(["no_such_field=1"])


def test_a_recipe_option_is_set_by_name_and_recorded_under_options() -> None:
    from retool.config import ConfigError

    settings = DemoSettings.load(
        ["recipe.gsm8k_problems=3", "pipeline.size=test"], options=SyntheticOptions()
    )
    assert settings.options == SyntheticOptions(gsm8k_problems=3) and settings.size == "test"
    recorded = settings.as_dict()["options"]
    assert recorded == {**SyntheticOptions().as_dict(), "gsm8k_problems": 3}
    assert {"test_hard_fraction": None, "hard_tool": 0.8}.items() <= recorded.items()
    with pytest.raises(
        ConfigError, match=r"SyntheticOptions \(test_hard_fraction, gsm8k_problems, hard_tool, "
    ):
        DemoSettings.load(["recipe.coldstart_rows=3"], options=SyntheticOptions())
    with pytest.raises(ConfigError, match="demo field"):  # "options" is not itself a field to set
        DemoSettings.load(["options=1"], options=SyntheticOptions())


def test_gain_line_states_interval() -> None:
    line = gain_line({"mode": "retool", "average_at_n": {"gain": 0.2, "ci95": [0.1, 0.3], "problems": 200}})
    assert "+20.0 points" in line and "+10.0 to +30.0" in line and "200 held-out" in line
    assert gain_line({}) == ""


def test_time_split_shows_the_prompts_share_of_sampling() -> None:
    work = {
        "sample_seconds": 30.0,
        "prefill_seconds": 6.0,
        "sampled_tokens": 3000.0,
        "prefill_tokens": 1500.0,
    }
    train = {"train_seconds": 50.0, "trained_tokens": 5000.0}
    table = time_split_markdown(
        {"rl": 90.0, "eval_rl": 40.0, "total": 130.0}, {"rl": {**work, **train}, "eval_rl": work}
    )
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    assert rows["rl"][1:8] == ["90", "30", "6", "3000", "100.0", "0.50", "50"]
    assert rows["**total**"][2:7] == ["60", "12", "6000", "100.0", "0.50"]  # phases summed
    assert "prefilled / sampled" in table.splitlines()[0]
    older = time_split_markdown({"rl": 9.0}, {"rl": {"sample_seconds": 3.0, "sampled_tokens": 30.0}})
    assert older.splitlines()[2].split(" | ")[6] == "-"  # a phase recorded before prefill was counted
