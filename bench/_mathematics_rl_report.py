"""The report of ``bench/mathematics_rl.py``: the cold start, the learning-rate sweep, the informative share
with and without the pass-rate selector, the learning curves (table + PNG), the instruments' curves (PNG),
the cost of a step, the final table with paired bootstrap intervals, and each target met or missed.

Everything is read back from the bench's run folder, so the report can be rewritten at any time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _harness import eval_output, gain_cell, pct, pts
from mathematics import SPLITS, means_table, module_stats, of_split, split_mean
from mathematics_rl import ABLATIONS, VOID_BOUND, ablation_runs, evaluated, run_summary
from retool.evaluate.store import ProblemRecord, read_problem_records, summary_path_for
from retool.jsonl import read_jsonl_objects

INSTRUMENTS = (  # (metrics key, title) drawn per seed
    ("task/correct_rate", "train accuracy"),
    ("policy/entropy", "entropy (nats)"),
    ("policy/ref_kl", "KL to the start (k3)"),
    ("tool/code_share", "tool-call rate"),
    ("task/void_turn_rate", "void-turn rate"),
    ("sampling/informative_share", "informative share"),
)


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return list(read_jsonl_objects(path)) if path.is_file() else []


def _records(folder: Path, label: str, mode: str) -> list[ProblemRecord]:
    path = eval_output(folder, label, mode)
    return read_problem_records(path) if path.is_file() else []


def _split_means(records: list[ProblemRecord]) -> dict[str, float]:
    stats = module_stats(records)
    return {sp: split_mean(stats, sp, "accuracy") for sp in SPLITS}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def coldstart_lines(out: Path) -> list[str]:
    cold = _json(out / "sft" / "coldstart" / "report.json") or {}
    if not cold:
        return ["Cold start: not run yet."]
    rounds = cold.get("rounds", [])
    listed = ", ".join(f"round {r['round']}: {r['kept']} kept of {r['sampled']}" for r in rounds)
    # The rounds' own clocks: a sitting on another machine reads the rounds back and only trains again.
    seconds = sum(float(r.get("sample_seconds", 0.0)) + float(r.get("sft_seconds", 0.0)) for r in rounds)
    return [
        f"Cold start (expert iteration from the base model, then SFT): {cold['kept']} verified tool-using traces"
        f" over {cold.get('modules_kept', '?')} modules, from {cold['sampled']} sampled trajectories ({listed});"
        f" {seconds / 3600:.1f} h of sampling and SFT over its rounds."
    ]


def sweep_lines(out: Path) -> list[str]:
    choice = _json(out / "sweep" / "choice.json")
    if not choice:
        return ["Learning-rate sweep: not run yet."]
    lines = [
        "| learning rate | steps | held-out retool accuracy | train accuracy, last half | informative share | collapsed |",
        "|---|---|---|---|---|---|",
    ]
    for lr, row in choice["runs"].items():
        lines.append(
            f"| {lr} | {row['steps']} | {pct(row['held_out'])} | {pct(row['late_accuracy'])} | {pct(row['informative_share'])} |"
            f" {'yes' if row['collapsed'] else 'no'} |"
        )
    epoch = _metrics(out / "sweep" / "epoch")
    middle = list(choice["runs"])[len(choice["runs"]) // 2]
    share = _mean([float(m.get("sampling/informative_share") or 0.0) for m in epoch])
    chosen = f"Chosen: {choice['lr']}."
    if all(row["collapsed"] for row in choice["runs"].values()):
        # The bound is the issue's, on single steps: the SFT start's own first step can cross it.
        first = [_metrics(out / "sweep" / f"lr{lr}")[:1] for lr in choice["runs"]]
        start_void = max((float(m[0].get("task/void_turn_rate") or 0.0) for m in first if m), default=0.0)
        chosen += (
            " Every rate crossed the collapse bound (void turns at 10% or more on some step, or tool calls 10"
            f" points under the first step's); the first step, sampled before any update, already had {pct(start_void)}"
            " void turns, so none was ruled out and the held-out accuracy chose."
        )
    lines += [
        "",
        f"{chosen} Informative share of sampled groups from the same start and seed at {middle}:"
        f" pass-rate selection {pct(choice['runs'][middle]['informative_share'])}, epoch order {pct(share)}.",
    ]
    return lines


def stability_lines(out: Path, seeds: list[int]) -> list[str]:
    """What each RL seed ran with of issue 50's item 3, read from its config, and what the bench varied."""
    import tomllib

    config = next(
        (out / f"rl-s{s}" / "config.toml" for s in seeds if (out / f"rl-s{s}" / "config.toml").is_file()),
        None,
    )
    if config is None:
        return ["Stability settings: no RL seed started yet."]
    cfg = tomllib.loads(config.read_text())
    filters, loss = cfg.get("filters", {}), cfg.get("loss", {})
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    return [
        f"Stability settings of the RL seeds: void-turn trajectories out of the loss {on(filters.get('void_turn'))},"
        f" truncated ones {on(filters.get('overlong'))}, KL-to-start penalty coefficient"
        f" {loss.get('ref_kl_coef', 0.0)}, learning rate from the sweep above. Which of them mattered: the"
        " learning rate by the sweep; the filters and the penalty by the ablation at the end of this page."
    ]


