"""Benchmark: does RL itself move SmolLM2-135M on DeepMind Mathematics? Learning curves over seeds, the
instruments RL engineers read, and expert iteration at an equal number of sampled trajectories beside it.

One cold start, then everything from it, each phase in a process of its own and kept as it finishes, so a
rerun of the same command resumes where the last one stopped (the run folder may span several sittings;
keep it outside the work tree):

1. ``coldstart``: expert iteration from the base model (round 0 under the recipe's few-shot prompt, then
   ``--coldstart-rounds - 1`` rounds of the SFT model's own verified, tool-using attempts) and SFT on the
   pool -> ``sft/model_sft``.
2. ``sweep``: short RL runs from the SFT model, one per ``--lrs`` value (seed 0, pass-rate selection), and
   one at the middle rate in epoch order (the informative share with and without the selector, same start);
   the rate with the highest train accuracy over the last half of its steps, among those that kept the
   tool-call rate within ``COLLAPSE_POINTS`` of the first step's, is used below.
3. ``rl-s<seed>``: RL for ``--steps`` steps in chunks of ``CHUNK``; after each chunk the merged policy is
   evaluated greedy, tool on, on a fixed held-out slice (``--curve-per-module`` questions of every
   interpolate and extrapolate module): the learning curve. Longer until the seed has had
   ``--min-informative`` informative groups, then while the train accuracy still rises (``--max-steps``
   at most: ``next_target``). A finished seed's final model is evaluated (step 5) at once, so a later
   sitting needs neither its weights nor its checkpoint.
4. ``ei``: the cold start's expert iteration continued until it has sampled as many trajectories as
   RL seed 0 (cold start included): the baseline RL must beat. Each round's SFT takes the recipe's fixed
   steps, so the last round's model (``ei``) has seen only part of a pool that grew; ``ei-pool`` is SFT
   from the start on the whole pool for as many epochs as the cold start's SFT gave its own pool
   (``sft.epochs``): expert iteration's final model trained as the SFT start was.
5. ``final``: SFT, each RL seed (as it finishes) and both EI models on ``--final-per-module`` questions of
   every module, text-only and with the tool, greedy; paired bootstrap intervals over questions.
6. ``ablation``: which of issue 50's stability settings mattered. ``--ablation-steps`` of RL from the SFT
   model at the chosen rate, seed 0, once as the seeds ran, once with void-turn and truncated trajectories
   scored -1 in the loss (the filters off), once with a KL-to-start penalty (``ABLATIONS``); each run's
   instruments and its model on the held-out slice, side by side.

The order: cold start, sweep, the first seed (EI's budget is its trajectory count), the SFT start's and EI's
final evaluations, the ablation, then the other seeds, which a lost machine would set back most (below).

    python bench/mathematics_rl.py --out /work/runs/mathematics_rl            # the whole bench
    python bench/mathematics_rl.py --out DIR --write                          # + docs/results/mathematics_rl.md
    python bench/mathematics_rl.py --smoke --out /tmp/slice                   # a few-step slice (CI)

A sitting may land on another machine, with an empty run folder. What is costly to sample and cheap to keep
(the cold start's finished rounds, the start's held-out curve point, each sweep run trained to its end with
its evaluation, the sweep once chosen) is copied as it finishes into ``--carry`` (in the work tree: commit
it with the results) and copied back into a run folder that lacks it: the cold start's rounds are read back
and its weights trained again from their pool; a finished sweep run, and a chosen sweep, are not run again.
An RL seed carries its run at every point of its curve: its config, metrics, the held-out evaluations and the
checkpoint of that step (the adapter, the optimizer's moments, the RNG and the selector's state), so a seed
resumes on another machine from its last curve point (on an SFT start trained again from the same pool); a
finished seed carries ``done.json`` (its last step) instead, once its final evaluation is complete.
Expert iteration carries its rounds as the cold start does (a round stopped midway, its finished chunks);
the final evaluation carries what it finished.
Only the newest checkpoint of a seed is kept in ``--carry``, and git ignores it (weights, ~60 MB, never enter
the repository): a seed resumes from it where the run folder or the work tree survives the sitting; on a fresh
clone an unfinished seed trains again from step 0 (its carried curve points are kept, not taken again).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import eval_output  # bench/, on sys.path when run as a script

log = logging.getLogger("mathematics_rl")

CHUNK = 10  # steps between two points of the learning curve
COLLAPSE_POINTS = 0.10  # the bound: tool-call rate never more than 10 points under the start's
VOID_BOUND = 0.10  # and void turns under 10% on every logged step
CARRY_EVERY = 60.0  # seconds between two copies of a running phase's finished parts into --carry
FINAL_MODES = "text-only,retool"
# RL's settings beside the recipe's preset (each is item 3 of issue 50 or the selector of item 2): void and
# truncated trajectories left out of the loss, problems drawn where groups are likely mixed.
RL_SETS = (
    "filters.void_turn=true",
    "filters.overlong=true",
    "data.selection=pass_rate",
    "checkpoint.every=5",
    "checkpoint.keep_last=1",
)
# Issue 50's item 3, one setting changed at a time against the seeds' own (``as-seeds``). The penalty's
# coefficient: PRIME's level (the research notes' choice for this collapse), 10x SimpleRL's.
ABLATIONS = {
    "as-seeds": (),
    "void-scored": ("filters.void_turn=false", "filters.overlong=false"),
    "kl-1e-3": ("loss.ref_kl_coef=1e-3",),
}
SMOKE = {  # a few-step slice: every phase, sizes cut to minutes (one seed, one changed setting)
    "seeds": "0",
    "ablations": "as-seeds,void-scored",
    "steps": 2,
    "sweep_steps": 1,
    "lrs": "1e-4",
    "curve_per_module": 1,
    "final_per_module": 1,
    "coldstart_rounds": 1,
    "chunk": 1,
    "ablation_steps": 1,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-mathematics-rl"))
    ap.add_argument("--seeds", default="0,1")
    # 80 steps of 8 groups reach the 600 informative groups a seed only if most groups are mixed;
    # a seed goes on in chunks until it has had them (--min-informative), then while its accuracy rises.
    ap.add_argument("--steps", type=int, default=80, help="RL steps a seed at least (default 80)")
    ap.add_argument("--min-informative", type=int, default=600, help="informative groups a seed at least")
    ap.add_argument("--max-steps", type=int, default=160, help="RL steps a seed at most")
    ap.add_argument("--lrs", default="5e-5,1e-4,2e-4", help="the sweep's learning rates")
    ap.add_argument("--sweep-steps", type=int, default=10)
    ap.add_argument(
        "--ablation-steps", type=int, default=20, help="RL steps of each ablation run (0: no ablation)"
    )
    ap.add_argument(
        "--ablations", default=",".join(ABLATIONS), help=f"the ablation's runs, of {', '.join(ABLATIONS)}"
    )
    ap.add_argument("--coldstart-rounds", type=int, default=3)
    ap.add_argument("--coldstart-round-rows", type=int, default=8, help="train problems a module a round")
    ap.add_argument("--curve-per-module", type=int, default=2)
    ap.add_argument("--final-per-module", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], help="config override for every phase")
    ap.add_argument(
        "--carry",
        type=Path,
        default=Path(__file__).resolve().parent / "state" / "mathematics_rl",
        help="where finished cold-start rounds and the sweep are kept across machines ('' for nowhere)",
    )
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="a few-step slice of every phase")
    ap.add_argument("--write", action="store_true", help="write docs/results/mathematics_rl.md")
    ap.add_argument("--report", action="store_true", help="only the report, of what the run folder holds now")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a child's work
    ap.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.chunk = CHUNK
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.max_steps = args.steps
        args.min_informative = 0
    unknown = sorted(set(args.ablations.split(",")) - set(ABLATIONS))
    if unknown:
        ap.error(f"--ablations: unknown {', '.join(unknown)} (known: {', '.join(ABLATIONS)})")
    return args


def ablation_runs(args: argparse.Namespace) -> list[str]:
    """The ablation's runs this bench takes (none with ``--ablation-steps 0``)."""
    return (
        [name for name in ABLATIONS if name in args.ablations.split(",")] if args.ablation_steps > 0 else []
    )


