"""The demo's GSM8K task (``retool demo --recipe gsm8k``): its settings, the leak check, the
held-out slice, and (slow) the whole pipeline on SmolLM2 with small slices: base zero-shot eval, cold start
from annotated GSM8K train solutions, SFT, RL on GSM8K train, evaluation text-only and with the tool, the
report — and that no test question is ever converted or trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from retool.data.gsm8k import GSM8KLeakError, normalize_question
from retool.pipeline.settings import DemoSettings, options_as
from retool.recipes.demo import recipe_settings, run_demo
from retool.recipes.gsm8k import Gsm8kOptions
from retool.recipes.gsm8k.task import coldstart_rows, gsm8k_source, held_out_problems


def _rows(path: Path) -> int:
    return sum(1 for line in path.open(encoding="utf-8") if line.strip())


def test_the_gsm8k_preset_and_fields() -> None:
    settings = recipe_settings("gsm8k")
    assert settings.recipe == "gsm8k" and settings.config.data.source == "gsm8k"
    assert settings.eval_modes == ("text-only", "retool") == settings.base_eval_modes
    assert settings.eval_temperature == 0.0 and settings.config.eval.val_n == 1
    assert settings.out == "runs/demo-smollm2-gsm8k" and options_as(settings, Gsm8kOptions).coldstart_rows > 0
    # The synthetic task keeps its own preset.
    assert recipe_settings("smollm2").config.data.source == "synthetic"


def test_tiny_model_and_unknown_recipes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the gsm8k recipe needs a real model"):
        run_demo(DemoSettings.load(["pipeline.recipe=gsm8k"], out=str(tmp_path / "d")))
    with pytest.raises(ValueError, match="unknown recipe 'mnist'"):
        run_demo(DemoSettings.load(["pipeline.recipe=mnist"], out=str(tmp_path / "e")))
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()  # refused before claiming


def test_held_out_slice_is_seeded_and_the_whole_split_keeps_file_order(fixture_data: Path) -> None:
    a, b = held_out_problems(20, str(fixture_data), 0), held_out_problems(20, str(fixture_data), 1)
    assert len(a) == 20 and a == held_out_problems(20, str(fixture_data), 0) and a != b
    whole = held_out_problems(5000, str(fixture_data), 0)
    assert (
        len(whole) == _rows(fixture_data / "gsm8k_test.jsonl")
        and whole[0].id == "gsm8k-0"
        and {p.id for p in a} <= {p.id for p in whole}
    )


def test_coldstart_rows_are_seeded(fixture_data: Path) -> None:
    path = fixture_data / "gsm8k_train.jsonl"
    rows = coldstart_rows(path, 50, 0)
    assert len(rows) == 50 and rows == coldstart_rows(path, 50, 0) != coldstart_rows(path, 50, 1)
    assert min(rows) >= 1 and max(rows) <= _rows(path)


def test_a_test_question_in_train_stops_the_source(fixture_data: Path, tmp_path: Path) -> None:
    test_q = json.loads((fixture_data / "gsm8k_test.jsonl").read_text().split("\n")[0])["question"]
    (tmp_path / "gsm8k_test.jsonl").write_text((fixture_data / "gsm8k_test.jsonl").read_text())
    train = (fixture_data / "gsm8k_train.jsonl").read_text().split("\n")[:20]
    train.append(json.dumps({"question": test_q.upper(), "answer": "1+1 = <<1+1=2>>2\n#### 2"}))
    (tmp_path / "gsm8k_train.jsonl").write_text("\n".join(train) + "\n")
    config = recipe_settings("gsm8k").config
    config = config.model_copy(update={"data": config.data.model_copy(update={"data_dir": str(tmp_path)})})
    with pytest.raises(GSM8KLeakError, match="never trained on"):
        gsm8k_source(config).problems("train")
    clean = config.model_copy(update={"data": config.data.model_copy(update={"data_dir": str(fixture_data)})})
    assert len(gsm8k_source(clean).problems("train")) == _rows(fixture_data / "gsm8k_train.jsonl")


@pytest.mark.slow
def test_the_gsm8k_demo_end_to_end_on_smollm2(fixture_data: Path, tmp_path: Path, smollm2_file: Path) -> None:
    small = [
        "lora.rank=4",
        "lora.alpha=8",
        "sft.steps=2",
        "sft.batch_size=2",
        "train.steps=1",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "rollout.max_tokens_per_turn=40",
        "rollout.max_trajectory_tokens=600",
        "filters.dynamic_sampling=false",
        "checkpoint.every=0",
        "backend.cpu_threads=1",
        "backend.sample_batch_size=8",
        "recipe.coldstart_rows=24",
        "recipe.gsm8k_problems=3",
        "pipeline.base_eval_problems=2",
        "pipeline.plots=false",
    ]
    out = tmp_path / "run"
    settings = recipe_settings("gsm8k", small, out=str(out), data_dir=str(fixture_data))
    result = run_demo(settings)

    # Cold start: every read row is kept or counted under a reason; the kept ones fit the budgets.
    conversion = json.loads((out / "coldstart" / "report.json").read_text())
    assert conversion["read"] == 24 == conversion["kept"] + sum(conversion["dropped"].values())
    # 40-token turns: most solutions do not fit, and are counted as such.
    assert set(conversion["dropped"]) <= {"over_budget", "no_annotation"} and conversion["kept"] >= 2
    report = json.loads((out / "report.json").read_text())
    assert report["sft"]["conversion"]["kept"] == conversion["kept"]
    # No test question was converted, trained on in SFT, or rolled out in RL.
    test_questions = {
        normalize_question(json.loads(line)["question"])
        for line in (fixture_data / "gsm8k_test.jsonl").read_text().splitlines()
    }
    sft_questions = [
        json.loads(x)["question"] for x in (out / "coldstart" / "train.jsonl").read_text().splitlines()
    ]
    assert not {normalize_question(q) for q in sft_questions} & test_questions
    metrics = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    rl_ids = [pid for row in metrics for pid in row["problem_ids"]]
    assert rl_ids and all(pid.startswith("gsm8k-train-") for pid in rl_ids)
    # Base, SFT and RL, each text-only and with the tool, on the same held-out test slice.
    held_out = [json.loads(x)["id"] for x in (out / "tasks" / "test.jsonl").read_text().splitlines()]
    assert len(held_out) == 3 and all(pid.startswith("gsm8k-") for pid in held_out)
    assert {(r["model"], r["mode"]) for r in result.table} == {
        (m, mode) for m in ("base", "sft", "rl") for mode in ("text-only", "retool")
    }
    assert all(r["gsm8k_candidates"] == r["problems"] for r in result.table if r["model"] != "base")
    table = (out / "report.md").read_text()
    assert "Acc GSM8K" in table and "Acc hard" not in table and "Acc easy" not in table
    assert result.gain["average_at_n"]["problems"] == 3
    evals: dict[str, Any] = report["evals"]
    assert set(evals) == {"base", "sft", "rl"}


def test_the_rl_curriculum_keeps_short_train_solutions_only(fixture_data: Path) -> None:
    from retool.data.annotated import ParseFailure, parse_solution

    config = recipe_settings("gsm8k").config
    config = config.model_copy(
        update={"data": config.data.model_copy(update={"data_dir": str(fixture_data)})}
    )
    rows = [json.loads(x) for x in (fixture_data / "gsm8k_train.jsonl").read_text().splitlines()]
    steps = [0 if isinstance(p := parse_solution(r["answer"]), ParseFailure) else len(p.steps) for r in rows]
    short = gsm8k_source(config, max_solution_steps=2).problems("train")
    assert [p.id for p in short] == [f"gsm8k-train-{i}" for i, n in enumerate(steps) if 1 <= n <= 2]
    assert {p.question for p in short} <= {r["question"] for r in rows}
    assert len(gsm8k_source(config, 2).problems("test")) == _rows(
        fixture_data / "gsm8k_test.jsonl"
    )  # the test split is never filtered
