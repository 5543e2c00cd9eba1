"""Benchmark: does RL, not SFT, carry the demo's result, on every seed? And what do its options change?

For each seed the whole ``retool demo`` pipeline runs with its defaults (cold-start SFT, SFT evaluation,
RL, RL evaluation). Each ablation then reruns only RL and its evaluation from the same SFT model with
other settings (``DemoSettings.reuse_sft``), so the RL runs of a seed differ in those settings alone.
Everything is evaluated on the same held-out problems with the same sampling settings.

    python bench/learning.py                       # seeds 0..4 with the ablation (about an hour on 2 cores)
    python bench/learning.py --seeds 0,1 --no-ablation
    python bench/learning.py --set train.steps=80  # any config key of the demo preset, or a demo field
    python bench/learning.py --ablation rollout.text_only_share=0.25 --ablation filters.dynamic_sampling=false
    python bench/learning.py --ablation filters.roc=true   # Resample-on-Correct (GRPO-RoC)

Prints the default arm's table (seed, SFT and RL Average@N, the paired gain with its 95% bootstrap
interval, hard-problem accuracy, tool use, text-only accuracy, degenerate-group rate, time split), the
targets it meets, and one comparison table per ablation (``--ablation KEY=VALUE[,KEY=VALUE]``, repeatable:
RL redone from the same SFT model with those overrides; default: dynamic sampling flipped; each shows the
tool-error rate among correct answers of the RL evaluation and its response length, the quantities
Resample-on-Correct aims at). Finished seeds
are read back from their ``report.json``: rerun the same command to resume an interrupted bench.
Results also go to ``OUT/learning.json`` and ``OUT/learning.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _harness import ci_cell, pct, pts  # bench/, on sys.path when run as a script
from _machine import machine
from _results import render_pages, write_result
from retool.config import ConfigError
from retool.evaluate.store import read_problem_records
from retool.pipeline.settings import DemoSettings
from retool.recipes import recipe_named
from retool.recipes.demo import recipe_fields, run_demo

# The targets for the demo, checked per seed.
TARGET_GAIN = 0.15
TARGET_HARD_GAIN = 0.25
TARGET_TOTAL_SECONDS = 240.0  # issue 31: under 4 minutes on 2 cores
TARGET_RL_SHARE = 0.40


def settings_from(args: argparse.Namespace) -> DemoSettings:
    """The demo preset with ``--set`` overrides: ``section.key=value``, a demo-only field
    (``pipeline.NAME=value``) or an option of the tiny recipe (``recipe.NAME=value``)."""
    try:
        return DemoSettings.load(args.set, plots=False, **recipe_fields(recipe_named("tiny")))
    except ConfigError as exc:
        raise SystemExit(f"--set: {exc}") from None


def run_arm(settings: DemoSettings, out: Path, log: logging.Logger) -> dict[str, Any]:
    """One demo run (or its saved report when it already finished); returns the bench's row."""
    report_path = out / "report.json"
    if not report_path.is_file():
        if out.exists():  # an interrupted run: start it again from scratch
            import shutil

            shutil.rmtree(out)
        log.info("running %s", out)
        run_demo(replace(settings, out=str(out)))
    report = json.loads(report_path.read_text())
    return row_of(report, out)


def answer_quality(eval_path: Path) -> dict[str, float | None]:
    """Of an evaluation's candidates: the share of correct ones that hit a tool error on the way (a failed
    or timed-out execution, or a dead executor) and the mean response length (sampled tokens)."""
    if not eval_path.is_file():
        return {"tool_error_correct": None, "response_length": None}
    cands = [c for r in read_problem_records(eval_path) for c in r["candidates"]]
    correct = [c for c in cands if c.get("correct")]
    erred = [
        c
        for c in correct
        if int(c.get("exec_errors", 0)) + int(c.get("exec_timeouts", 0)) > 0
        or c.get("stop_reason") == "executor_error"
    ]
    tokens = [int(c.get("completion_tokens", 0)) for c in cands]
    return {
        "tool_error_correct": len(erred) / len(correct) if correct else None,
        "response_length": statistics.fmean(tokens) if tokens else None,
    }