# -- the settings every phase shares ------------------------------------------------------------------------


def settings(args: argparse.Namespace, out: Path, extra: list[str] | tuple[str, ...] = ()) -> Any:
    """The mathematics recipe's demo settings, with the bench's cold start and ``--set``."""
    from retool.pipeline.settings import DemoSettings
    from retool.recipes import recipe_named
    from retool.recipes.demo import recipe_fields

    recipe = recipe_named("mathematics")
    sets = [
        f"recipe.coldstart_rounds={args.coldstart_rounds}",
        f"recipe.coldstart_round_rows={args.coldstart_round_rows}",
    ]
    sets += [*args.set, *extra]
    if args.smoke:
        sets += ["recipe.coldstart_rows=2", "sft.steps=2", "sft.batch_size=2", "lora.rank=4", "lora.alpha=8"]
        sets += ["rollout.questions_per_step=2", "rollout.group_size=2", "filters.dynamic_sampling=false"]
        sets += ["backend.sample_batch_size=8"]
    fields = {**recipe_fields(recipe), "out": str(out)}
    if args.data_dir:
        fields["data_dir"] = args.data_dir
    return DemoSettings.load(sets, config=recipe.preset, **fields)


def child(args: argparse.Namespace, phase: str, *extra: str) -> None:
    """``phase`` in a process of its own (its memory freed when it ends; a kill loses only its own work)."""
    cmd = [sys.executable, __file__, "--phase", phase, "--out", str(args.out), *[f"--arg={x}" for x in extra]]
    cmd += [f"--set={s}" for s in args.set] + (["--smoke"] if args.smoke else [])
    cmd += [
        f"--coldstart-rounds={args.coldstart_rounds}",
        f"--coldstart-round-rows={args.coldstart_round_rows}",
    ]
    cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    with subprocess.Popen(cmd) as proc:
        while True:  # a long phase (the cold start's rounds) carries what it finished as it goes
            try:
                proc.wait(timeout=CARRY_EVERY)
                break
            except subprocess.TimeoutExpired:
                carry_out(args)
    carry_out(args)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


