"""bench/gsm8k.py sized to its claims: which models it evaluates (base and SFT once, RL per seed), how the
seeds' demos share one SFT model (no evaluation of their own), per-model results kept so a rerun skips a
finished model, the report over the shared SFT model; and the greedy evaluation's stop at the first closed
``\\boxed{...}`` (``sampling.stop_at_boxed``) in the local engine."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _harness
import gsm8k as bench
from retool.pipeline.report import DemoResult
from retool.pipeline.run import _reuse_sft
from retool.pipeline.settings import DemoSettings
from retool.recipes.demo import recipe_settings


def _args(**kw: object) -> argparse.Namespace:
    return bench.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_the_plan_evaluates_base_and_sft_once_and_rl_per_seed(tmp_path: Path) -> None:
    assert _harness.plan([0, 1], tmp_path) == [
        ("base", tmp_path / "seed0"),
        ("sft", tmp_path / "seed0"),
        ("rl-s0", tmp_path / "seed0"),
        ("rl-s1", tmp_path / "seed1"),
    ]


def test_demos_skip_their_own_evaluations_and_later_seeds_reuse_the_first_sft(tmp_path: Path) -> None:
    args = _args(limit=5)
    first = _harness.seed_demo_command("gsm8k", 0, tmp_path / "seed0", args.set, args.data_dir)
    later = _harness.seed_demo_command(
        "gsm8k", 1, tmp_path / "seed1", args.set, args.data_dir, tmp_path / "seed0"
    )
    assert "--reuse-sft" not in first and later[later.index("--reuse-sft") + 1] == str(tmp_path / "seed0")
    for cmd in (first, later):
        sets = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]
        assert {"pipeline.eval_modes=[]", "pipeline.base_eval_problems=0"} <= set(sets)
    settings = recipe_settings("gsm8k", list(_harness.DEMO_FIELDS))
    assert settings.eval_modes == () and settings.base_eval_problems == 0


def _finished_sft_run(folder: Path, settings: DemoSettings) -> None:
    (folder / "model_sft").mkdir(parents=True)
    (folder / "model_sft" / "config.json").write_text("{}")
    (folder / "settings.json").write_text(json.dumps(settings.as_dict()))


def test_reuse_sft_across_seeds_only_without_a_slice_evaluation(tmp_path: Path) -> None:
    quiet = recipe_settings("gsm8k", list(_harness.DEMO_FIELDS))
    _finished_sft_run(tmp_path / "seed0", quiet.with_seed(0))
    seed1 = quiet.with_seed(1)
    seed1 = DemoSettings(**{**vars(seed1), "reuse_sft": str(tmp_path / "seed0"), "out": str(tmp_path / "s1")})
    model, evals = _reuse_sft(seed1, tmp_path / "s1", DemoResult(out=tmp_path / "s1"))
    assert model == tmp_path / "seed0" / "model_sft" and evals == {"sft": {}}
    # With a slice evaluation to copy, its seed (the slice) must match.
    loud = recipe_settings("gsm8k", ["pipeline.base_eval_problems=0"])
    _finished_sft_run(tmp_path / "loud0", loud.with_seed(0))
    loud1 = DemoSettings(**{**vars(loud.with_seed(1)), "reuse_sft": str(tmp_path / "loud0")})
    with pytest.raises(ValueError, match="differ in seed"):
        _reuse_sft(loud1, tmp_path / "l1", DemoResult(out=tmp_path / "l1"))


def _records(correct: list[bool], calls: int) -> list[dict[str, object]]:
    return [
        {
            "id": f"gsm8k-{i}",
            "candidates": [
                {"correct": c, "valid_format": True, "code_calls": calls, "completion_tokens": 10}
            ],
        }
        for i, c in enumerate(correct)
    ]


def test_results_are_kept_per_model_and_a_kept_model_is_not_evaluated_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_mode = {"text-only": _records([True, False], 0), "retool": _records([True, True], 1)}
    _harness.keep_results(tmp_path, "rl-s1", by_mode)  # type: ignore[arg-type]
    kept = json.loads(_harness.results_path(tmp_path, "rl-s1").read_text())
    assert kept["modes"]["retool"]["accuracy"] == 1.0 and kept["modes"]["text-only"]["call_rate"] == 0.0

    def no_process(*a: object, **k: object) -> None:
        raise AssertionError("a kept model was evaluated again")

    monkeypatch.setattr(subprocess, "run", no_process)
    outputs = {m: _harness.eval_output(tmp_path, "rl-s1", m) for m in bench.MODES}
    bench.eval_process("rl-s1", outputs, tmp_path, _args())


def test_the_report_compares_each_seed_with_the_shared_sft_model() -> None:
    evals = {
        "base": {"text-only": _records([False] * 4, 0), "retool": _records([False] * 4, 0)},
        "sft": {
            "text-only": _records([True, False, False, False], 0),
            "retool": _records([True] * 2 + [False] * 2, 1),
        },
        "rl-s0": {
            "text-only": _records([True] * 2 + [False] * 2, 0),
            "retool": _records([True] * 3 + [False], 1),
        },
        "rl-s1": {"text-only": _records([True] * 4, 0), "retool": _records([True] * 4, 1)},
    }
    text = bench.report(evals, {f"gsm8k-{i}": i + 1 for i in range(4)}, "")  # type: ignore[arg-type]
    assert "| rl-s0 - sft (retool) |" in text and "| rl-s1 - sft (text-only) |" in text
    assert "| sft - base (retool) |" in text
    demos = {0: {"timings": {"total": 60.0}, "machine": {}}, 1: {"timings": {"total": 30.0}, "machine": {}}}
    summary = bench.summary_table(evals, demos, {}, [0, 1])  # type: ignore[arg-type]
    assert "seed 0: +25.0" in summary and "seed 1: +50.0" in summary


def test_the_eval_clock_keeps_an_interrupted_pass_and_adds_a_resumed_one(tmp_path: Path) -> None:
    facts_file = tmp_path / "sft.run.json"
    output = tmp_path / "sft_retool.jsonl"
    output.write_text('{"id": "a"}\n')  # an answer from before any clock: not timed
    clock = _harness.EvalClock(facts_file, [output], every=0.01)
    with clock:
        output.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n')
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and json.loads(facts_file.read_text() or "{}").get("timed_answers") != 2
        ):
            time.sleep(0.01)  # the clock rewrites the file while the pass runs: a kill here keeps it
    first = json.loads(facts_file.read_text())
    assert first["timed_answers"] == 2 and first["seconds"] >= 0 and first["peak_rss_gib"] > 0
    with _harness.EvalClock(facts_file, [output, tmp_path / "sft_text-only.jsonl"], every=60):
        (tmp_path / "sft_text-only.jsonl").write_text('{"id": "a"}\n')
        time.sleep(0.05)
    resumed = json.loads(facts_file.read_text())
    assert resumed["timed_answers"] == 3 and resumed["seconds"] >= first["seconds"] + 0.05
    assert not list(tmp_path.glob("*.tmp"))


def test_a_model_evaluation_writes_both_modes_and_times_every_answer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``--eval-one``'s work on a real (tiny) model: both modes' records, and a clock over all of them."""
    from retool.config import load_config
    from retool.data.problem import Problem

    config = load_config(
        None,
        [
            f'model.name="{tiny_model_dir}"',
            "lora.enabled=false",
            "backend.device='cpu'",
            "rollout.max_tokens_per_turn=8",
            "sandbox.workers=1",
            f'train.run_dir="{tmp_path / "scratch"}"',
        ],
    )
    problems = [Problem(id=f"t{i}", question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(3)]
    _harness.evaluate_model("rl-s0", list(bench.MODES), tmp_path, config, problems, "toy")
    for mode in bench.MODES:
        assert len(_harness.eval_output(tmp_path, "rl-s0", mode).read_text().splitlines()) == 3
    facts = _harness.eval_runs(tmp_path)["rl-s0"]
    assert facts["timed_answers"] == 6 and facts["seconds"] > 0


def test_a_clock_file_from_before_the_count_never_gains_one(tmp_path: Path) -> None:
    facts_file = tmp_path / "base.run.json"
    facts_file.write_text('{"seconds": 100.0, "peak_rss_gib": 9.0}\n')  # an older harness: no count
    with _harness.EvalClock(facts_file, [tmp_path / "base_retool.jsonl"], every=60):
        (tmp_path / "base_retool.jsonl").write_text('{"id": "a"}\n')
    facts = json.loads(facts_file.read_text())
    assert "timed_answers" not in facts and facts["seconds"] >= 100.0 and facts["peak_rss_gib"] == 9.0


def test_the_summary_says_what_time_was_not_counted_and_gives_no_verdict_it_cannot_back() -> None:
    evals = {
        label: {"text-only": _records([False] * 4, 0), "retool": _records([True] * 4, 1)}
        for label in ("base", "sft", "rl-s0")
    }
    demos = {0: {"timings": {"total": 600.0}, "machine": {}}}
    runs = {
        "base": {"seconds": 60.0, "peak_rss_gib": 1.0},
        "sft": {"seconds": 60.0, "peak_rss_gib": 1.0, "timed_answers": 5},
        "rl-s0": {"seconds": 60.0, "peak_rss_gib": 1.0, "timed_answers": 8},
    }
    summary = bench.summary_table(evals, demos, runs, [0])  # type: ignore[arg-type]
    assert "base kept only the time of the pass that finished it" in summary
    assert "sft: 5 of its 8 answers timed" in summary and "rl-s0:" not in summary
    assert "at least 0.2 h, no verdict" in summary  # 13 min counted, under 150: not "within"
    complete = {k: {**v, "timed_answers": 8} for k, v in runs.items()}
    assert "0.2 h, within its 2.5-hour target" in bench.summary_table(evals, demos, complete, [0])  # type: ignore[arg-type]
    long_demo = {0: {"timings": {"total": 9600.0}, "machine": {}}}
    assert "at least 2.7 h, over its" in bench.summary_table(evals, long_demo, runs, [0])  # type: ignore[arg-type]


def test_the_engine_stops_at_the_first_closed_boxed_answer(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from retool.backends.engine.generation import GenRequest, _Row, closes_boxed
    from retool.backends.interface.types import SamplingParams

    assert closes_boxed("so \\boxed{\\frac{1}{2}}") and not closes_boxed("so \\boxed{\\frac{1}{2}")
    assert not closes_boxed("no answer {}") and closes_boxed("\\boxed{ \\boxed{3} ")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The total is 3 + 4 = 7, so \\boxed{7} and then it rambles on"
    ids = tok.encode(text, add_special_tokens=False)
    for flag in (True, False):
        params = SamplingParams(max_tokens=len(ids), stop_at_boxed=flag)
        row = _Row.start(None, 0, GenRequest([1], params, 0), set(), 10_000)  # type: ignore[arg-type]
        reasons = [row.record(t, -1.0, tok) for t in ids]
        end = next(i for i, r in enumerate(reasons) if r is not None)
        if flag:
            assert reasons[end] == "stop" and tok.decode(ids[: end + 1]).endswith("\\boxed{7}")
        else:
            assert reasons[end] == "length" and end == len(ids) - 1


def test_demos_without_evaluations_run_and_a_second_seed_reuses_the_first_sft(tmp_path: Path) -> None:
    """The bench's demo shape on the tiny model: no slice evaluation, then a second seed's RL from the
    first seed's SFT model (the pipeline end to end, shrunk)."""
    from retool.recipes.demo import run_demo

    sets = [
        "data.options.count=40",
        "data.options.test_count=8",
        "sft.steps=3",
        "sft.batch_size=4",
        "train.steps=1",
        "rollout.questions_per_step=2",
        "rollout.group_size=2",
        "filters.max_extra_rounds=0",
        "pipeline.eval_modes=[]",
    ]
    first = DemoSettings.load(sets, out=str(tmp_path / "seed0"), size="test", plots=False).with_seed(0)
    run_demo(first)
    report = json.loads((tmp_path / "seed0" / "report.json").read_text())
    assert report["gain"] == {} and not (tmp_path / "seed0" / "eval" / "sft_retool.jsonl").exists()
    second = DemoSettings.load(
        sets, out=str(tmp_path / "seed1"), size="test", plots=False, reuse_sft=str(tmp_path / "seed0")
    ).with_seed(1)
    run_demo(second)
    rl = json.loads((tmp_path / "seed1" / "report.json").read_text())
    assert rl["settings"]["reuse_sft"] == str(tmp_path / "seed0") and rl["settings"]["seed"] == 1
    assert (tmp_path / "seed1" / "model_rl" / "config.json").is_file()
    assert not (tmp_path / "seed1" / "model_sft").exists()  # RL started from seed 0's SFT model
