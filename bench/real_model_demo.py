"""The real-model demo as a bench: run ``retool demo --recipe smollm2`` (or read a finished run) and report
its before/after table, gain and time split, with the wall time, peak memory and load of the run.

    python bench/real_model_demo.py [--out runs/demo-smollm2] [--set KEY=VALUE ...] [--write]
    python bench/real_model_demo.py --from runs/demo-smollm2 [--write]     # a run that already finished
    python bench/real_model_demo.py --precisions float32,bfloat16 [--write]  # the demo's gain in each

``--precisions`` runs the demo once per compute dtype (``--set backend.dtype=D``, into ``OUT-D``; a folder
that holds a finished run is read instead) and reports each run's RL gain over SFT with its paired 95%
interval, side by side: whether the bf16 gain lies within the fp32 gain's interval, and their difference.
``--write`` then writes docs/results/real_model_demo_precision.md. Each run is a whole demo (the fp32 one
as long as the plain bench's).

The demo runs as a child process with ``OMP_WAIT_POLICY=PASSIVE`` (unless set), so that on a busy machine
torch's idle threads sleep instead of spinning against the other jobs; its wall time is this bench's clock,
its peak RSS and thread count come from the run's ``report.json`` (``machine``). The rest is the demo's own
``report.md``: the table (base zero-shot, SFT, RL), the paired gain, the time split per phase.
``--write`` also writes it to docs/results/real_model_demo.md and refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _harness import demo_command, pts, timed_demo  # bench/, on sys.path when run as a script
from _results import recording, write_printed


def run_demo(out: Path, overrides: list[str]) -> float:
    """``retool demo --recipe smollm2 --out OUT`` in a child process (its output straight to the terminal,
    not into the results file); returns its wall seconds."""
    sets = [x for item in overrides for x in ("--set", item)]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    run = timed_demo(demo_command("--recipe", "smollm2", "--out", str(out), *sets), env=env)
    if run.returncode != 0:
        raise SystemExit(f"retool demo exited with status {run.returncode}; nothing written")
    return run.wall_s


def summary(run: Path, wall: float | None) -> str:
    """The lines this bench prints: the run's settings and machine facts, then its report.md."""
    report = json.loads((run / "report.json").read_text())
    facts, timings = report.get("machine", {}), report.get("timings", {})
    settings = report.get("settings", {})
    config = settings.get("config", {})
    lines = [
        f"- run: model {config.get('model', {}).get('name', '?')}, seed {settings.get('seed')}, "
        f"{config.get('train', {}).get('steps', '?')} RL steps, engine {config.get('backend', {}).get('engine')}, "
        f"prefix cache {config.get('backend', {}).get('prefix_cache_mb')} MB",
        f"- machine (report.json): {facts.get('cpu')}, {facts.get('cpus')} CPUs, {facts.get('memory_gib')} GiB, "
        f"torch {facts.get('torch')} with {facts.get('torch_threads')} threads; peak RSS "
        f"{facts.get('peak_rss_gib')} GiB; load average at the end {facts.get('load_average')}",
        f"- the demo's own total: {timings.get('total', float('nan')):.0f} s; RL share "
        f"{100 * timings.get('rl_share', float('nan')):.1f}%",
    ]
    if wall is not None:
        lines.append(
            f"end to end (this bench's clock, start-up included): {wall:.0f} s = {wall / 60:.1f} min"
        )
    return "\n".join(lines) + "\n\n" + (run / "report.md").read_text().strip() + "\n"


def gain_of(run: Path) -> tuple[float, float, float, int]:
    """A finished run's RL gain over SFT (retool mode, Average@N): (gain, CI low, CI high, problems)."""
    gain = json.loads((run / "report.json").read_text())["gain"]["average_at_n"]
    lo, hi = gain["ci95"]
    return float(gain["gain"]), float(lo), float(hi), int(gain["problems"])


def precision_lines(runs: dict[str, Path], walls: dict[str, float | None]) -> str:
    """Each dtype's gain with its interval, its wall time, then how the others compare with the first's."""
    gains = {d: gain_of(r) for d, r in runs.items()}
    lines = [
        "| backend.dtype | RL - SFT, Average@N | 95% paired CI | problems | wall |",
        "|---|---|---|---|---|",
    ]
    for dtype, (g, lo, hi, n) in gains.items():
        wall = walls.get(dtype)
        lines.append(
            f"| {dtype} | {pts(g)} points | {pts(lo)} to {pts(hi)} | {n} | "
            + ("read from a finished run" if wall is None else f"{wall / 60:.1f} min")
            + " |"
        )
    ref, (g0, lo0, hi0, _) = next(iter(gains.items()))
    for dtype, (g, _, _, _) in list(gains.items())[1:]:
        inside = "within" if lo0 <= g <= hi0 else "outside"
        lines.append(
            f"\n{dtype}'s gain lies {inside} the {ref} gain's interval; difference {pts(g - g0)} points."
        )
    return "\n".join(lines) + "\n"


def run_precisions(args: argparse.Namespace) -> None:
    """``--precisions``: the demo once per dtype (a finished run folder is read), then the comparison."""
    runs = {d: Path(f"{args.out}-{d}") for d in args.precisions.split(",")}
    walls: dict[str, float | None] = {}
    for dtype, run in runs.items():
        done = (run / "report.json").is_file()
        walls[dtype] = None if done else run_demo(run, [*args.set, f"backend.dtype={dtype}"])
        print(f"### backend.dtype = {dtype}\n\n{summary(run, walls[dtype])}")
    print(precision_lines(runs, walls), end="")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/demo-smollm2"), help="the run folder")
    ap.add_argument("--from", dest="source", type=Path, default=None, help="read this finished run instead")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to retool demo --set")
    ap.add_argument("--write", action="store_true", help="also write docs/results/real_model_demo.md")
    ap.add_argument("--precisions", default=None, help="e.g. float32,bfloat16: the demo once per dtype")
    args = ap.parse_args(argv)
    if args.precisions:
        with recording(args.write) as rec:
            run_precisions(args)
        if args.write:
            title = (
                "The SmolLM2 demo's gain in each compute precision (`bench/real_model_demo.py --precisions`)"
            )
            write_printed("real_model_demo_precision.md", title, rec, markdown=True)
        return 0
    run = args.source or args.out
    with recording(args.write) as rec:
        wall = run_demo(run, args.set) if args.source is None else None
        if not (run / "report.json").is_file():
            raise SystemExit(f"{run} holds no report.json: not a finished demo run")
        print(summary(run, wall), end="")
    if args.write:
        title = "A real pretrained model: `retool demo --recipe smollm2` (`bench/real_model_demo.py`)"
        note = (
            "" if wall is not None else "Read from a finished run (`--from`): the load line is the reading's."
        )
        write_printed("real_model_demo.md", title, rec, note, markdown=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