def row_of(report: dict[str, Any], out: Path) -> dict[str, Any]:
    evals, gain, t = report["evals"], report["gain"], report["timings"]
    metrics = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    degenerate = statistics.fmean(m["task/degenerate_group_rate"] for m in metrics) if metrics else 0.0
    sampled = sum(m.get("sampling/groups_sampled", 0.0) for m in metrics)
    return {
        "seed": report["settings"]["seed"],
        "sft": evals["sft"]["retool"]["average_at_n"],
        "rl": evals["rl"]["retool"]["average_at_n"],
        "gain": gain["average_at_n"]["gain"],
        "ci95": gain["average_at_n"]["ci95"],
        "problems": gain["average_at_n"]["problems"],
        "sft_hard": evals["sft"]["retool"]["hard_accuracy"],
        "rl_hard": evals["rl"]["retool"]["hard_accuracy"],
        "hard_gain": gain.get("hard_accuracy", {}).get("gain", 0.0),
        "sft_hard_tool": evals["sft"]["retool"]["hard_tool_call_rate"],
        "rl_hard_tool": evals["rl"]["retool"]["hard_tool_call_rate"],
        "rl_text_only": evals["rl"].get("text-only", {}).get("average_at_n"),
        "sft_text_only": evals["sft"].get("text-only", {}).get("average_at_n"),
        "rl_easy_tool": evals["rl"]["retool"]["easy_tool_call_rate"],
        "sft_easy_tool": evals["sft"]["retool"]["easy_tool_call_rate"],
        "degenerate_rate": degenerate,
        "groups_sampled": sampled,
        "timings": t,
        **{f"rl_{k}": v for k, v in answer_quality(out / "eval" / "rl_retool.jsonl").items()},
    }


def num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def arm_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| seed | SFT Avg@N | RL Avg@N | gain [95% CI] | hard SFT -> RL | tool on hard | tool on easy "
        "| text-only SFT -> RL | degenerate groups | SFT s | RL s | total s | RL share |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["timings"]
        lo, hi = r["ci95"]
        lines.append(
            f"| {r['seed']} | {pct(r['sft'])} | {pct(r['rl'])} | {ci_cell(r['gain'], lo, hi)} "
            f"| {pct(r['sft_hard'])} -> {pct(r['rl_hard'])} | {pct(r['sft_hard_tool'])} -> {pct(r['rl_hard_tool'])} "
            f"| {pct(r['sft_easy_tool'])} -> {pct(r['rl_easy_tool'])} "
            f"| {pct(r['sft_text_only'])} -> {pct(r['rl_text_only'])} | {pct(r['degenerate_rate'])} "
            f"| {t.get('sft', 0.0):.0f} | {t['rl']:.0f} | {t['total']:.0f} | {pct(t.get('rl_share'))} |"
        )
    gains = [r["gain"] for r in rows]
    if len(gains) > 1:
        lines.append(
            f"\ngain over seeds: mean {pts(statistics.fmean(gains))}, sd {100 * statistics.stdev(gains):.1f}, "
            f"min {pts(min(gains))}, max {pts(max(gains))} points"
        )
    return "\n".join(lines)