# What a run folder on another machine can start from (module docstring): finished rounds (their report is
# written last), evaluation outputs (each says in its summary whether it completed), the sweep's choice with
# the runs' metrics it was made from, an RL seed's checkpoint at its last curve point. Never merged weights,
# nor a marker that says they exist.
CARRIED_ROUNDS = ("sft/coldstart", "ei/coldstart")
CARRIED_FILES = (
    "sft/coldstart/report.json",
    "curve-start/*",
    "final/*",
    "rl-s*/curve/*",
    "rl-s*/done.json",
    "ablation/curve/*",
    "ei-pool/sft_report.json",
)
CARRIED_SWEEP = ("sweep/choice.json", "sweep/curve/*", "sweep/*/metrics.jsonl")  # once choice.json exists


def carried(out: Path) -> list[Path]:
    """The files of ``out`` kept across machines, relative to it."""
    found: list[Path] = []
    for rounds in CARRIED_ROUNDS:
        for report in sorted((out / rounds).glob("round-*/report.json")):
            found += [f for f in report.parent.iterdir() if f.is_file() and f.suffix in (".json", ".jsonl")]
        # A round stopped midway: what its finished chunks sampled and kept (the round checks, on resume,
        # that the files hold what its progress counted, and else samples the round from its start).
        for progress in sorted((out / rounds).glob("round-*/progress.json")):
            if not (progress.parent / "report.json").is_file():
                found += [progress.parent / name for name in ("kept.jsonl", "progress.json", "samples.jsonl")]
    whole_sweep = (out / "sweep" / "choice.json").is_file()  # written last
    for pattern in CARRIED_FILES + (CARRIED_SWEEP if whole_sweep else ()):
        found += [Path(f) for f in glob.glob(str(out / pattern))]
    # A sweep or ablation run trained to its end (its model written last; in a carried folder, its evaluation
    # complete: it is taken after the last step) and its evaluations, before the sweep is whole.
    for short_runs in ("sweep", "ablation"):
        for run in sorted(p for p in (out / short_runs).glob("*") if p.is_dir() and p.name != "curve"):
            if (run / "model_latest" / "step.json").is_file() or evaluated(
                out / short_runs / "curve", run.name
            ):
                found.append(run / "metrics.jsonl")
    found += [Path(f) for f in glob.glob(str(out / "sweep" / "curve" / "*"))]
    for run in sorted(out.glob("rl-s*")):
        found += rl_carried(run)
    return sorted({f.relative_to(out) for f in found if f.is_file()})


