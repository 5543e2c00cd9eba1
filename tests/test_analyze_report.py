"""`retool analyze`: two eval files and one training log -> tables (markdown + CSV) and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from retool.analyze import AnalyzeError, analyze, compare_settings, load_inputs
from retool.cli import app
from retool.config import Config
from retool.evaluate.metrics import summarize
from retool.evaluate.settings import build_settings
from retool.evaluate.store import summary_path_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_eval(
    path: Path,
    *,
    mode: str,
    checkpoint: str | None,
    correct: list[list[bool]],
    calls: int = 0,
    val_n: int | None = None,
) -> dict:
    """An eval JSONL + summary as the runner writes them, with scripted correctness."""
    records = []
    for i, row in enumerate(correct):
        cands = [
            {
                "index": b,
                "answer": "1" if ok else "2",
                "correct": ok,
                "valid_format": True,
                "code_calls": calls,
                "turns": calls + 1,
                "stop_reason": "answer",
                "exec_latencies": [0.1] * calls,
                "exec_errors": 0,
                "exec_timeouts": 0,
                "self_corrected": False,
                "completion_tokens": 5,
            }
            for b, ok in enumerate(row)
        ]
        records.append({"id": f"p{i}", "candidates": cands})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = build_settings(
        Config(),
        mode=mode,
        val_n=val_n or len(correct[0]),
        seed=0,
        tool_format="qwen_xml",
        model="toy-model",
        checkpoint=checkpoint,
        dataset="toy",
        fingerprint="abc",
        problems=len(correct),
    )
    summary = {
        "status": "complete",
        "settings": settings,
        "metrics": summarize(records),
        "completed": len(records),
        "total": len(records),
    }
    summary_path_for(path).write_text(json.dumps(summary))
    return summary


def write_metrics(path: Path, steps: int = 5) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        {
            "step": s,
            "task/reward_mean": -1 + 0.3 * s,
            "task/correct_rate": 0.1 * s,
            "tool/mean_code_calls": 0.2 * s,
            "policy/loss": 0.5,
        }
        for s in range(1, steps + 1)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture()
def inputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    a = tmp_path / "text.jsonl"
    b = tmp_path / "retool.jsonl"
    # text-only base: problem accuracies 1/4, 0, 2/4 -> Average 25%; Pass 2/3
    write_eval(
        a,
        mode="text-only",
        checkpoint=None,
        correct=[[True, False, False, False], [False] * 4, [True, True, False, False]],
    )
    # retool at a checkpoint: 3/4, 1/4, 4/4 -> Average 66.67%; Pass 100%
    write_eval(
        b,
        mode="retool",
        checkpoint="runs/r1/step_000010",
        correct=[[True, True, True, False], [False, False, True, False], [True] * 4],
        calls=2,
    )
    m = tmp_path / "run" / "metrics.jsonl"
    write_metrics(m)
    return a, b, m


def test_analyze_cli_writes_tables_and_pngs(tmp_path: Path, inputs: tuple[Path, Path, Path]) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["analyze", *map(str, inputs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("accuracy.png", "format_rate.png", "code_calls.png", "pass_at_k.png", "training_curves.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name
    md = (out / "comparison.md").read_text()
    assert "25.00%" in md and "66.67%" in md  # Average@4 of each eval
    assert "+41.67 pts" not in md  # different checkpoints: no within-checkpoint delta
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [r["checkpoint"] for r in rows] == ["base", "r1/step_000010"]
    assert float(rows[0]["text-only:average_at_n"]) == pytest.approx(0.25)
    assert float(rows[1]["retool:average_at_n"]) == pytest.approx(2 / 3)
    assert float(rows[1]["retool:pass_at_n"]) == pytest.approx(1.0)
    assert rows[0]["retool:average_at_n"] == ""  # base was not evaluated with the tool
    long = list(csv.DictReader((out / "evals.csv").open()))
    assert {r["mode"] for r in long} == {"text-only", "retool"}
    assert float(next(r for r in long if r["mode"] == "retool")["mean_code_calls"]) == 2.0
    assert "WARNING" not in result.output


def test_same_checkpoint_both_modes_gets_a_delta(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_eval(a, mode="text-only", checkpoint="ck", correct=[[True, False], [False, False]])
    write_eval(b, mode="retool", checkpoint="ck", correct=[[True, True], [True, False]])
    res = analyze([a, b], tmp_path / "o", plots=False)
    assert "+50.00 pts" in res.table_markdown  # 75% - 25%


def test_different_settings_warn_naming_them(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_eval(a, mode="text-only", checkpoint=None, correct=[[True, False, True, False]])
    s = write_eval(b, mode="retool", checkpoint=None, correct=[[True, False]])
    s["settings"]["temperature"] = 0.6
    s["settings"]["budgets"]["max_code_calls"] = 8
    summary_path_for(b).write_text(json.dumps(s))
    evals, _ = load_inputs([a, b])
    warnings = compare_settings(evals)
    joined = "\n".join(warnings)
    assert "'val_n'" in joined and "'temperature'" in joined and "'budgets.max_code_calls'" in joined
    assert "mode" not in joined  # what is being compared is not a warning
    result = CliRunner().invoke(app, ["analyze", str(a), str(b), "--out", str(tmp_path / "o"), "--no-plots"])
    assert result.exit_code == 0
    assert "WARNING" in result.output and "val_n" in result.output
    assert "not made with the same settings" in (tmp_path / "o" / "comparison.md").read_text()


def test_summary_file_and_run_folder_inputs(tmp_path: Path, inputs: tuple[Path, Path, Path]) -> None:
    a, _, m = inputs
    evals, logs = load_inputs([summary_path_for(a), m.parent])
    assert len(evals) == 1 and evals[0].metrics["average_at_n"] == pytest.approx(0.25)
    assert len(logs) == 1 and logs[0].label == "run" and len(logs[0].rows) == 5


def test_eval_without_summary_is_recomputed_from_records(
    tmp_path: Path, inputs: tuple[Path, Path, Path]
) -> None:
    a, _, _ = inputs
    summary_path_for(a).unlink()
    evals, _ = load_inputs([a])
    assert evals[0].metrics["average_at_n"] == pytest.approx(0.25)


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(AnalyzeError, match="no such file"):
        load_inputs([tmp_path / "missing.jsonl"])
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    with pytest.raises(AnalyzeError, match=r"junk\.jsonl"):
        load_inputs([junk])
    result = CliRunner().invoke(app, ["analyze", str(junk), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "junk.jsonl" in result.output


def test_checkpoint_labels_drop_generic_path_parts() -> None:
    from retool.analyze.report import short_label

    assert short_label("runs/r1/checkpoints/step_000050/backend") == "r1/step_000050"
    assert short_label("tinker://abc/weights/7") == "abc/7"
    assert short_label("step_3") == "step_3"


def test_training_curves_draw_the_instruments(tmp_path: Path) -> None:
    """Entropy beside the sampled-token NLL, the KL to the start (null on the steps that did not measure
    it: skipped, not 0), void-turn and truncation rates and the informative share each get a panel."""
    from retool.analyze.plots import curve_keys, plot_training
    from retool.analyze.report import load_training_log

    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    rows = [
        {
            "step": s,
            "task/reward_mean": 0.1 * s,
            "policy/entropy": 2.0 - 0.1 * s,
            "policy/sampled_nll": 2.1 - 0.1 * s,
            "policy/ref_kl": 0.01 * s if s % 2 == 0 else None,
            "task/void_turn_rate": 0.05,
            "task/truncated_rate": 0.1,
            "sampling/informative_share": 0.5,
        }
        for s in range(1, 7)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = load_training_log(path)
    panels = dict(curve_keys([log]))
    assert panels["entropy (nats)"] == ["policy/entropy", "policy/sampled_nll"]
    assert panels["KL to the starting policy"] == ["policy/ref_kl"]
    assert panels["void turns, truncation"] == ["task/void_turn_rate", "task/truncated_rate"]
    assert panels["informative share of groups"] == ["sampling/informative_share"]
    assert [r["step"] for r in log.rows if "policy/ref_kl" in r] == [2, 4, 6]
    out = tmp_path / "out"
    out.mkdir()
    [png] = plot_training([log], out)
    assert png.read_bytes().startswith(PNG_MAGIC)
