"""Benchmark: the chapter's subprocess executor vs. the fork-server (strict isolation), in one run.

Two tasks: ``print(1)`` and a typical model call (sympy solve of a small polynomial system + a numpy
determinant). For each executor and task: p50/p90 latency of sequential calls (one at a time), and
executions per second with 2 workers (2 calls in flight). Prints the ratios and the issue-3 targets:
sympy task p50 >= 20x lower and throughput >= 10x higher for the fork-server; print(1) no slower.

    python bench/sandbox.py [--n-seq 20] [--n-par 16] [--isolation strict] [--write]

``--write`` also writes what it printed to docs/results/sandbox.md and refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from collections.abc import Callable

from _results import recording, write_printed  # bench/, on sys.path when run as a script
from retool.sandbox import (
    ExecResult,
    Executor,
    ForkServerExecutor,
    SandboxPreimportError,
    SubprocessExecutor,
)

TASKS = {
    "print(1)": "print(1)",
    "sympy+numpy": (
        "import sympy as sp\n"
        "import numpy as np\n"
        "x, y = sp.symbols('x y')\n"
        "sol = sp.solve([x**2 + y**2 - 25, x - y - 1], [x, y])\n"
        "m = np.array([[2.0, 1, 0], [1, 3, 1], [0, 1, 4]])\n"
        "print(sol, round(float(np.linalg.det(m)), 6))\n"
    ),
}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _check(r: ExecResult, name: str) -> None:
    if not r.ok:
        raise SystemExit(f"benchmark task {name!r} failed: {r.stderr or r.returncode}")


def measure(ex: Executor, name: str, code: str, n_seq: int, n_par: int) -> dict[str, float]:
    _check(ex.run(code), name)  # warm-up (page cache, first fork)
    lat = []
    for _ in range(n_seq):
        t = time.perf_counter()
        r = ex.run(code)
        lat.append(time.perf_counter() - t)
        _check(r, name)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        t = time.perf_counter()
        results = list(pool.map(lambda _: ex.run(code), range(n_par)))
        elapsed = time.perf_counter() - t
    for r in results:
        _check(r, name)
    return {"p50": _pct(lat, 0.5), "p90": _pct(lat, 0.9), "eps": n_par / elapsed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-seq", type=int, default=15, help="sequential calls per task (latency)")
    ap.add_argument("--n-par", type=int, default=12, help="calls with 2 in flight (throughput), subprocess")
    ap.add_argument("--par-factor", type=int, default=4, help="the fork-server does n-par x this many")
    ap.add_argument("--isolation", default="strict", choices=["strict", "none"])
    ap.add_argument("--write", action="store_true", help="also write docs/results/sandbox.md")
    args = ap.parse_args(argv)
    # stderr too: the start-up times and an isolation fallback are part of what the file must show.
    with recording(args.write, stderr=True) as rec:
        rc = run(args)
    if args.write:
        write_printed("sandbox.md", "Sandbox executors: `bench/sandbox.py`", rec)
    return rc


def run(args: argparse.Namespace) -> int:
    """Both executors on both tasks; prints the table, the ratios and the targets (0 when all are met)."""
    makers: dict[str, Callable[[], Executor]] = {
        "subprocess": lambda: SubprocessExecutor(timeout=30, max_concurrency=2),
        f"forkserver-{args.isolation}": lambda: ForkServerExecutor(
            timeout=30, workers=2, isolation=args.isolation
        ),
    }
    table: dict[tuple[str, str], dict[str, float]] = {}
    for ex_name, make in makers.items():
        t = time.perf_counter()
        try:
            ex = make()
        except SandboxPreimportError as exc:
            # The sandbox cannot import what the tasks need (e.g. an environment it cannot see): a
            # benchmark of it would measure import errors, so stop and say why.
            raise SystemExit(f"{ex_name} cannot start: {exc}") from None
        with ex:
            start_s = time.perf_counter() - t
            if isinstance(ex, ForkServerExecutor) and ex.isolation != args.isolation:
                print(
                    f"WARNING: running with isolation={ex.isolation}: {ex.isolation_reason}", file=sys.stderr
                )
            n_par = args.n_par * (args.par_factor if isinstance(ex, ForkServerExecutor) else 1)
            for task, code in TASKS.items():
                table[(ex_name, task)] = measure(ex, task, code, args.n_seq, n_par)
        print(f"{ex_name}: started in {start_s:.2f}s", file=sys.stderr)

    names = list(makers)
    print(f"{'executor':22s} {'task':12s} {'p50 ms':>9s} {'p90 ms':>9s} {'exec/s (2 workers)':>19s}")
    for (ex_name, task), m in table.items():
        print(f"{ex_name:22s} {task:12s} {m['p50'] * 1e3:9.1f} {m['p90'] * 1e3:9.1f} {m['eps']:19.1f}")
    sub, fs = names
    print()
    ok_all = True
    for task in TASKS:
        a, b = table[(sub, task)], table[(fs, task)]
        lat_ratio = a["p50"] / b["p50"]
        thr_ratio = b["eps"] / a["eps"]
        print(f"{task:12s} p50 {sub}/{fs} = {lat_ratio:6.1f}x   throughput {fs}/{sub} = {thr_ratio:6.1f}x")
        if task == "sympy+numpy":
            targets = [("p50 >= 20x lower", lat_ratio >= 20), ("throughput >= 10x higher", thr_ratio >= 10)]
        else:
            targets = [("no slower (p50)", lat_ratio >= 1.0)]
        for label, ok in targets:
            ok_all &= ok
            print(f"    target {label}: {'MET' if ok else 'NOT MET'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
