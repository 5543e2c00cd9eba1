"""Benchmark: ReTool's two stages on DeepMind Mathematics with SmolLM2-135M-Instruct, interpolation and
extrapolation, beside the paper's Transformer.

The mathematics demo (``retool demo --model smollm2 --task mathematics``: a cold start from the model's own
verified attempts, SFT, RL on the generated train split) runs once per seed, each in a process of its own,
without evaluations of its own (the bench evaluates instead): the first seed's run does the cold start and
SFT, every other seed's RL starts from that SFT model (``--reuse-sft``), so the seeds differ in RL. Then each
model the claims compare is evaluated once, text-only and with the tool, greedy, each turn ending at its first
closed ``\\boxed{...}``, on the first ``--per-module`` questions of every interpolate module (56) and every
extrapolate module (15): the base model and the SFT model once (greedy decoding does not depend on the seed),
the RL model of each seed; a process per model, both modes at once. Everything is kept as it finishes, so a
rerun of the same command resumes.

Reported: per split, the mean over modules of each module's accuracy (the paper's own summary: its
Transformer, trained on 2M examples of every module, reaches 76% interpolation and 50% extrapolation, by
exact match), with the checker's equivalence and the paper's exact match side by side; paired bootstrap 95%
intervals (over questions) for RL minus SFT and for retool minus text-only; a per-module table with the
tool-call rate and the share of calls that raised.

    python bench/mathematics.py                          # seeds 0 and 1, --per-module 10
    python bench/mathematics.py --seeds 0 --per-module 2 # a quick look
    python bench/mathematics.py --from-demo runs/demo-smollm2-mathematics --write
                                                         # read one finished demo's own evaluations
    python bench/mathematics.py --write                  # also docs/results/mathematics.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _results import render_pages, write_result  # bench/, on sys.path when run as a script
from gsm8k import _finished, gain_cell, keep_results, pct, results_path, run_demo_process
from retool.evaluate.store import ProblemRecord, read_problem_records, summary_path_for

MODES = ("text-only", "retool")
SPLITS = ("interpolate", "extrapolate")
PAPER = {"interpolate": 0.76, "extrapolate": 0.50}  # Saxton et al. 2019, Transformer, module means
DEMO_FIELDS = ("eval_modes=[]", "base_eval_problems=0")
SFT_LABEL = "sft"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1", help="comma-separated demo seeds (default 0,1)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-mathematics"))
    ap.add_argument("--set", action="append", default=[], help="override for every demo (key=value)")
    ap.add_argument("--per-module", type=int, default=10, help="questions per module and split (default 10)")
    ap.add_argument("--data-dir", default=None, help="the generated files (default: the data folder)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of each evaluation (0: every core)")
    ap.add_argument("--from-demo", type=Path, default=None, help="report a finished demo's own evaluations")
    ap.add_argument("--write", action="store_true", help="write docs/results/mathematics.md")
    ap.add_argument(
        "--eval-one", nargs=4, metavar=("LABEL", "MODES", "FOLDER", "DEMO_DIR"), help=argparse.SUPPRESS
    )
    return ap.parse_args(argv)


def demo_args(args: argparse.Namespace) -> argparse.Namespace:
    """What ``gsm8k.run_demo_process`` reads, for the mathematics task."""
    return argparse.Namespace(set=[*args.set], data_dir=args.data_dir)


def plan(seeds: list[int], out: Path) -> list[tuple[str, Path]]:
    first = out / f"seed{seeds[0]}"
    return [("base", first), (SFT_LABEL, first)] + [(f"rl-s{s}", out / f"seed{s}") for s in seeds]


def eval_output(folder: Path, model: str, mode: str) -> Path:
    return folder / f"{model}_{mode}.jsonl"


def eval_process(model: str, outputs: dict[str, Path], demo_dir: Path, args: argparse.Namespace) -> None:
    """A model's evaluations (both modes at once, one engine) in a process of its own; nothing when done."""
    if results_path(next(iter(outputs.values())).parent, model).is_file():
        return
    todo = [m for m, out in outputs.items() if not (summary_path_for(out).is_file() and _finished(out))]
    if not todo:
        return
    folder = outputs[todo[0]].parent
    cmd = [sys.executable, __file__, "--eval-one", model, ",".join(todo), str(folder), str(demo_dir)]
    cmd += ["--per-module", str(args.per_module), "--threads", str(args.threads)]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    subprocess.run(cmd, check=True)


