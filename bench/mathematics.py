"""Benchmark: ReTool's two stages on DeepMind Mathematics with SmolLM2-135M-Instruct, interpolation and
extrapolation, beside the paper's Transformer.

The mathematics demo (``retool demo --recipe mathematics``: a cold start from the model's own
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
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from _harness import (  # bench/, on sys.path when run as a script
    MODES,
    eval_config,
    evaluate_in_process,
    evaluate_model,
    evaluate_plan,
    gain_cell,
    model_path,
    pct,
    run_seed_demos,
    saved_run,
)
from _results import render_pages, write_result
from retool.evaluate.store import ProblemRecord, read_problem_records

SPLITS = ("interpolate", "extrapolate")
PAPER = {"interpolate": 0.76, "extrapolate": 0.50}  # Saxton et al. 2019, Transformer, module means
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


def eval_process(model: str, outputs: dict[str, Path], demo_dir: Path, args: argparse.Namespace) -> None:
    """A model's evaluations in a process of its own, both modes at once (``evaluate_in_process``)."""
    extra = ["--per-module", str(args.per_module), "--threads", str(args.threads)]
    extra += ["--data-dir", args.data_dir] if args.data_dir else []
    evaluate_in_process(__file__, model, outputs, demo_dir, extra)


def eval_one(label: str, modes: list[str], folder: Path, demo_dir: Path, args: argparse.Namespace) -> None:
    """``--eval-one``: the model ``label`` names on the held-out questions in each of ``modes``, with the
    config the demo in ``demo_dir`` ran with, greedy, turns ending at their first closed box."""
    from retool.env.mathematics import MathematicsList
    from retool.recipes.mathematics.task import held_out_problems

    saved, config = saved_run(demo_dir)
    config = eval_config(config, model_path(label, demo_dir), folder, len(modes))
    sampling = config.sampling.model_copy(update={"temperature": 0.0})
    config = config.model_copy(update={"sampling": sampling})
    problems = held_out_problems(args.per_module, args.data_dir or saved.get("data_dir"))
    source = MathematicsList(problems, shuffle=False, name="mathematics held-out")
    evaluate_model(label, modes, folder, config, problems, "mathematics held-out", args.threads, source)


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
        run_seed_demos("mathematics", seeds, args.out, args.set, args.data_dir, log)
        folder = args.out / f"per-module-{args.per_module}"

        def evaluate(label: str, outputs: dict[str, Path], demo_dir: Path) -> None:
            eval_process(label, outputs, demo_dir, args)

        def read(output: Path) -> list[ProblemRecord]:
            return rescore(read_problem_records(output))

        evals = evaluate_plan(seeds, args.out, folder, evaluate, read, log)
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
