"""bench/mathematics_rl.py: how it judges a run from its metrics (the sweep's choice, collapse, "still
rising"), and (slow) a few-step slice of every phase on SmolLM2 over fixture rows of the official generator:
cold start, sweep, RL with its learning curve, expert iteration to RL's trajectory count, final evaluation,
report."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import mathematics_rl as bench


def _step(
    correct: float, calls: float = 0.9, void: float = 0.0, informative: float = 0.5
) -> dict[str, float]:
    return {
        "task/correct_rate": correct,
        "tool/code_share": calls,
        "task/void_turn_rate": void,
        "sampling/informative_share": informative,
    }


def test_a_run_is_judged_by_its_late_accuracy_and_any_collapse() -> None:
    steady = [_step(0.1), _step(0.2), _step(0.3), _step(0.5)]
    summary = bench.run_summary(steady)
    assert summary["late_accuracy"] == pytest.approx(0.4) and not summary["collapsed"]
    assert summary["informative_share"] == pytest.approx(0.5) and summary["steps"] == 4
    # the tool-call rate more than 10 points under the first step's, or void turns at 10%: a collapse
    assert bench.run_summary([_step(0.1, calls=0.9), _step(0.4, calls=0.79)])["collapsed"]
    assert not bench.run_summary([_step(0.1, calls=0.9), _step(0.4, calls=0.81)])["collapsed"]
    assert bench.run_summary([_step(0.1), _step(0.4, void=0.1)])["collapsed"]
    assert bench.run_summary([])["collapsed"]


def test_training_goes_on_only_while_the_last_twenty_steps_beat_the_twenty_before() -> None:
    flat = [_step(0.2)] * 40
    rising = [_step(0.2)] * 20 + [_step(0.25)] * 20
    assert not bench.still_rising(flat) and bench.still_rising(rising)
    assert not bench.still_rising(rising[:39])  # too few steps to judge


def test_a_seed_goes_on_until_its_informative_groups_then_while_accuracy_rises() -> None:
    args = bench.parse_args(["--steps", "80", "--min-informative", "600", "--max-steps", "160"])
    few = [{**_step(0.3), "sampling/groups_informative": 4.0}] * 80  # 320 informative groups
    assert bench.informative_groups(few) == 320
    assert bench.next_target(args, 80, few) == 90  # one chunk more: not yet long enough to judge
    enough = [{**_step(0.3), "sampling/groups_informative": 5.0}] * 120  # 600, flat
    assert bench.next_target(args, 120, enough) == 120  # finished
    rising = [{**m, "task/correct_rate": 0.4} if i >= 100 else m for i, m in enumerate(enough)]
    assert bench.next_target(args, 120, rising) == 140  # two chunks more while it rises
    assert bench.next_target(args, 160, few) == 160 and bench.next_target(args, 155, few) == 160


def _write(path: Path, text: str = "{}") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_finished_rounds_and_a_chosen_sweep_are_carried_to_another_machine_weights_never(
    tmp_path: Path,
) -> None:
    run, carry = tmp_path / "run", tmp_path / "carry"
    _write(run / "sft/coldstart/round-0/report.json")
    _write(run / "sft/coldstart/round-0/kept.jsonl", "{}\n")
    _write(run / "sft/coldstart/round-0/state/adapter.safetensors", "weights")
    _write(run / "sft/coldstart/round-1/samples.jsonl", "{}\n")  # a round still sampling: no report
    _write(run / "sft/phase.json")  # says model_sft exists: never carried
    _write(run / "curve-start/step0000_retool.jsonl", "{}\n")
    _write(run / "sweep/lr1e-4/metrics.jsonl", "{}\n")
    args = bench.parse_args(["--out", str(run), "--carry", str(carry)])
    bench.carry_out(args)
    kept = {str(p.relative_to(carry)) for p in carry.rglob("*") if p.is_file()}
    assert kept == {
        "sft/coldstart/round-0/report.json",
        "sft/coldstart/round-0/kept.jsonl",
        "curve-start/step0000_retool.jsonl",
    }
    _write(run / "sweep/lr5e-5/metrics.jsonl", "{}\n" * 3)  # trained to its end: its model written last
    _write(run / "sweep/lr5e-5/model_latest/step.json", '{"step": 3}')
    _write(run / "sweep/curve/lr5e-5_retool.jsonl", "{}\n")
    _write(run / "sweep/curve/lr5e-5_retool.summary.json", '{"status": "complete"}')
    bench.carry_out(args)
    assert (carry / "sweep/lr5e-5/metrics.jsonl").is_file() and (carry / "sweep/curve").is_dir()
    assert not (carry / "sweep/lr5e-5/model_latest").exists()  # weights and the marker of them stay
    assert not (carry / "sweep/lr1e-4/metrics.jsonl").exists()  # still training: its metrics stay
    _write(run / "sweep/choice.json", '{"lr": "1e-4"}')  # the sweep is whole: its metrics go too
    bench.carry_out(args)
    assert (carry / "sweep/choice.json").is_file() and (carry / "sweep/lr1e-4/metrics.jsonl").is_file()

    fresh = tmp_path / "fresh"  # another machine: an empty run folder
    bench.carry_in(bench.parse_args(["--out", str(fresh), "--carry", str(carry)]))
    assert (fresh / "sft/coldstart/round-0/kept.jsonl").read_text() == "{}\n"
    assert (fresh / "sweep/choice.json").is_file() and not (fresh / "sft/phase.json").exists()
    assert not (fresh / "sft/coldstart/round-0/state").exists()
    # on the other machine the finished sweep run is not trained again: its metrics and evaluation came
    curve = fresh / "sweep/curve"
    assert bench.carried_run(fresh / "sweep/lr5e-5", 3, curve, "lr5e-5")
    assert not bench.carried_run(fresh / "sweep/lr1e-4", 3, curve, "lr1e-4")  # its metrics: not 3 steps


def test_a_round_stopped_midway_carries_its_finished_chunks_until_it_finishes(tmp_path: Path) -> None:
    run, carry = tmp_path / "run", tmp_path / "carry"
    round_4 = run / "ei/coldstart/round-4"
    for name in ("progress.json", "kept.jsonl", "samples.jsonl"):
        _write(round_4 / name)
    _write(round_4 / "kept.partial", "{}\n")  # being rewritten: never carried
    args = bench.parse_args(["--out", str(run), "--carry", str(carry)])
    bench.carry_out(args)
    names = {p.name for p in (carry / "ei/coldstart/round-4").iterdir()}
    assert names == {"progress.json", "kept.jsonl", "samples.jsonl"}
    fresh = tmp_path / "fresh"
    bench.carry_in(bench.parse_args(["--out", str(fresh), "--carry", str(carry)]))
    assert (fresh / "ei/coldstart/round-4/progress.json").is_file()

    (round_4 / "progress.json").unlink()  # the round finished: its report written, its progress gone
    _write(round_4 / "report.json")
    bench.carry_out(args)
    assert (carry / "ei/coldstart/round-4/report.json").is_file()
    assert not (carry / "ei/coldstart/round-4/progress.json").exists()


def test_each_ablation_changes_one_stability_setting_of_the_seeds(tmp_path: Path) -> None:
    args = bench.parse_args(["--out", str(tmp_path)])
    loaded = {}
    for name, changed in bench.ABLATIONS.items():
        config = bench.settings(args, tmp_path, [*bench.RL_SETS, *changed]).config
        loaded[name] = (config.filters.void_turn, config.filters.overlong, config.loss.ref_kl_coef)
    assert loaded == {
        "as-seeds": (True, True, 0.0),
        "void-scored": (False, False, 0.0),
        "kl-1e-3": (True, True, 1e-3),
    }
    assert bench.ablation_runs(args) == list(bench.ABLATIONS)
    assert bench.ablation_runs(bench.parse_args(["--ablation-steps", "0"])) == []
    with pytest.raises(SystemExit):
        bench.parse_args(["--ablations", "as-seeds,no-such-run"])


def test_a_finished_ablation_run_is_carried_and_not_trained_again_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, carry = tmp_path / "run", tmp_path / "carry"
    args = bench.parse_args(["--out", str(run), "--carry", str(carry), "--ablation-steps", "2"])
    _write(run / "ablation/as-seeds/metrics.jsonl", "{}\n" * 2)  # trained to its end and evaluated
    _write(run / "ablation/as-seeds/model_latest/step.json", '{"step": 2}')
    _write(run / "ablation/as-seeds/model_latest/model.safetensors", "weights")
    _write(run / "ablation/curve/as-seeds_retool.jsonl", "{}\n")
    _write(run / "ablation/curve/as-seeds_retool.summary.json", '{"status": "complete"}')
    _write(run / "ablation/void-scored/metrics.jsonl", "{}\n" * 2)  # trained; its evaluation stopped
    _write(run / "ablation/curve/void-scored_retool.summary.json", '{"status": "incomplete"}')
    _write(run / "ablation/kl-1e-3/metrics.jsonl", "{}\n")  # still training
    bench.carry_out(args)
    kept = {str(p.relative_to(carry)) for p in carry.glob("ablation/*/metrics.jsonl")}
    assert kept == {"ablation/as-seeds/metrics.jsonl"}  # the others are not finished: their metrics stay
    assert not (carry / "ablation/as-seeds/model_latest").exists()

    fresh = tmp_path / "fresh"
    fresh_args = bench.parse_args(["--out", str(fresh), "--carry", str(carry), "--ablation-steps", "2"])
    bench.carry_in(fresh_args)
    trained: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(
        bench, "train_to", lambda a, r, until, s, lr, sel, changed=(): trained.append((r.name, changed))
    )
    monkeypatch.setattr(bench, "evaluate", lambda *a: None)
    bench.ablation(fresh_args, "2e-4")
    assert trained == [(name, bench.ABLATIONS[name]) for name in bench.ABLATIONS if name != "as-seeds"]


def _checkpoint(run: Path, step: int) -> None:
    folder = run / f"checkpoints/step_{step:06d}"
    _write(folder / "backend/adapter_model.safetensors", f"weights {step}")
    _write(folder / "rng.pt", "rng")
    _write(folder / "trainer_state.json", json.dumps({"step": step}))  # written last: says it is complete


def test_an_rl_seed_carries_its_checkpoint_at_each_curve_point_and_resumes_there_elsewhere(
    tmp_path: Path,
) -> None:
    run, carry = tmp_path / "run", tmp_path / "carry"
    args = bench.parse_args(["--out", str(run), "--carry", str(carry)])
    seed = run / "rl-s0"
    _write(seed / "config.toml", "[train]\n")
    _write(seed / "metrics.jsonl", "{}\n" * 5)
    _checkpoint(seed, 5)  # mid-chunk, before the first curve point: nothing of the seed goes yet
    bench.carry_out(args)
    assert not (carry / "rl-s0").exists()
    _checkpoint(seed, 10)
    _write(seed / "model_latest/step.json", '{"step": 10}')
    _write(seed / "model_latest/model.safetensors", "merged")
    _write(seed / "curve/step0010_retool.summary.json", '{"status": "complete"}')
    bench.carry_out(args)
    kept = {str(p.relative_to(carry / "rl-s0")) for p in (carry / "rl-s0").rglob("*") if p.is_file()}
    assert kept == {
        "config.toml",
        "metrics.jsonl",
        "curve/step0010_retool.summary.json",
        "checkpoints/step_000010/backend/adapter_model.safetensors",
        "checkpoints/step_000010/rng.pt",
        "checkpoints/step_000010/trainer_state.json",
    }
    # the next chunk: its checkpoints replace step 10 in the run, the carry keeps step 10 until step 20
    for step in (5, 10):
        shutil.rmtree(seed / f"checkpoints/step_{step:06d}")
    _checkpoint(seed, 15)
    bench.carry_out(args)
    assert (carry / "rl-s0/checkpoints/step_000010/trainer_state.json").is_file()
    assert not (carry / "rl-s0/checkpoints/step_000015").exists()
    _checkpoint(seed, 20)
    _write(seed / "model_latest/step.json", '{"step": 20}')
    _write(seed / "curve/step0020_retool.summary.json", '{"status": "complete"}')
    bench.carry_out(args)
    assert sorted(p.name for p in (carry / "rl-s0/checkpoints").iterdir()) == ["step_000020"]

    fresh = tmp_path / "fresh"  # another machine: the seed resumes from step 20, both curve points kept
    bench.carry_in(bench.parse_args(["--out", str(fresh), "--carry", str(carry)]))
    moved = fresh / "rl-s0"
    assert bench.trained_step(moved) == 20 and not (moved / "model_latest").exists()
    assert bench.curve_point_done(moved, 10) and bench.curve_point_done(moved, 20)
    assert not bench.curve_point_done(moved, 30)


def test_a_finished_seed_carries_its_marker_and_metrics_and_no_checkpoint(tmp_path: Path) -> None:
    run, carry = tmp_path / "run", tmp_path / "carry"
    args = bench.parse_args(["--out", str(run), "--carry", str(carry)])
    seed = run / "rl-s0"
    _write(seed / "config.toml", "[train]\n")
    _write(seed / "metrics.jsonl", "{}\n" * 20)
    _checkpoint(seed, 20)
    _write(seed / "model_latest/step.json", '{"step": 20}')
    _write(seed / "curve/step0020_retool.summary.json", '{"status": "complete"}')
    bench.carry_out(args)
    assert (carry / "rl-s0/checkpoints/step_000020").is_dir()
    _write(seed / "done.json", '{"step": 20}')  # its final evaluation complete
    bench.carry_out(args)
    kept = {str(p.relative_to(carry / "rl-s0")) for p in (carry / "rl-s0").rglob("*") if p.is_file()}
    assert kept == {"config.toml", "metrics.jsonl", "done.json", "curve/step0020_retool.summary.json"}
    fresh = tmp_path / "fresh"  # another machine: the seed is not trained again
    fresh_args = bench.parse_args(["--out", str(fresh), "--carry", str(carry)])
    bench.carry_in(fresh_args)
    assert bench.rl_seed(fresh_args, 0, "2e-4") == fresh / "rl-s0"
    assert not (fresh / "rl-s0/model_latest").exists()


def test_a_few_step_slice_of_the_bench_on_smollm2(
    tmp_path: Path, smollm2_file: Path, mathematics_slice: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "bench"
    bench.main(["--smoke", "--out", str(out), "--data-dir", str(mathematics_slice)])

    assert (out / "sft" / "model_sft" / "config.json").is_file()
    choice = json.loads((out / "sweep" / "choice.json").read_text())
    assert choice["lr"] == "1e-4" and (out / "sweep" / "epoch" / "metrics.jsonl").is_file()
    for seed in (0,):  # the slice runs one seed
        metrics = [json.loads(x) for x in (out / f"rl-s{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert all(
            "policy/entropy" in m and "policy/ref_kl" in m and "task/void_turn_rate" in m for m in metrics
        )
        assert sorted(p.name for p in (out / f"rl-s{seed}" / "curve").glob("*_retool.jsonl")) == [
            "step0001_retool.jsonl",
            "step0002_retool.jsonl",
        ]
    ei = json.loads((out / "ei" / "coldstart" / "report.json").read_text())
    rl_sampled = sum(m["task/trajectories"] for m in metrics_of(out / "rl-s0"))
    cold = json.loads((out / "sft" / "coldstart" / "report.json").read_text())
    assert ei["sampled"] <= cold["sampled"] + rl_sampled  # never more than RL's trajectories
    assert not (out / "rl-s1").exists()
    # EI's whole pool trained from the start for the cold start's epochs (its fixed steps over its pool).
    pool = json.loads((out / "ei-pool" / "sft_report.json").read_text())
    assert pool["config"]["epochs"] == pytest.approx(2 * 2 / cold["kept"], abs=1e-4)
    assert pool["traces"]["used"] == ei["kept"]
    assert pool["sft"]["steps"] == max(1, math.ceil(pool["config"]["epochs"] * ei["kept"] / 2))
    for label in ("sft", "rl-s0", "ei", "ei-pool"):
        for mode in ("text-only", "retool"):
            assert (out / "final" / f"{label}_{mode}.jsonl").is_file()
    import tomllib

    saved = {}  # each ablation run the slice takes trained one step with its one setting changed
    for name in ("as-seeds", "void-scored"):
        assert [m["step"] for m in metrics_of(out / "ablation" / name)] == [1]
        cfg = tomllib.loads((out / "ablation" / name / "config.toml").read_text())
        saved[name] = (cfg["filters"]["void_turn"], cfg["filters"]["overlong"], cfg["loss"]["ref_kl_coef"])
    assert saved == {"as-seeds": (True, True, 0.0), "void-scored": (False, False, 0.0)}
    assert not (out / "ablation" / "kl-1e-3").exists()
    text = (out / "mathematics_rl.md").read_text()
    assert "Learning curve" in text and "Targets (issue 50)" in text and "rl-s0 - ei (retool)" in text
    assert "rl-s0 - ei-pool (retool)" in text and "RL over expert iteration (ei-pool)" in text
    assert "| void-scored | `filters.void_turn=false`, `filters.overlong=false` |" in text
    assert text.startswith("Status: every phase finished.")
    assert (out / "mathematics_rl_curve.png").is_file() and (out / "mathematics_rl_instruments.png").is_file()
    assert "![mathematics_rl_curve](mathematics_rl_curve.png)" in text
    short = (out / "mathematics_rl_summary.md").read_text()
    assert "| rl-s0 |" in short and "| ei |" in short and "Targets of issue 50 met:" in short
    assert (out / "rl-s0" / "done.json").is_file()
    # A rerun finds every phase done: it samples and trains nothing more; --write leaves the report, its
    # summary and both curves in the results folder (here a temporary one; no page is refilled).
    import _results

    results = tmp_path / "results"
    monkeypatch.setattr(_results, "RESULTS", results)
    monkeypatch.setattr(_results, "render_pages", lambda: [])
    before = (out / "rl-s0" / "metrics.jsonl").read_text()
    bench.main(["--smoke", "--out", str(out), "--data-dir", str(mathematics_slice), "--write"])
    assert (out / "rl-s0" / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in results.iterdir()) == [
        "mathematics_rl.md",
        "mathematics_rl_curve.png",
        "mathematics_rl_instruments.png",
        "mathematics_rl_summary.md",
    ]
    # --report (a look, nothing run) states expert iteration's budget as the run did.
    said = (out / "mathematics_rl.md").read_text()
    budget = int(cold["sampled"] + rl_sampled)
    assert f"Expert iteration continued to {budget} sampled trajectories" in said
    bench.main(["--smoke", "--out", str(out), "--data-dir", str(mathematics_slice), "--report"])
    assert (out / "mathematics_rl.md").read_text() == said


def metrics_of(run: Path) -> list[dict[str, float]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_final_evaluation_a_sitting_stopped_is_kept_but_not_reported(tmp_path: Path) -> None:
    from _mathematics_rl_report import final_evals

    for label, status in (("sft", "incomplete"), ("rl-s0", "complete")):
        for mode in ("text-only", "retool"):
            _write(tmp_path / f"final/{label}_{mode}.jsonl", "")
            _write(tmp_path / f"final/{label}_{mode}.summary.json", json.dumps({"status": status}))
    assert list(final_evals(tmp_path, ["sft", "rl-s0", "ei"])) == ["rl-s0"]


def test_expert_iterations_rounds_are_reported_while_it_runs(tmp_path: Path) -> None:
    from _mathematics_rl_report import ei_lines

    cold = {"rounds": [{"round": 0}], "kept_by_module": {"a": 2}, "kept": 2}
    _write(tmp_path / "sft/coldstart/report.json", json.dumps(cold))
    _write(tmp_path / "ei/coldstart/report.json", json.dumps(cold))  # copied with the cold start's rounds
    _write(tmp_path / "ei/coldstart/round-0/report.json", json.dumps({"round": 0}))
    assert ei_lines(tmp_path, 0) == ["Expert iteration past the cold start: no round finished yet."]
    round_1 = {"round": 1, "kept": 3, "sampled": 40, "pool": 5, "kept_by_category": {"a": 1, "b": 2}}
    _write(tmp_path / "ei/coldstart/round-1/report.json", json.dumps({**round_1, "sample_seconds": 20.0}))
    (line,) = ei_lines(tmp_path, 0)
    assert "1 round (round 1: 3 kept of 40), a pool of 5 traces over 2 modules" in line
    assert "2.00 trajectories/s" in line


def test_the_machine_time_adds_every_phases_clock_against_the_issues_cap(tmp_path: Path) -> None:
    from _mathematics_rl_report import machine_lines, machine_seconds

    hour = 3600.0
    cold = {"rounds": [{"round": 0, "sample_seconds": hour, "sft_seconds": 0.5 * hour}]}
    _write(tmp_path / "sft/coldstart/report.json", json.dumps(cold))
    # Expert iteration's folder holds the cold start's rounds too: only those past them are its own.
    _write(tmp_path / "ei/coldstart/round-0/report.json", json.dumps(cold["rounds"][0]))
    ei_round = {"round": 1, "sample_seconds": hour, "sft_seconds": 0.0}
    _write(tmp_path / "ei/coldstart/round-1/report.json", json.dumps(ei_round))
    step = json.dumps({"time/step": 0.5 * hour})
    _write(tmp_path / "sweep/lr1e-4/metrics.jsonl", step + "\n")
    _write(tmp_path / "rl-s0/metrics.jsonl", step + "\n" + step + "\n")
    _write(tmp_path / "ablation/as-seeds/metrics.jsonl", step + "\n")
    _write(tmp_path / "rl-s0/curve/step0010.run.json", json.dumps({"seconds": hour}))
    _write(tmp_path / "final/sft.run.json", json.dumps({"seconds": hour}))
    parts = machine_seconds(tmp_path)
    assert parts == {
        "cold start": 1.5 * hour,
        "sweep": 0.5 * hour,
        "RL seeds": hour,
        "expert iteration": hour,
        "ablation": 0.5 * hour,
        "evaluations": 2 * hour,
    }
    (line,) = machine_lines(tmp_path)
    assert "6.5 h" in line and "**within**" in line
    _write(tmp_path / "rl-s1/metrics.jsonl", step + "\n" + step + "\n")
    assert "7.5 h" in machine_lines(tmp_path)[0]
    _write(tmp_path / "final/ei.run.json", json.dumps({"seconds": hour}))
    assert "8.5 h" in machine_lines(tmp_path)[0] and "**over**" in machine_lines(tmp_path)[0]


def _records(correct: dict[str, list[bool]]) -> list[dict[str, object]]:
    """Held-out records, one candidate a question, ``correct`` by split."""
    return [
        {"id": f"mathematics-{split}-algebra__linear-{i}", "candidates": [{"correct": ok}]}
        for split, oks in correct.items()
        for i, ok in enumerate(oks)
    ]


def test_an_ablation_names_a_direction_only_where_its_interval_leaves_out_zero() -> None:
    from _mathematics_rl_report import ablation_effect

    base = _records({"interpolate": [False] * 40, "extrapolate": [False] * 40})
    lifted = _records({"interpolate": [True] * 30 + [False] * 10, "extrapolate": [True] + [False] * 39})
    assert ablation_effect(base, lifted) == "raised interpolate"
    assert ablation_effect(lifted, base) == "lowered interpolate"
    assert ablation_effect(base, base) == "not shown to matter (both intervals hold 0)"


def test_the_sweep_says_why_every_rate_reads_collapsed(tmp_path: Path) -> None:
    from _mathematics_rl_report import sweep_lines

    row = {"steps": 2, "held_out": 0.1, "late_accuracy": 0.1, "informative_share": 0.3, "collapsed": True}
    choice = {"lr": "2e-4", "runs": {"1e-4": row, "2e-4": row}}
    _write(tmp_path / "sweep/choice.json", json.dumps(choice))
    for lr in choice["runs"]:
        metrics = [json.dumps(_step(0.1, void=0.12)), json.dumps(_step(0.1, void=0.05))]
        _write(tmp_path / f"sweep/lr{lr}/metrics.jsonl", "\n".join(metrics) + "\n")
    text = "\n".join(sweep_lines(tmp_path))
    assert "already had 12.0% void turns, so none was ruled out" in text
    choice["runs"]["1e-4"] = {**row, "collapsed": False}
    _write(tmp_path / "sweep/choice.json", json.dumps(choice))
    assert "none was ruled out" not in "\n".join(sweep_lines(tmp_path))


def test_the_instruments_trend_is_each_steps_mean_with_the_steps_before_it() -> None:
    from _mathematics_rl_report import trailing_mean

    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([], 10) == []
