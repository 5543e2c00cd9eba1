"""The real-model demo as a bench: run ``retool demo --model smollm2`` (or read a finished run) and report
its before/after table, gain and time split, with the wall time, peak memory and load of the run.

    python bench/real_model_demo.py [--out runs/demo-smollm2] [--set KEY=VALUE ...] [--write]
    python bench/real_model_demo.py --from runs/demo-smollm2 [--write]     # a run that already finished

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
import subprocess
import sys
import time
from pathlib import Path

from _results import recording, write_printed  # bench/, on sys.path when run as a script


def run_demo(out: Path, overrides: list[str]) -> float:
    """``retool demo --model smollm2 --out OUT`` in a child process (its output straight to the terminal,
    not into the results file); returns its wall seconds."""
    cmd = [sys.executable, "-m", "retool", "demo", "--model", "smollm2", "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"retool demo exited with status {proc.returncode}; nothing written")
    return time.monotonic() - start


def summary(run: Path, wall: float | None) -> str:
    """The lines this bench prints: the run's settings and machine facts, then its report.md."""
    report = json.loads((run / "report.json").read_text())
    facts, timings = report.get("machine", {}), report.get("timings", {})
    settings = report.get("settings", {})
    config = settings.get("config", {})
    lines = [
        f"- run: retool demo --model {config.get('model', {}).get('name', '?')}, seed {settings.get('seed')}, "
        f"{config.get('train', {}).get('steps', '?')} RL steps, sampler {config.get('backend', {}).get('sampler')}, "
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/demo-smollm2"), help="the run folder")
    ap.add_argument("--from", dest="source", type=Path, default=None, help="read this finished run instead")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to retool demo --set")
    ap.add_argument("--write", action="store_true", help="also write docs/results/real_model_demo.md")
    args = ap.parse_args(argv)
    run = args.source or args.out
    with recording(args.write) as rec:
        wall = run_demo(run, args.set) if args.source is None else None
        if not (run / "report.json").is_file():
            raise SystemExit(f"{run} holds no report.json: not a finished demo run")
        print(summary(run, wall), end="")
    if args.write:
        title = "A real pretrained model: `retool demo --model smollm2` (`bench/real_model_demo.py`)"
        note = (
            "" if wall is not None else "Read from a finished run (`--from`): the load line is the reading's."
        )
        write_printed("real_model_demo.md", title, rec, note, markdown=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