def evaluated(folder: Path, label: str, modes: str = "retool") -> bool:
    """Whether ``label``'s evaluations in ``folder`` (one a mode of ``modes``) are complete."""
    from retool.evaluate.store import summary_path_for

    summaries = [read_json(summary_path_for(eval_output(folder, label, m))) for m in modes.split(",")]
    return all(s and s.get("status") == "complete" for s in summaries)


def rl_carried(run: Path) -> list[Path]:
    """An RL seed's files a resume on another machine needs: its config and metrics, and the checkpoint its
    merged model was last written at (a curve point, or where a sitting stopped the seed; in a carried
    folder, the newest checkpoint it holds); a finished seed (``done.json``) only its config and metrics.
    The trajectory log stays behind (a record, not state)."""
    if (run / "done.json").is_file():
        return [run / "config.toml", run / "metrics.jsonl"]
    done = read_json(run / "model_latest" / "step.json")
    # Complete checkpoints only: a checkpoint's trainer state is written last.
    ckpts = sorted(run.glob("checkpoints/step_*/trainer_state.json"))
    if done is not None:
        ckpts = [c for c in ckpts if c.parent.name == f"step_{done['step']:06d}"]
    elif not (run / "curve").is_dir() or not ckpts:
        return []
    found = [run / "config.toml", run / "metrics.jsonl"]
    if ckpts:
        found += [f for f in ckpts[-1].parent.rglob("*") if f.is_file()]
    return found


def checkpoint_step(run: Path) -> int:
    """The step of the newest complete checkpoint in ``run`` (0 when it has none)."""
    ckpts = sorted(run.glob("checkpoints/step_*/trainer_state.json"))
    return int(ckpts[-1].parent.name.removeprefix("step_")) if ckpts else 0


def carry_out(args: argparse.Namespace) -> None:
    """The run folder's carried files, copied into ``--carry`` where new or changed."""
    if not str(args.carry) or args.smoke:
        return
    for rel in carried(args.out):
        src, dst = args.out / rel, args.carry / rel
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst.with_suffix(dst.suffix + ".tmp"))
            dst.with_suffix(dst.suffix + ".tmp").replace(dst)
    for rounds in CARRIED_ROUNDS:  # a round's progress, once the round finished: nothing resumes from it
        for progress in (args.carry / rounds).glob("round-*/progress.json"):
            if (progress.parent / "report.json").is_file():
                progress.unlink()
    for run in args.carry.glob("rl-s*"):  # a seed's older checkpoints: the newest complete one is enough
        ckpts = sorted(run.glob("checkpoints/step_*/trainer_state.json"))
        if (run / "done.json").is_file():  # finished and evaluated: none is needed
            ckpts.append(run)
        for old in ckpts[:-1]:
            shutil.rmtree(old.parent)


def carry_in(args: argparse.Namespace) -> None:
    """What ``--carry`` holds and the run folder lacks, copied into the run folder."""
    if not str(args.carry) or args.smoke or not args.carry.is_dir():
        return
    copied = 0
    for rel in carried(args.carry):
        dst = args.out / rel
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.carry / rel, dst)
            copied += 1
    if copied:
        log.info("%d files carried from %s into %s", copied, args.carry, args.out)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)


# -- phases run in a child ------------------------------------------------------------------------------------


def phase_coldstart(args: argparse.Namespace) -> None:
    """The cold start (expert iteration from the base model) and SFT -> ``<dir>/model_sft``."""
    from _harness import sft_start
    from retool.pipeline.real_model import resolve_model_path

    out = Path(args.arg[0])
    rounds, budget = int(args.arg[1]), int(args.arg[2])
    extra = [f"recipe.coldstart_rounds={rounds}", f"recipe.coldstart_max_trajectories={budget}"]
    started = time.perf_counter()
    s = settings(args, out, extra)
    sft_start(s, resolve_model_path(s.config.model.name))
    write_json(out / "phase.json", {"seconds": time.perf_counter() - started})


