"""Benchmark: how long `retool demo` takes end to end, and how much of the machine it uses.

Each run is the command a user types, ``python -m retool demo --out DIR``, in a fresh process: wall time
from start to exit, CPU time of the whole process tree (the demo, its replicas, its sandbox and verifier
processes: ``getrusage(RUSAGE_CHILDREN)``, what ``/usr/bin/time`` reports as "Percent of CPU"), the
machine's busy CPU time over the same wall time (``/proc/stat``: the cross-check), peak memory of the
largest process, the machine's load average before and after (other jobs inflate every figure: compare
runs taken together), the demo's own phase split (``phases.json``) and gain, and digests of its results
table (``report.md`` up to the timings) and of the table's rows evaluated before RL (base and SFT): those
repeat bit for bit from run to run, the RL rows do not (rollouts run concurrently with the sandbox, so which
sequences share a decode batch depends on timing: ``tools/same_results.py`` is the exact comparison).

    python tools/demo_speed.py                          # this checkout, one run
    python tools/demo_speed.py --runs 2 --src /path/to/other/checkout/src --write
                                                        # interleaved with another checkout (before/after)

``--src PATH`` (repeatable) adds an arm that runs the demo from another source tree (``PYTHONPATH``); the
arms alternate run by run. ``--write`` writes ``docs/results/demo_speed.md`` and refills the pages' blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benches' shared helpers

from _harness import ci_cell, demo_command, revision, timed_demo
from _results import render_pages, write_result

REPO = Path(__file__).resolve().parents[1]
PHASES = ("model", "sft", "eval_sft", "rl", "eval_rl")


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has been busy since boot (``/proc/stat``; None elsewhere).

    The cross-check of the tree's CPU time: on a quiet machine the two agree; the machine's figure above the
    tree's means other jobs ran, or part of the demo's work escaped ``getrusage`` (as the strict sandbox's
    did while bwrap's reaper process was never waited for)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already inside user


def results_digest(report_md: Path, before_rl: bool = False) -> str | None:
    """sha256 (12 hex digits) of the demo's results: ``report.md`` before its timings table (the part a rerun
    of the same code on the same machine could repeat), or with ``before_rl`` only the rows of the models
    evaluated before RL (base, SFT)."""
    if not report_md.is_file():
        return None
    results = report_md.read_text().split("\n| phase |", 1)[0]
    if before_rl:
        results = "\n".join(x for x in results.splitlines() if x.startswith(("| base ", "| sft ")))
    return hashlib.sha256(results.encode()).hexdigest()[:12]


def run_once(src: Path, out: Path, overrides: list[str]) -> dict[str, Any]:
    """One `retool demo` in a fresh process from source tree ``src``; its figures."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    command = demo_command("--out", str(out), *[x for item in overrides for x in ("--set", item)])
    load_before = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before = machine_busy_seconds()
    run = timed_demo(command, env=env, log=out.parent / f"{out.name}.log")
    wall = run.wall_s
    busy_after = machine_busy_seconds()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row: dict[str, Any] = {
        "revision": revision(src),
        "exit": run.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "cpu_percent": round(100 * cpu / wall),
        "machine_percent": (
            round(100 * (busy_after - busy_before) / wall)
            if busy_before is not None and busy_after is not None
            else None
        ),
        "peak_rss_mb": round(after.ru_maxrss / 1024),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    phases = out / "phases.json"
    if phases.is_file():
        row["phases"] = {k: v["seconds"] for k, v in json.loads(phases.read_text()).items()}
    row["results"] = results_digest(out / "report.md")
    row["before_rl"] = results_digest(out / "report.md", before_rl=True)
    report = out / "report.json"
    if report.is_file():
        gain = json.loads(report.read_text())["gain"]
        row["gain"] = gain["average_at_n"]["gain"]
        row["ci95"] = gain["average_at_n"]["ci95"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | code | wall | CPU | machine busy | peak RSS | load before / after | "
        + " | ".join(PHASES)
        + " | gain [95% CI] | rows before RL (sha256) | results (sha256) |",
        "|" + "---|" * (9 + len(PHASES)),
    ]
    for k, r in enumerate(rows):
        ph = r.get("phases", {})
        gain = ci_cell(r["gain"], *r["ci95"]) if "gain" in r else "-"
        minutes, seconds = divmod(r["wall_s"], 60)
        busy = f"{r['machine_percent']}%" if r.get("machine_percent") is not None else "-"
        lines.append(
            f"| {k + 1} | {r['revision']} | {int(minutes)} min {seconds:04.1f} s | {r['cpu_percent']}% "
            f"| {busy} | {r['peak_rss_mb']} MB | {r['load_before']:.2f} / {r['load_after']:.2f} | "
            + " | ".join(f"{ph[p]:.1f} s" if p in ph else "-" for p in PHASES)
            + f" | {gain} | {r.get('before_rl') or '-'} | {r.get('results') or '-'} |"
        )

    def same(key: str) -> str:
        digests = {r.get(key) for r in rows}
        return "yes" if len(digests) == 1 and None not in digests else "no"

    lines += [
        "",
        f"Every run printed the same rows before RL (base, SFT): {same('before_rl')}; the same whole results"
        f" table (report.md before its timings): {same('results')}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-demo-speed"))
    parser.add_argument("--runs", type=int, default=1, help="runs of each arm (alternating)")
    parser.add_argument(
        "--src", type=Path, action="append", default=[], help="another source tree to time too"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a demo override")
    parser.add_argument("--write", action="store_true", help="write docs/results/demo_speed.md")
    args = parser.parse_args(argv)
    arms = [*args.src, REPO / "src"]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(args.runs):
        for arm, src in enumerate(arms):
            row = run_once(src.resolve(), args.out / f"run{run}-arm{arm}", args.set)
            print(json.dumps(row), flush=True)
            rows.append(row)
    text = table(rows)
    print(text)
    (args.out / "demo_speed.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.write:
        write_result("demo_speed.md", "`retool demo` end to end: `tools/demo_speed.py`", text)
        for page in render_pages():
            print(f"refilled {page}", file=sys.stderr)
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