def ablation_lines(out: Path, steps: int, names: list[str]) -> list[str]:
    """Each ablation run's instruments and held-out accuracy, and its difference from ``as-seeds`` (same
    start, seed, rate and held-out questions: a paired interval)."""
    if not names:
        return ["Ablation: not asked for (--ablation-steps 0)."]
    done = [name for name in names if evaluated(out / "ablation" / "curve", name)]
    if not done:
        return ["Ablation: not run yet (it runs last)."]
    base = _records(out / "ablation" / "curve", "as-seeds", "retool") if "as-seeds" in done else []
    lines = [
        f"Ablation of the stability settings: {steps} RL step{'s' if steps != 1 else ''} a run from the SFT"
        " start, seed 0, the chosen rate,"
        " one setting changed a run; held-out retool accuracy on the curve's slice (greedy), the run's"
        " instruments over its steps, and its held-out difference from `as-seeds` [95% paired bootstrap CI].",
        "",
        "| run | changed | held-out interpolate | held-out extrapolate | minus as-seeds, interpolate | minus as-seeds,"
        " extrapolate | train accuracy, last half | lowest tool-call rate | highest void-turn rate | entropy, last"
        " 5 steps | KL to the start, last 5 steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    effects = []
    for name in done:
        run = out / "ablation" / name
        ms = _metrics(run)
        recs = _records(out / "ablation" / "curve", name, "retool")
        means = _split_means(recs)
        if name == "as-seeds" or not base:
            gains = ["-", "-"]
        else:
            gains = [gain_cell(of_split(base, sp), of_split(recs, sp)) for sp in SPLITS]
            effects.append(f"`{name}` {ablation_effect(base, recs)}")
        late = _column(ms, "task/correct_rate")[len(ms) // 2 :]
        changed = ", ".join(f"`{c}`" for c in ABLATIONS[name]) or "nothing"
        lines.append(
            f"| {name} | {changed} | {pct(means['interpolate'])} | {pct(means['extrapolate'])} | "
            + " | ".join(gains)
            + f" | {pct(_mean(late))} | {pct(min(_column(ms, 'tool/code_share'), default=0.0))}"
            f" | {pct(max(_column(ms, 'task/void_turn_rate'), default=0.0))}"
            f" | {_mean(_column(ms, 'policy/entropy')[-5:]):.3f} | {_mean(_column(ms, 'policy/ref_kl')[-5:]):.3f} |"
        )
    if effects:
        lines += [
            "",
            f"Which mattered, on held-out accuracy after {steps} step{'s' if steps != 1 else ''}: "
            + "; ".join(effects)
            + ". A setting not shown to matter here may matter over a longer run or a larger slice.",
        ]
    return lines


def ablation_effect(base: list[ProblemRecord], recs: list[ProblemRecord]) -> str:
    """What one changed setting did to held-out accuracy against ``as-seeds``: a direction only on a split
    whose paired interval leaves out 0."""
    from retool.evaluate.metrics import paired_gain

    moved = []
    for split in SPLITS:
        lo, hi = paired_gain(of_split(base, split), of_split(recs, split), seed=0)["ci95"]
        if lo > 0 or hi < 0:
            moved.append(f"{'raised' if lo > 0 else 'lowered'} {split}")
    return " and ".join(moved) if moved else "not shown to matter (both intervals hold 0)"


def _column(ms: list[dict[str, Any]], key: str) -> list[float]:
    return [float(m.get(key) or 0.0) for m in ms]


def curve_rows(out: Path, seeds: list[int]) -> dict[int, dict[int, dict[str, float]]]:
    """Held-out retool accuracy (module means per split) at every curve point, by seed and step."""
    start = _records(out / "curve-start", "step0000", "retool")
    rows: dict[int, dict[int, dict[str, float]]] = {}
    for seed in seeds:
        folder = out / f"rl-s{seed}" / "curve"
        points = {0: _split_means(start)} if start else {}
        for path in sorted(folder.glob("step*_retool.jsonl")):
            step = int(path.name[4:8])
            summary = _json(summary_path_for(path)) or {}
            if summary.get("status") != "complete":  # a point still being taken
                continue
            points[step] = _split_means(_records(folder, f"step{step:04d}", "retool"))
        rows[seed] = points
    return rows


def curve_lines(rows: dict[int, dict[int, dict[str, float]]]) -> list[str]:
    steps = sorted({s for points in rows.values() for s in points})
    head = "| step | " + " | ".join(f"s{seed} interpolate | s{seed} extrapolate" for seed in rows) + " |"
    lines = [head, "|---|" + "---|---|" * len(rows)]
    for step in steps:
        cells = []
        for points in rows.values():
            p = points.get(step)
            cells += [pct(p["interpolate"]), pct(p["extrapolate"])] if p else ["-", "-"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def draw(out: Path, seeds: list[int], rows: dict[int, dict[int, dict[str, float]]]) -> list[str]:
    """The learning curve and the instruments, as PNGs beside the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, split in zip(axes, SPLITS, strict=True):
        for seed, points in rows.items():
            steps = sorted(points)
            ax.plot(steps, [100 * points[s][split] for s in steps], marker="o", label=f"seed {seed}")
        ax.set(title=f"held-out retool accuracy, {split}", xlabel="RL step", ylabel="%")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mathematics_rl_curve.png", dpi=100)
    fig, axes = plt.subplots(2, 3, figsize=(13, 6))
    for ax, (key, title) in zip(axes.flat, INSTRUMENTS, strict=True):
        for seed in seeds:
            ms = [m for m in _metrics(out / f"rl-s{seed}") if m.get(key) is not None]
            xs, ys = [m["step"] for m in ms], [float(m[key]) for m in ms]
            # A step's value is a sample of a few hundred trajectories: the trend is the trailing mean.
            (raw,) = ax.plot(xs, ys, alpha=0.3, linewidth=0.8)
            ax.plot(xs, trailing_mean(ys, TREND_STEPS), color=raw.get_color(), label=f"seed {seed}")
        if key == "task/void_turn_rate":
            ax.axhline(VOID_BOUND, color="grey", linestyle="--", linewidth=0.8, label="issue's bound")
        ax.set(title=f"{title} ({TREND_STEPS}-step mean)", xlabel="RL step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mathematics_rl_instruments.png", dpi=100)
    plt.close("all")
    return ["mathematics_rl_curve.png", "mathematics_rl_instruments.png"]


TREND_STEPS = 10


def trailing_mean(ys: list[float], k: int) -> list[float]:
    """Each value's mean with up to ``k - 1`` values before it."""
    return [_mean(ys[max(0, i + 1 - k) : i + 1]) for i in range(len(ys))]


def cost_lines(out: Path, seeds: list[int]) -> list[str]:
    lines = [
        "| seed | steps | RL steps an hour | sampling | training | checkpoint | sampled trajectories"
        " | informative groups (issue: 600 or more) |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        ms = _metrics(out / f"rl-s{seed}")
        if not ms:
            continue
        total = sum(float(m.get("time/step") or 0.0) for m in ms)
        share = {
            k: sum(float(m.get(f"time/{k}") or 0.0) for m in ms) / total
            for k in ("rollout", "train", "checkpoint")
        }
        trajs = int(sum(float(m.get("task/trajectories") or 0.0) for m in ms))
        groups = int(sum(float(m.get("sampling/groups_informative") or 0.0) for m in ms))
        lines.append(
            f"| {seed} | {len(ms)} | {3600 * len(ms) / total:.1f} | {pct(share['rollout'])} | {pct(share['train'])}"
            f" | {pct(share['checkpoint'])} | {trajs} | {groups} |"
        )
    lines += ["", *machine_lines(out)]
    lines += [
        "",
        "Measuring the KL to the start (one more forward without the adapter, every step) is part of the"
        " training share above; what it adds to a training call: [ref_kl.md](ref_kl.md) (`bench/ref_kl.py`).",
    ]
    return lines


MACHINE_HOURS = 8.0  # issue 50: the whole bench, at most 8 hours of this machine


def _rounds_seconds(report: dict[str, Any], first: int = 0) -> float:
    return sum(
        float(r.get("sample_seconds", 0.0)) + float(r.get("sft_seconds", 0.0))
        for r in report.get("rounds", [])
        if int(r.get("round", 0)) >= first
    )


def _steps_seconds(runs: list[Path]) -> float:
    return sum(float(m.get("time/step") or 0.0) for run in runs for m in _metrics(run))


def machine_seconds(out: Path) -> dict[str, float]:
    """Each phase's own clocks, in seconds: the rounds' sampling and SFT, the RL steps' (sampling, training,
    checkpoints), every evaluation's ``run.json``. What no clock covers (loading models, merging adapters,
    the SFT start trained again on another machine) is left out, so the sum is a floor."""
    cold = _json(out / "sft" / "coldstart" / "report.json") or {}
    first = len(cold.get("rounds", []))
    found = [_json(f) for f in (out / "ei" / "coldstart").glob("round-*/report.json")]
    ei = {"rounds": [r for r in found if r]}
    return {
        "cold start": _rounds_seconds(cold),
        "sweep": _steps_seconds(sorted(p for p in (out / "sweep").glob("*") if p.name != "curve")),
        "RL seeds": _steps_seconds(sorted(out.glob("rl-s*"))),
        "expert iteration": _rounds_seconds(ei, first) + _pool_sft(out).get("seconds", 0.0),
        "ablation": _steps_seconds(sorted(p for p in (out / "ablation").glob("*") if p.name != "curve")),
        "evaluations": sum(
            float((_json(f) or {}).get("seconds", 0.0)) for f in sorted(out.glob("**/*.run.json"))
        ),
    }


def machine_lines(out: Path) -> list[str]:
    """The bench's machine time in all, by phase, against issue 50's cap."""
    parts = machine_seconds(out)
    hours = sum(parts.values()) / 3600
    listed = ", ".join(f"{name} {s / 3600:.1f} h" for name, s in parts.items() if s)
    return [
        f"Machine time, by the phases' own clocks (a floor: loading and merging models are not timed): {hours:.1f} h ({listed}); issue 50 allows"
        f" {MACHINE_HOURS:.0f} h in all: **{'within' if hours <= MACHINE_HOURS else 'over'}**."
    ]


def _pool_sft(out: Path) -> dict[str, float]:
    """``ei-pool``'s SFT: its steps, traces, epochs, batch size and seconds (empty until it has run)."""
    report = _json(out / "ei-pool" / "sft_report.json") or {}
    sft, config = report.get("sft", {}), report.get("config", {})
    if not sft:
        return {}
    return {
        "steps": float(sft["steps"]),
        "examples": float(sft["examples"]),
        "epochs": float(config.get("epochs", 0.0)),
        "batch_size": float(config.get("batch_size", 0.0)),
        "seconds": float(sft.get("seconds", 0.0)),
    }


def ei_lines(out: Path, rl_seed: int) -> list[str]:
    """Expert iteration past the cold start: its rounds, pool, hours, and its sampling rate beside RL's."""
    cold = _json(out / "sft" / "coldstart" / "report.json") or {}
    ei = _json(out / "ei" / "coldstart" / "report.json") or {}
    first = len(cold.get("rounds", []))
    rounds = ei.get("rounds", [])[first:]
    # While it runs, its summary is the cold start's (copied with its rounds): read the rounds it finished,
    # each written as it ends.
    found = [_json(f) for f in (out / "ei" / "coldstart").glob("round-*/report.json")]
    finished = sorted((r for r in found if r and int(r["round"]) >= first), key=lambda r: int(r["round"]))
    if len(finished) > len(rounds):
        modules = set(cold.get("kept_by_module", {})).union(
            *(r.get("kept_by_category", {}) for r in finished)
        )
        rounds, ei = finished, {"kept": finished[-1].get("pool", "?"), "modules_kept": len(modules)}
    if not rounds:
        return ["Expert iteration past the cold start: no round finished yet."]
    sampled = sum(int(r["sampled"]) for r in rounds)
    sample_s = sum(float(r.get("sample_seconds", 0.0)) for r in rounds)
    sft_s = sum(float(r.get("sft_seconds", 0.0)) for r in rounds)
    ms = _metrics(out / f"rl-s{rl_seed}")
    rl_trajs = sum(float(m.get("task/trajectories") or 0.0) for m in ms)
    rl_s = sum(float(m.get("time/rollout") or 0.0) for m in ms)
    listed = ", ".join(f"round {r['round']}: {r['kept']} kept of {r['sampled']}" for r in rounds)
    rl_rate = f"{rl_trajs / rl_s:.2f}" if rl_s else "-"
    lines = [
        f"Expert iteration past the cold start: {len(rounds)} round{'s' if len(rounds) != 1 else ''} ({listed}), a pool of {ei.get('kept', '?')}"
        f" traces over {ei.get('modules_kept', '?')} modules; {sample_s / 3600:.1f} h of sampling"
        f" ({sampled / max(sample_s, 1e-9):.2f} trajectories/s; RL seed {rl_seed}'s rollouts: {rl_rate}/s)"
        f" and {sft_s / 3600:.1f} h of SFT."
    ]
    last = rounds[-1].get("sft", {})
    pool = _pool_sft(out)
    if last.get("steps") and pool:
        seen = float(last["steps"]) * pool["batch_size"] / pool["examples"]  # of the pool, once
        lines[0] += (
            f" Each round's SFT takes the recipe's {last['steps']} steps, so the last round's model (`ei`) saw"
            f" about {seen:.2f} of its pool once; `ei-pool` is SFT from the start on the whole pool for the"
            f" cold start's {pool['epochs']:.2f} epochs ({pool['steps']:.0f} steps, {pool['seconds'] / 60:.0f} min):"
            " expert iteration's final model trained as the SFT start was."
        )
    return lines


def summary(args: argparse.Namespace, seeds: list[int], lr: str) -> str:
    """The README's block (the README shows the learning curve's PNG beside it): the final models in retool
    mode against the SFT start, and how many of the issue's targets were met."""
    out = args.out
    evals = final_evals(out, final_labels(seeds))
    lines = [
        f"Held-out retool accuracy (greedy, module means, {args.curve_per_module} questions a module) every"
        f" {args.chunk} RL steps at lr {lr}, then the final models on {args.final_per_module} questions of every"
        " module. RL trains the SFT model; expert iteration continues the cold start's rounds to RL seed"
        f" {seeds[0]}'s number of sampled trajectories (`ei`: its last round's model; `ei-pool`: its whole pool"
        " trained on as the SFT model's was).",
        "",
        "| model (retool mode) | interpolate | extrapolate | minus SFT, interpolate [95% CI] | minus SFT, extrapolate [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for label, by_mode in evals.items():
        recs = by_mode["retool"]
        means = _split_means(recs)
        if label == "sft":
            gains = ["-", "-"]
        else:
            base = evals["sft"]["retool"] if "sft" in evals else []
            gains = [gain_cell(of_split(base, sp), of_split(recs, sp)) if base else "-" for sp in SPLITS]
        lines.append(
            f"| {label} | {pct(means['interpolate'])} | {pct(means['extrapolate'])} | "
            + " | ".join(gains)
            + " |"
        )
    ablations = ablation_runs(args)
    lines = [status_line(out, seeds, evals, ablations) + " " + lines[0], *lines[1:]]
    targets = target_lines(out, evals, seeds)
    met = sum("**met**" in t for t in targets)
    judged = sum("**met**" in t or "**missed**" in t for t in targets)
    if not evals:
        lines.append("| no final model evaluated yet | | | | |")
    curve = []
    for seed, points in curve_rows(out, seeds).items():
        last = max(points, default=0)
        if last:
            first = points.get(0)
            was = f"{pct(first['interpolate'])} / {pct(first['extrapolate'])} at step 0, " if first else ""
            now = f"{pct(points[last]['interpolate'])} / {pct(points[last]['extrapolate'])}"
            curve.append(f"seed {seed}: {was}{now} at step {last}")
    versus = [
        f"rl-s{s} - {ei} {', '.join(gain_cell(of_split(evals[ei]['retool'], sp), of_split(evals[f'rl-s{s}']['retool'], sp)) for sp in SPLITS)}"
        for s in seeds
        for ei in EI_MODELS
        if f"rl-s{s}" in evals and ei in evals
    ]
    if versus:
        lines += [
            "",
            "RL over expert iteration at equal trajectories (retool; interpolate, extrapolate): "
            + "; ".join(versus)
            + ".",
        ]
    hours = sum(machine_seconds(out).values()) / 3600
    tail = f"Targets of issue 50 met: {met} of {judged} judged so far; {hours:.1f} h of this machine (issue: {MACHINE_HOURS:.0f} h)."
    if curve:
        tail = "Learning curve (interpolate / extrapolate), " + "; ".join(curve) + ". " + tail
    lines += ["", tail]
    return "\n".join(lines)


EI_MODELS = ("ei", "ei-pool")  # the last round's model; the whole pool trained on for the cold start's epochs


def final_labels(seeds: list[int]) -> list[str]:
    return ["sft", *[f"rl-s{s}" for s in seeds], *EI_MODELS]


def final_evals(out: Path, labels: list[str]) -> dict[str, dict[str, list[ProblemRecord]]]:
    """The final evaluations complete in both modes (one a sitting stopped holds part of its answers: those
    are kept for its resume, never reported)."""
    modes = ("text-only", "retool")
    return {
        label: {m: _records(out / "final", label, m) for m in modes}
        for label in labels
        if evaluated(out / "final", label, ",".join(modes))
    }


def gains_lines(evals: dict[str, dict[str, list[ProblemRecord]]], seeds: list[int]) -> list[str]:
    lines = ["| comparison | interpolate | extrapolate |", "|---|---|---|"]
    pairs = [(f"rl-s{s}", "sft") for s in seeds] + [(ei, "sft") for ei in EI_MODELS]
    pairs += [(f"rl-s{s}", ei) for ei in EI_MODELS for s in seeds]
    for after, before in pairs:
        if after in evals and before in evals:
            for mode in ("retool", "text-only"):
                cells = [
                    gain_cell(of_split(evals[before][mode], sp), of_split(evals[after][mode], sp))
                    for sp in SPLITS
                ]
                lines.append(f"| {after} - {before} ({mode}) | " + " | ".join(cells) + " |")
    return lines


def ci_low(before: list[ProblemRecord], after: list[ProblemRecord], split: str) -> float:
    """The lower end of the paired bootstrap 95% interval of ``after`` minus ``before`` on ``split``."""
    from retool.evaluate.metrics import paired_gain

    return float(paired_gain(of_split(before, split), of_split(after, split), seed=0)["ci95"][0])


def target_lines(out: Path, evals: dict[str, dict[str, list[ProblemRecord]]], seeds: list[int]) -> list[str]:
    """Each target of issue 50, met or missed, from the records and metrics."""
    lines = []
    for s in seeds:
        rl = f"rl-s{s}"
        if rl not in evals or "sft" not in evals:
            lines.append(f"- seed {s}: final evaluation not run yet")
            continue
        for split, need in (("interpolate", 0.10), ("extrapolate", 0.0)):
            cell = gain_cell(of_split(evals["sft"]["retool"], split), of_split(evals[rl]["retool"], split))
            gain = split_mean(module_stats(evals[rl]["retool"]), split, "accuracy") - split_mean(
                module_stats(evals["sft"]["retool"]), split, "accuracy"
            )
            met = ci_low(evals["sft"]["retool"], evals[rl]["retool"], split) > 0 and gain >= need
            lines.append(
                f"- seed {s}, {split}: RL over SFT (retool) {cell}, need {pts(need)} and CI above 0: **{'met' if met else 'missed'}**"
            )
        ms = _metrics(out / rl)
        calls, voids = _column(ms, "tool/code_share"), _column(ms, "task/void_turn_rate")
        over = sum(v >= VOID_BOUND for v in voids)
        ok = not run_summary(ms)["collapsed"]  # the bench's own test, the one the sweep used
        lines.append(
            f"- seed {s}, no collapse: lowest tool-call rate {pct(min(calls, default=0.0))} against"
            f" {pct(calls[0] if calls else 0.0)} at step 1, highest void-turn rate {pct(max(voids, default=0.0))}"
            f" (step 1, the SFT start's own: {pct(voids[0] if voids else 0.0)}; mean over the {len(voids)} steps"
            f" {pct(_mean(voids))}, {over} step{'s' if over != 1 else ''} at 10% or more): **{'met' if ok else 'missed'}**"
        )
        for ei in (e for e in EI_MODELS if e in evals):
            cell = gain_cell(
                of_split(evals[ei]["retool"], "interpolate"), of_split(evals[rl]["retool"], "interpolate")
            )
            low = ci_low(evals[ei]["retool"], evals[rl]["retool"], "interpolate")
            lines.append(
                f"- seed {s}: RL over expert iteration ({ei}) at equal trajectories (retool, interpolate) {cell}: **{'met' if low > 0 else 'missed'}**"
            )
        ext = split_mean(module_stats(evals[rl]["retool"]), "extrapolate", "accuracy")
        lines.append(
            f"- seed {s}, stretch: retool extrapolation mean {pct(ext)} against the paper's Transformer 50.0%: **{'met' if ext >= 0.5 else 'missed'}**"
        )
    return lines


def status_line(out: Path, seeds: list[int], evals: dict[str, Any], ablations: list[str]) -> str:
    """Which phases this report holds whole: a page written while the bench still runs says so first."""
    pending = [f"RL seed {s}" for s in seeds if not (out / f"rl-s{s}" / "done.json").is_file()]
    if not (out / "ei" / "phase.json").is_file():
        pending.append("expert iteration")
    pending += [f"the final evaluation of {label}" for label in ["sft", *EI_MODELS] if label not in evals]
    if not all(evaluated(out / "ablation" / "curve", name) for name in ablations):
        pending.append("the ablation")
    if not pending:
        return "Status: every phase finished."
    return "Status: **a run in progress**; not finished yet: " + ", ".join(pending) + "."


def report(args: argparse.Namespace, seeds: list[int], lr: str, budget: int) -> str:
    out = args.out
    rows = curve_rows(out, seeds)
    pngs = draw(out, seeds, rows)
    evals = final_evals(out, final_labels(seeds))
    lines = [status_line(out, seeds, evals, ablation_runs(args)), ""]
    lines += [*coldstart_lines(out), "", "Learning-rate sweep (seed 0, short runs from the SFT model):", ""]
    lines += sweep_lines(out)
    lines += ["", *stability_lines(out, seeds)]
    lines += [
        "",
        f"Learning curve: held-out retool accuracy (module means, greedy, {args.curve_per_module} a module) every {args.chunk} steps at lr {lr}:",
        "",
    ]
    lines += curve_lines(rows)
    lines += ["", *[f"![{png.removesuffix('.png')}]({png})" for png in pngs], "", "Cost of RL:", ""]
    lines += cost_lines(out, seeds)
    lines += [
        "",
        f"Expert iteration continued to {budget} sampled trajectories (the cold start's plus RL seed {seeds[0]}'s)."
        if budget
        else "Expert iteration continued: not run yet (report of a run in progress).",
        "",
        *ei_lines(out, seeds[0]),
        "",
    ]
    lines += [f"Final models, {args.final_per_module} questions of every module, greedy, module means:", ""]
    lines += means_table(evals) if evals else ["not run yet"]
    lines += ["", "Paired differences over questions, percentage points [95% paired bootstrap CI]:", ""]
    lines += gains_lines(evals, seeds)
    lines += ["", "Targets (issue 50):", "", *target_lines(out, evals, seeds)]
    lines += ["", *ablation_lines(out, args.ablation_steps, ablation_runs(args))]
    return "\n".join(lines)