def phase_rl(args: argparse.Namespace) -> None:
    """RL from the SFT model to step ``until`` (resumed from the run's checkpoint), then the merged policy
    -> ``<run>/model_latest``."""
    from retool.components import build_components
    from retool.pipeline.run import local_backend, phase_config, save_hf, with_available_isolation
    from retool.pipeline.settings import seed_overrides
    from retool.recipes.mathematics.task import mathematics_source
    from retool.train.loop import Trainer

    run, until, seed, lr, selection = (
        Path(args.arg[0]),
        int(args.arg[1]),
        args.arg[2],
        args.arg[3],
        args.arg[4],
    )
    sets = [*RL_SETS, *seed_overrides(int(seed)), f"train.steps={until}", f"optimizer.lr={lr}"]
    sets += [f"data.selection={selection}", *args.arg[5:]]  # an ablation's changed settings last
    s = settings(args, run, sets)
    config = phase_config(with_available_isolation(s.config), args.out / "sft" / "model_sft", run)
    source = mathematics_source(config, s.data_dir)
    started = time.perf_counter()
    with build_components(config) as parts:
        trainer = Trainer(
            config, run, resume=(run / "config.toml").is_file(), source=source, components=parts
        )
        summary = trainer.run()
        save_hf(local_backend(parts), run / "model_latest")
    seconds = time.perf_counter() - started
    write_json(run / "model_latest" / "step.json", {"step": summary.last_step, "seconds": seconds})
    if summary.last_step != until:  # stopped by a signal: no curve point may be taken for ``until``
        raise SystemExit(f"RL {run.name} stopped at step {summary.last_step} of {until}; rerun to resume")


def phase_eval(args: argparse.Namespace) -> None:
    """The model at ``path`` greedy on ``per_module`` held-out questions of every module, in ``modes``."""
    from _harness import eval_config, evaluate_model
    from retool.env.mathematics import MathematicsList
    from retool.recipes.mathematics.task import held_out_problems

    label, path, folder, per_module, modes = (
        args.arg[0],
        Path(args.arg[1]),
        Path(args.arg[2]),
        int(args.arg[3]),
        args.arg[4].split(","),
    )
    s = settings(args, folder)
    config = eval_config(s.config, path, folder, len(modes))
    config = config.model_copy(update={"sampling": config.sampling.model_copy(update={"temperature": 0.0})})
    problems = held_out_problems(per_module, s.data_dir)
    source = MathematicsList(problems, shuffle=False, name="mathematics held-out")
    evaluate_model(label, modes, folder, config, problems, "mathematics held-out", 0, source)


def phase_pool_sft(args: argparse.Namespace) -> None:
    """SFT from the base model on a trace file for ``epochs`` epochs -> ``<dir>/model_sft`` (``retool sft
    --data``'s own function)."""
    from retool.pipeline.traces import run_trace_sft

    out, data, epochs = Path(args.arg[0]), Path(args.arg[1]), float(args.arg[2])
    started = time.perf_counter()
    run_trace_sft(settings(args, out, [f"sft.epochs={epochs}"]).config, data, out)
    write_json(out / "phase.json", {"seconds": time.perf_counter() - started})  # epochs: in its sft_report


PHASES = {"coldstart": phase_coldstart, "rl": phase_rl, "eval": phase_eval, "pool-sft": phase_pool_sft}


# -- the plan the parent follows ------------------------------------------------------------------------------


def metrics(run: Path) -> list[dict[str, Any]]:
    from retool.jsonl import read_jsonl_objects

    path = run / "metrics.jsonl"
    return list(read_jsonl_objects(path)) if path.is_file() else []


def sampled_trajectories(run: Path) -> int:
    """Trajectories RL sampled (every dynamic-sampling round), from its metrics."""
    return int(sum(float(m.get("task/trajectories", 0.0) or 0.0) for m in metrics(run)))


def evaluate(
    args: argparse.Namespace, label: str, path: Path, folder: Path, per_module: int, modes: str
) -> None:
    if evaluated(folder, label, modes):
        return
    log.info("evaluating %s (%s) on %d a module", label, modes, per_module)
    child(args, "eval", label, str(path), str(folder), str(per_module), modes)