def target_check(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    for r in rows:
        t = r["timings"]
        misses = []
        if r["gain"] < TARGET_GAIN:
            misses.append(f"gain {pts(r['gain'])} < {pts(TARGET_GAIN)}")
        if r["ci95"][0] <= 0.0:
            misses.append("CI includes 0")
        if r["hard_gain"] < TARGET_HARD_GAIN:
            misses.append(f"hard gain {pts(r['hard_gain'])} < {pts(TARGET_HARD_GAIN)}")
        if r["problems"] < 200:
            misses.append(f"{r['problems']} problems < 200")
        if "sft" in t and t["total"] >= TARGET_TOTAL_SECONDS:
            misses.append(f"total {t['total']:.0f} s >= {TARGET_TOTAL_SECONDS:.0f} s")
        if "sft" in t and t.get("rl_share", 0.0) < TARGET_RL_SHARE:
            misses.append(f"RL share {pct(t.get('rl_share'))} < {pct(TARGET_RL_SHARE)}")
        notes.append(f"seed {r['seed']}: " + ("all targets met" if not misses else "; ".join(misses)))
    return notes


def arm_slug(overrides: list[str]) -> str:
    """A folder name for an ablation arm: its overrides, filesystem-safe."""
    return "+".join(o.replace("=", "-").replace("/", "_") for o in overrides)


def ablation_table(name: str, base_rows: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """The default arm against one ablation, seed by seed (same SFT model per seed)."""
    lines = [
        "",
        f"## ablation: {name} (RL and its evaluation redone from the same SFT model per seed)",
        "",
        "| seed | gain default | gain ablation | hard default | hard ablation | text-only after RL default "
        "| ablation | tool on easy default | ablation | tool errors in correct after RL default | ablation "
        "| response length after RL default | ablation | groups sampled default | ablation | RL s default "
        "| ablation |",
        "|" + "---|" * 17,
    ]
    for a, b in zip(base_rows, rows, strict=True):
        lines.append(
            f"| {a['seed']} | {pts(a['gain'])} | {pts(b['gain'])} | {pts(a['hard_gain'])} | {pts(b['hard_gain'])} "
            f"| {pct(a['rl_text_only'])} | {pct(b['rl_text_only'])} | {pct(a['rl_easy_tool'])} "
            f"| {pct(b['rl_easy_tool'])} | {pct(a.get('rl_tool_error_correct'))} "
            f"| {pct(b.get('rl_tool_error_correct'))} | {num(a.get('rl_response_length'))} "
            f"| {num(b.get('rl_response_length'))} | {a['groups_sampled']:.0f} | {b['groups_sampled']:.0f} "
            f"| {a['timings']['rl']:.0f} | {b['timings']['rl']:.0f} |"
        )
    mean_a = statistics.fmean(r["gain"] for r in base_rows)
    mean_b = statistics.fmean(r["gain"] for r in rows)
    lines.append(
        f"\nmean gain: default {pts(mean_a)}, ablation {pts(mean_b)} points (difference {pts(mean_b - mean_a)})"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0..4)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-learning"))
    parser.add_argument(
        "--ablation",
        action="append",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="an RL-only arm from each seed's SFT model with these overrides (repeatable; default: "
        "dynamic sampling flipped)",
    )
    parser.add_argument("--no-ablation", action="store_true", help="only the default arm")
    parser.add_argument(
        "--write",
        action="store_true",
        help="also write docs/results/learning.md (and demo.md: seed 0's table) and refill the README's blocks",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override: section.key=value of the demo preset, or a demo field (size, eval_modes, plots)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("bench.learning")
    log.setLevel(logging.INFO)
    base = settings_from(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    flipped = f"filters.dynamic_sampling={'false' if base.config.filters.dynamic_sampling else 'true'}"
    ablations = [] if args.no_ablation else [a.split(",") for a in (args.ablation or [flipped])]
    started = time.perf_counter()
    default_rows: list[dict[str, Any]] = []
    ablation_rows: dict[str, list[dict[str, Any]]] = {",".join(a): [] for a in ablations}
    for seed in seeds:
        settings = base.with_seed(seed)
        folder = args.out / f"seed{seed}"
        default_rows.append(run_arm(settings, folder / "main", log))
        for overrides in ablations:
            try:
                arm = replace(settings, reuse_sft=str(folder / "main")).with_overrides(overrides)
            except ConfigError as exc:
                raise SystemExit(f"--ablation {','.join(overrides)}: {exc}") from None
            ablation_rows[",".join(overrides)].append(run_arm(arm, folder / arm_slug(overrides), log))
        print(f"seed {seed} done ({time.perf_counter() - started:.0f} s so far)", file=sys.stderr, flush=True)

    lines = [
        f"machine: {machine()}",
        f"settings: {json.dumps({k: v for k, v in base.as_dict().items() if k != 'out'})}",
        "",
        "## the demo's defaults",
        "",
        arm_table(default_rows),
        "",
        "## targets",
        *target_check(default_rows),
    ]
    for name, rows in ablation_rows.items():
        lines += ablation_table(name, default_rows, rows)
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.md").write_text(text + "\n")
    result = {"machine": machine(), "default": default_rows, "ablations": ablation_rows}
    (args.out / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        write_docs(lines[1:], args.out, seeds)
    return 0


def write_docs(lines: list[str], out: Path, seeds: list[int]) -> None:
    """docs/results/learning.md (the tables above), docs/results/demo.md (seed 0's table and gain, as the
    demo prints them), then the pages' generated blocks."""
    write_result("learning.md", "The tiny demo over seeds: `bench/learning.py`", "\n".join(lines))
    if 0 in seeds:
        report = (out / "seed0" / "main" / "report.md").read_text()
        table_and_gain = report.split("\n\n| phase |", 1)[0]
        write_result("demo.md", "The tiny demo, seed 0 (`retool demo` defaults)", table_and_gain)
    for page in render_pages():
        print(f"refilled {page}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