def eval_one(label: str, modes: list[str], folder: Path, demo_dir: Path, args: argparse.Namespace) -> None:
    """``--eval-one``: the model ``label`` names on the held-out questions in each of ``modes``, with the
    config the demo in ``demo_dir`` ran with, greedy, turns ending at their first closed box."""
    import torch

    from retool.components import build_components
    from retool.env.mathematics import MathematicsList
    from retool.evaluate.runner import run_eval
    from retool.recipes.mathematics.task import held_out_problems
    from retool.tasks.pipeline import phase_config, with_available_isolation
    from retool.tasks.real_model import resolve_model_path
    from retool.tasks.settings import DemoSettings

    saved = json.loads((demo_dir / "settings.json").read_text())
    config = DemoSettings.load([], config="demo-smollm2-mathematics").config.model_validate(saved["config"])
    path = resolve_model_path("smollm2") if label == "base" else demo_dir / f"model_{label.split('-')[0]}"
    config = phase_config(with_available_isolation(config), path, folder / "scratch")
    backend = config.backend.model_copy(update={"sample_batch_size": 64 * len(modes)})
    sampling = config.sampling.model_copy(update={"temperature": 0.0, "stop_at_boxed": True})
    config = config.model_copy(
        update={
            "lora": config.lora.model_copy(update={"enabled": False}),
            "backend": backend,
            "sampling": sampling,
        }
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    problems = held_out_problems(args.per_module, args.data_dir or saved.get("data_dir"))
    folder.mkdir(parents=True, exist_ok=True)

    async def run(parts: Any) -> None:
        await parts.refresh_sampler()
        source = MathematicsList(problems, shuffle=False, name="mathematics held-out")
        await asyncio.gather(
            *[
                run_eval(
                    problems,
                    parts.for_mode(mode == "retool"),
                    config=config,
                    mode=mode,
                    output=eval_output(folder, label, mode),
                    identity={"model": label, "checkpoint": str(path), "dataset": "mathematics held-out"},
                    concurrency=len(problems),
                    save_transcripts=False,
                    source=source,
                )
                for mode in modes
            ]
        )

    t0 = time.perf_counter()
    with build_components(config) as parts:
        asyncio.run(run(parts))
    facts_file = folder / f"{label}.run.json"
    before = json.loads(facts_file.read_text()) if facts_file.is_file() else {}
    facts_file.write_text(
        json.dumps({"seconds": round(before.get("seconds", 0.0) + time.perf_counter() - t0, 1)}) + "\n"
    )


# -- analysis ---------------------------------------------------------------------------------------


def split_and_module(record: ProblemRecord) -> tuple[str, str]:
    """``(split, module)`` of a held-out record, from its id ``mathematics-<split>-<module>-<n>``."""
    _, split, rest = str(record["id"]).split("-", 2)
    return split, rest.rsplit("-", 1)[0]


def module_stats(records: list[ProblemRecord]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (split, module): accuracy (the checker), exact match (the paper's), tool-call rate, and the share
    of calls whose code raised."""
    from retool.reward.mathematics import exact_match

    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        for cand in rec["candidates"]:
            groups[split_and_module(rec)].append({**cand, "reference": rec["reference"]})
    out = {}
    for key, cands in groups.items():
        n = len(cands)
        calls = sum(int(c["code_calls"]) for c in cands)
        out[key] = {
            "n": float(n),
            "accuracy": sum(bool(c["correct"]) for c in cands) / n,
            "exact": sum(
                c.get("answer") is not None and exact_match(str(c["answer"]), str(c["reference"]))
                for c in cands
            )
            / n,
            "call_rate": sum(int(c["code_calls"]) > 0 for c in cands) / n,
            "error_rate": sum(int(c.get("exec_errors", 0)) for c in cands) / calls if calls else 0.0,
        }
    return out


def split_mean(stats: dict[tuple[str, str], dict[str, float]], split: str, key: str) -> float:
    values = [s[key] for (sp, _), s in stats.items() if sp == split]
    return sum(values) / len(values) if values else 0.0


def of_split(records: list[ProblemRecord], split: str) -> list[ProblemRecord]:
    return [r for r in records if split_and_module(r)[0] == split]


def means_table(evals: dict[str, dict[str, list[ProblemRecord]]]) -> list[str]:
    lines = [
        "| model | mode | interpolate (checker) | interpolate (exact) | extrapolate (checker) | extrapolate (exact) | tool-call rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, by_mode in evals.items():
        for mode, recs in by_mode.items():
            st = module_stats(recs)
            cells = [pct(split_mean(st, sp, k)) for sp in SPLITS for k in ("accuracy", "exact")]
            calls = sum(s["call_rate"] * s["n"] for s in st.values()) / max(
                1.0, sum(s["n"] for s in st.values())
            )
            lines.append(f"| {label} | {mode} | " + " | ".join(cells) + f" | {pct(calls)} |")
    paper = " | ".join(f"{pct(PAPER[sp])} | {pct(PAPER[sp])}" for sp in SPLITS)
    lines.append(f"| paper's Transformer (Saxton et al. 2019) | text | {paper} | - |")
    return lines


def gains_table(evals: dict[str, dict[str, list[ProblemRecord]]]) -> list[str]:
    lines = ["| comparison | interpolate | extrapolate |", "|---|---|---|"]

    def row(name: str, before: list[ProblemRecord], after: list[ProblemRecord]) -> str:
        cells = [gain_cell(of_split(before, sp), of_split(after, sp)) for sp in SPLITS]
        return f"| {name} | " + " | ".join(cells) + " |"

    for label, by_mode in evals.items():
        if label.startswith("rl") and SFT_LABEL in evals:
            for mode in MODES:
                if mode in by_mode and mode in evals[SFT_LABEL]:
                    lines.append(
                        row(f"{label} - {SFT_LABEL} ({mode})", evals[SFT_LABEL][mode], by_mode[mode])
                    )
        if set(MODES) <= set(by_mode):
            lines.append(row(f"{label}: retool - text-only", by_mode["text-only"], by_mode["retool"]))
    return lines


def module_table(evals: dict[str, dict[str, list[ProblemRecord]]]) -> list[str]:
    """Per module: retool accuracy of every model, the last RL model's text-only accuracy, its tool use."""
    labels = [label for label, by_mode in evals.items() if "retool" in by_mode]
    last_rl = next((lb for lb in reversed(labels) if lb.startswith("rl")), labels[-1])
    stats = {lb: module_stats(evals[lb]["retool"]) for lb in labels}
    text = module_stats(evals[last_rl]["text-only"]) if "text-only" in evals[last_rl] else {}
    head = "| split | module | " + " | ".join(f"{lb} retool" for lb in labels)
    head += f" | {last_rl} text-only | {last_rl} calls | {last_rl} call errors |"
    lines = [head, "|---|---|" + "---|" * (len(labels) + 3)]
    for key in sorted(stats[last_rl]):
        cells = [pct(stats[lb].get(key, {}).get("accuracy", 0.0)) for lb in labels]
        t = pct(text[key]["accuracy"]) if key in text else "-"
        s = stats[last_rl][key]
        lines.append(
            f"| {key[0]} | {key[1]} | "
            + " | ".join(cells)
            + f" | {t} | {pct(s['call_rate'])} | {pct(s['error_rate'])} |"
        )
    return lines


def report(evals: dict[str, dict[str, list[ProblemRecord]]], extra: str = "") -> str:
    lines = [
        "Module means (each module's accuracy, averaged over the split's modules):",
        "",
        *means_table(evals),
    ]
    lines += ["", "Paired differences over questions, percentage points [95% paired bootstrap CI]:", ""]
    lines += gains_table(evals)
    lines += ["", "Per module:", "", *module_table(evals)]
    return "\n".join(lines) + ("\n\n" + extra if extra else "")


CAVEATS = (
    "What differs from the paper: its Transformer trained on 2M examples of every module (112M in all) and is"
    " scored by exact match over 10,000 questions a module; here a 135M pretrained model sees a few hundred"
    " train questions in SFT and RL on two CPU cores, is scored on the questions above, and may call a Python"
    " interpreter in retool mode. 'checker' accepts equivalent answers where the form allows"
    " (retool.reward.mathematics); 'exact' is the paper's string match."
)


def rescore(records: list[ProblemRecord]) -> list[ProblemRecord]:
    """Each candidate's ``correct`` as this checker judges its recorded answer: every figure of the report
    then comes from one version of ``retool.reward.mathematics``, whichever scored the run."""
    from retool.reward.mathematics import check

    out = []
    for rec in records:
        module = str(rec.get("data_source", "")).removeprefix("mathematics/")
        cands = [
            {
                **c,
                "correct": c.get("answer") is not None
                and check(str(c["answer"]), str(rec["reference"]), module),
            }
            for c in rec["candidates"]
        ]
        out.append({**rec, "candidates": cands, "n_correct": sum(c["correct"] for c in cands)})
    return out


def from_demo(folder: Path) -> dict[str, dict[str, list[ProblemRecord]]]:
    """A finished demo's own evaluations (``eval/<model>_<mode>.jsonl``), by model and mode, rescored."""
    evals: dict[str, dict[str, list[ProblemRecord]]] = {}
    for label in ("base", "sft", "rl"):
        for mode in MODES:
            path = folder / "eval" / f"{label}_{mode}.jsonl"
            if path.is_file():
                evals.setdefault(label, {})[mode] = rescore(read_problem_records(path))
    return evals


def demo_facts(folder: Path) -> str:
    rep = json.loads((folder / "report.json").read_text())
    t = rep["timings"]
    conv = rep.get("sft", {}).get("conversion", {})
    phases = ", ".join(f"{k} {v / 60:.1f} min" for k, v in t.items() if k not in ("total", "rl_share"))
    return (
        f"The demo run: {t['total'] / 60:.1f} min in all ({phases}); peak RSS"
        f" {rep['machine'].get('peak_rss_gib', 0):.1f} GiB; cold start: {conv.get('kept', '-')} verified attempts"
        f" kept of {conv.get('sampled', '-')} sampled ({conv.get('correct', '-')} correct)."
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench.mathematics")
    if args.eval_one:
        label, modes, folder, demo_dir = args.eval_one
        eval_one(label, modes.split(","), Path(folder), Path(demo_dir), args)
        return
    if args.from_demo is not None:
        evals = from_demo(args.from_demo)
        scope = "the demo's own held-out set (its settings.json: mathematics_problems per module), greedy"
        text = report(evals, demo_facts(args.from_demo) + "\n\n" + CAVEATS)
    else:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        first = args.out / f"seed{seeds[0]}"
        run_demo_process(seeds[0], first, demo_args(args), log, task="mathematics", fields=DEMO_FIELDS)
        for s in seeds[1:]:
            run_demo_process(
                s, args.out / f"seed{s}", demo_args(args), log, first, task="mathematics", fields=DEMO_FIELDS
            )
        folder = args.out / f"per-module-{args.per_module}"
        evals = {}
        for label, demo_dir in plan(seeds, args.out):
            outputs = {mode: eval_output(folder, label, mode) for mode in MODES}
            eval_process(label, outputs, demo_dir, args)
            evals[label] = {mode: rescore(read_problem_records(out)) for mode, out in outputs.items()}
            if not results_path(folder, label).is_file():
                keep_results(folder, label, evals[label])
        scope = f"seeds {', '.join(map(str, seeds))}; the first {args.per_module} questions of every module, greedy"
        text = report(evals, CAVEATS)
    print(text)
    if args.write:
        head = f"Held-out: {scope}; one answer per question.\n\n"
        path = write_result(
            "mathematics.md",
            "DeepMind Mathematics with SmolLM2-135M: interpolation and extrapolation",
            head + text,
        )
        render_pages()
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