def coldstart(args: argparse.Namespace) -> Path:
    sft = args.out / "sft"
    if not (sft / "phase.json").is_file():  # written after model_sft is whole
        log.info("cold start: expert iteration, %d rounds, then SFT", args.coldstart_rounds)
        child(args, "coldstart", str(sft), str(args.coldstart_rounds), "0")
    return sft / "model_sft"


def train_to(
    args: argparse.Namespace,
    run: Path,
    until: int,
    seed: int,
    lr: str,
    selection: str,
    changed: tuple[str, ...] = (),
) -> None:
    done = read_json(run / "model_latest" / "step.json")
    if done is None or done["step"] != until:
        log.info(
            "RL %s: to step %d (lr %s, %s%s)",
            run.name,
            until,
            lr,
            selection,
            "".join(f", {c}" for c in changed),
        )
        child(args, "rl", str(run), str(until), str(seed), lr, selection, *changed)


def sweep(args: argparse.Namespace) -> str:
    """Short runs, one per learning rate, and one in epoch order; the rate chosen."""
    choice = read_json(args.out / "sweep" / "choice.json")
    if choice:
        return str(choice["lr"])
    lrs = args.lrs.split(",")
    rows = {}
    for lr in lrs:
        run = args.out / "sweep" / f"lr{lr}"
        label = f"lr{lr}"
        if not carried_run(run, args.sweep_steps, args.out / "sweep" / "curve", label):
            train_to(args, run, args.sweep_steps, 0, lr, "pass_rate")
        evaluate(
            args, label, run / "model_latest", args.out / "sweep" / "curve", args.curve_per_module, "retool"
        )
        rows[lr] = {
            **run_summary(metrics(run)),
            "held_out": held_out_mean(args.out / "sweep" / "curve", label),
        }
    middle = lrs[len(lrs) // 2]
    if not carried_run(args.out / "sweep" / "epoch", args.sweep_steps, args.out / "sweep" / "curve", None):
        train_to(args, args.out / "sweep" / "epoch", args.sweep_steps, 0, middle, "epoch")
    kept = [lr for lr in lrs if not rows[lr]["collapsed"]] or lrs
    # Judged on held-out questions, not the train accuracy: the pass-rate selection steers draws toward
    # problems near a 50% pass rate, so a rate that learns faster can show a lower train accuracy.
    best = max(kept, key=lambda lr: (rows[lr]["held_out"], rows[lr]["late_accuracy"]))
    write_json(args.out / "sweep" / "choice.json", {"lr": best, "runs": rows})
    carry_out(args)
    return best


def carried_run(run: Path, steps: int, curve: Path, label: str | None) -> bool:
    """Whether a sweep or ablation run finished on another machine: its metrics (every step) and its
    evaluation in ``curve`` (when it has one) were carried, its model was not; nothing needs the model after
    them."""
    if (run / "model_latest" / "step.json").is_file() or len(metrics(run)) < steps:
        return False
    return label is None or evaluated(curve, label)


def ablation(args: argparse.Namespace, lr: str) -> None:
    """``ABLATIONS``: the same start, seed and rate, one stability setting changed a run; each run's model
    on the held-out slice."""
    curve = args.out / "ablation" / "curve"
    for name in ablation_runs(args):
        run = args.out / "ablation" / name
        if not carried_run(run, args.ablation_steps, curve, name):
            train_to(args, run, args.ablation_steps, 0, lr, "pass_rate", ABLATIONS[name])
            evaluate(args, name, run / "model_latest", curve, args.curve_per_module, "retool")
    carry_out(args)


def held_out_mean(folder: Path, label: str) -> float:
    """Retool accuracy of a curve evaluation: the mean of the two splits' module means."""
    from mathematics import SPLITS, module_stats, split_mean
    from retool.evaluate.store import read_problem_records

    stats = module_stats(read_problem_records(eval_output(folder, label, "retool")))
    return sum(split_mean(stats, sp, "accuracy") for sp in SPLITS) / len(SPLITS)


def run_summary(ms: list[dict[str, Any]]) -> dict[str, Any]:
    """Train accuracy over the last half of a run's steps, informative share, and whether it collapsed."""
    if not ms:
        return {"late_accuracy": 0.0, "informative_share": 0.0, "collapsed": True, "steps": 0}
    late = ms[len(ms) // 2 :]
    start_calls = float(ms[0].get("tool/code_share") or 0.0)
    collapsed = any(
        float(m.get("tool/code_share") or 0.0) < start_calls - COLLAPSE_POINTS
        or float(m.get("task/void_turn_rate") or 0.0) >= VOID_BOUND
        for m in ms
    )
    return {
        "late_accuracy": mean([float(m.get("task/correct_rate") or 0.0) for m in late]),
        "informative_share": mean([float(m.get("sampling/informative_share") or 0.0) for m in ms]),
        "collapsed": collapsed,
        "steps": len(ms),
    }


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def still_rising(ms: list[dict[str, Any]]) -> bool:
    """The last 20 steps' train accuracy above the 20 before by more than 2 points."""
    acc = [float(m.get("task/correct_rate") or 0.0) for m in ms]
    return len(acc) >= 40 and mean(acc[-20:]) > mean(acc[-40:-20]) + 0.02


def informative_groups(ms: list[dict[str, Any]]) -> int:
    """Groups whose rewards differed (the only ones with a gradient), over a run's steps."""
    return int(sum(float(m.get("sampling/groups_informative") or 0.0) for m in ms))


def next_target(args: argparse.Namespace, target: int, ms: list[dict[str, Any]]) -> int:
    """Where a seed that reached ``target`` trains to next (``target`` itself: it is finished). One chunk
    more until it has had ``--min-informative`` informative groups (the issue's measure of "long enough to
    judge"), then two more while the train accuracy still rises; never past ``--max-steps``."""
    if target >= args.max_steps:
        return target
    if informative_groups(ms) < args.min_informative:
        return min(target + args.chunk, args.max_steps)
    if still_rising(ms):
        return min(target + 2 * args.chunk, args.max_steps)
    return target


def rl_seed(args: argparse.Namespace, seed: int, lr: str) -> Path:
    """RL in chunks, the held-out curve after each, to ``next_target``'s end; then the final model's
    evaluation, and ``done.json``."""
    run = args.out / f"rl-s{seed}"
    done = read_json(run / "done.json")
    if done is not None:  # finished and evaluated, here or on the machine it was carried from
        return run
    # An extension an earlier sitting decided (trained past --steps) stands: a rerun goes on to its end.
    step, target = 0, max(args.steps, trained_step(run))
    while step < target:
        step = min(step + args.chunk, target)
        # A curve point taken, and the run trained past it (here, or on the machine the run was carried
        # from), is kept; otherwise train to it (resuming from the newest checkpoint) and take it.
        if not (curve_point_done(run, step) and trained_step(run) >= step):
            train_to(args, run, step, seed, lr, "pass_rate")
            evaluate(
                args, f"step{step:04d}", run / "model_latest", run / "curve", args.curve_per_module, "retool"
            )
        if step == target:
            target = next_target(args, target, metrics(run))
    train_to(args, run, target, seed, lr, "pass_rate")  # the final model, where a carried run lacks it
    evaluate(args, run.name, run / "model_latest", args.out / "final", args.final_per_module, FINAL_MODES)
    write_json(run / "done.json", {"step": target, "informative_groups": informative_groups(metrics(run))})
    carry_out(args)
    return run


def trained_step(run: Path) -> int:
    """How far ``run`` has trained: its merged model's step or its newest checkpoint's, whichever is later."""
    done = read_json(run / "model_latest" / "step.json")
    return max(done["step"] if done else 0, checkpoint_step(run))


def curve_point_done(run: Path, step: int) -> bool:
    return evaluated(run / "curve", f"step{step:04d}")


def ei_budget(args: argparse.Namespace, first: Path) -> int:
    """Expert iteration's sampled trajectories: the cold start's and the first RL seed's."""
    cold = read_json(args.out / "sft" / "coldstart" / "report.json") or {}
    return int(cold.get("sampled", 0)) + sampled_trajectories(first)


def expert_iteration(args: argparse.Namespace, trajectories: int) -> Path:
    """The cold start's expert iteration continued to ``trajectories`` sampled in all."""
    ei = args.out / "ei"
    if not (ei / "phase.json").is_file():  # written after model_sft is whole
        if not (ei / "coldstart").is_dir():  # the cold start's rounds, read back; copied whole or not at all
            partial = ei / "coldstart.partial"
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(args.out / "sft" / "coldstart", partial)
            partial.replace(ei / "coldstart")
        log.info("expert iteration continued to %d sampled trajectories", trajectories)
        child(args, "coldstart", str(ei), "1000", str(trajectories))
    return ei / "model_sft"


def pool_sft(args: argparse.Namespace) -> Path:
    """Expert iteration's whole pool, SFT from the start for the epochs the cold start's SFT gave its own
    pool (its fixed steps over its traces) -> ``ei-pool/model_sft``; trained once, and not at all where its
    final evaluation is already complete (carried from another machine)."""
    folder = args.out / "ei-pool"
    if (
        not evaluated(args.out / "final", "ei-pool", FINAL_MODES) and not (folder / "phase.json").is_file()
    ):  # written after model_sft is whole
        cold = read_json(args.out / "sft" / "coldstart" / "report.json")
        sft = settings(args, folder).config.sft
        epochs = sft.steps * sft.batch_size / int(cold["kept"])
        log.info("expert iteration's pool: SFT from the start for %.2f epochs (the cold start's)", epochs)
        child(
            args, "pool-sft", str(folder), str(args.out / "ei" / "coldstart" / "train.jsonl"), f"{epochs:.4f}"
        )
    return folder / "model_sft"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.phase:
        PHASES[args.phase](args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    carry_in(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.report:  # a look at a run still going (or stopped): nothing is sampled or trained
        choice = read_json(args.out / "sweep" / "choice.json") or {}
        first = args.out / f"rl-s{seeds[0]}"  # finished: expert iteration's budget is known
        budget = ei_budget(args, first) if (first / "done.json").is_file() else 0
        publish(args, seeds, str(choice.get("lr", "-")), budget)
        return
    sft = coldstart(args)
    evaluate(args, "step0000", sft, args.out / "curve-start", args.curve_per_module, "retool")
    lr = sweep(args)
    first = rl_seed(args, seeds[0], lr)  # expert iteration's budget is its sampled trajectories
    evaluate(args, "sft", sft, args.out / "final", args.final_per_module, FINAL_MODES)
    budget = ei_budget(args, first)
    ei = expert_iteration(args, budget)
    evaluate(args, "ei", ei, args.out / "final", args.final_per_module, FINAL_MODES)
    evaluate(args, "ei-pool", pool_sft(args), args.out / "final", args.final_per_module, FINAL_MODES)
    ablation(args, lr)
    # The other seeds last: an unfinished seed survives a sitting only where its run folder does (its
    # checkpoint is not carried), and a seed outlasts a sitting; expert iteration's rounds and the ablation's
    # runs are carried as each finishes, so they go first and a lost machine loses none of them.
    publish(args, seeds, lr, budget)
    for seed in seeds[1:]:
        rl_seed(args, seed, lr)
    publish(args, seeds, lr, budget)


def publish(args: argparse.Namespace, seeds: list[int], lr: str, budget: int) -> None:
    """The report into the run folder, printed, and with ``--write`` into docs/results."""
    from _mathematics_rl_report import report, summary

    text = report(args, seeds, lr, budget)
    (args.out / "mathematics_rl.md").write_text(text + "\n")
    short = summary(args, seeds, lr)
    (args.out / "mathematics_rl_summary.md").write_text(short + "\n")
    print(text)
    if args.write:
        from _results import RESULTS, render_pages, write_result

        page = write_result(
            "mathematics_rl.md", "RL on DeepMind Mathematics with SmolLM2-135M: learning curves", text
        )
        for png in ("mathematics_rl_curve.png", "mathematics_rl_instruments.png"):
            shutil.copyfile(args.out / png, RESULTS / png)
        write_result("mathematics_rl_summary.md", "RL on DeepMind Mathematics: the summary", short)
        log.info("wrote %s, its summary and its curves", page)
        render_pages()


if __name__ == "__main__":
    main()
