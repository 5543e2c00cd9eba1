"""Verifier throughput and worst-case latency, in one run (well under a minute on 2 cores).

    python bench/verify.py [--seconds 4] [--workers 2] [--timeout 2] [--write]

Prints checks/s for math-verify in-process (unbounded, the chapter's way) and through the
``retool.reward.Verifier`` pool (sequential and concurrent), their ratio, and the latency of each hostile
answer through the pool (soft in-worker timeout, and the hard kill path with the soft alarm disabled).
``--write`` also writes what it printed to docs/results/verify.md and refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from _results import recording, write_printed  # bench/, on sys.path when run as a script
from retool.reward import Verifier, answers_equivalent

PAIRS = [
    ("1/2", "0.5"),
    ("\\frac{1}{2}", "0.5"),
    ("x+1", "1+x"),
    ("128", "128.0"),
    ("3", "\\sqrt{9}"),
    ("2", "3"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("(1,2)", "(1, 2)"),
    ("x^2-1", "(x-1)(x+1)"),
    ("204", "204"),
]

HOSTILE = {
    "nested braces 10 kB": "{" * 5000 + "1" + "}" * 5000,
    "3000 x \\boxed{": "\\boxed{" * 3000 + "1" + "}" * 3000,
    "10^{10^{10}}": "10^{10^{10}}",
    "10^5-digit number": "9" * 100_000,
    "(10^{6})!": "(10^{6})!",
}


def rate(fn, seconds: float) -> tuple[float, int]:
    n, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        pred, ref = PAIRS[n % len(PAIRS)]
        fn(pred, ref)
        n += 1
    return n / (time.monotonic() - start), n


def concurrent_rate(verifier: Verifier, seconds: float) -> tuple[float, int]:
    async def run() -> int:
        n, start = 0, time.monotonic()
        while time.monotonic() - start < seconds:
            batch = [PAIRS[(n + i) % len(PAIRS)] for i in range(4 * verifier.workers)]
            await asyncio.gather(*[verifier.averify(p, r) for p, r in batch])
            n += len(batch)
        return n

    start = time.monotonic()
    n = asyncio.run(run())
    return n / (time.monotonic() - start), n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="time per throughput measurement")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=2.0, help="per-check timeout for the hostile inputs")
    parser.add_argument("--write", action="store_true", help="also write docs/results/verify.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the verifier warns on every timeout; the table says it all
    with recording(args.write) as rec:
        run(args)
    if args.write:
        write_printed("verify.md", "Verifier throughput and hostile answers: `bench/verify.py`", rec)


def run(args: argparse.Namespace) -> None:
    """Throughput in-process and through the pool, then each hostile answer's latency; prints both."""
    answers_equivalent("1", "1")  # import and warm sympy before timing
    in_rate, in_n = rate(answers_equivalent, args.seconds)

    t0 = time.monotonic()
    with Verifier(workers=args.workers, timeout=args.timeout) as verifier:
        verifier.verify("1", "1")
        verifier.verify("2", "2")
        startup = time.monotonic() - t0
        seq_rate, seq_n = rate(verifier.verify, args.seconds)
        con_rate, con_n = concurrent_rate(verifier, args.seconds)

        print(
            f"\nthroughput ({len(PAIRS)} typical pairs, cycled; {args.workers} workers; pool start-up {startup:.1f}s)"
        )
        print(f"{'mode':<34}{'checks':>8}{'checks/s':>10}{'vs in-process':>15}")
        for name, r, n in [
            ("in-process (unbounded)", in_rate, in_n),
            ("pool, sequential", seq_rate, seq_n),
            (f"pool, concurrent (asyncio x{4 * args.workers})", con_rate, con_n),
        ]:
            print(f"{name:<34}{n:>8}{r:>10.1f}{r / in_rate:>14.2f}x")

        print(f"\nhostile answers (pred = hostile, ref = '7'; timeout {args.timeout:.1f}s)")
        print(f"{'input':<24}{'status':>9}{'latency s':>11}   path")
        worst = 0.0
        for name, text in HOSTILE.items():
            start = time.monotonic()
            outcome = verifier.verify(text, "7")
            elapsed = time.monotonic() - start
            worst = max(worst, elapsed)
            print(f"{name:<24}{outcome.status:>9}{elapsed:>11.2f}   {outcome.detail[:50] or '-'}")
        stats = verifier.stats
    # The hard path: the in-worker alarm disabled, so only the parent's SIGKILL can stop the check.
    with Verifier(workers=1, timeout=args.timeout, soft_fraction=100.0) as hard:
        hard.verify("1", "1")
        start = time.monotonic()
        outcome = hard.verify(HOSTILE["10^{10^{10}}"], "7")
        elapsed = time.monotonic() - start
        worst = max(worst, elapsed)
        start = time.monotonic()
        after = hard.verify("x+1", "1+x")
        recover = time.monotonic() - start
        print(
            f"{'hard kill (10^{10^{10}})':<24}{outcome.status:>9}{elapsed:>11.2f}   worker killed and replaced"
        )
        print(
            f"{'next check (respawn)':<24}{after.status:>9}{recover:>11.2f}   includes the new worker's start-up"
        )
    print(f"\nworst-case hostile latency: {worst:.2f}s (timeout {args.timeout:.1f}s)")
    print(f"pool stats: {stats.as_dict()}")


if __name__ == "__main__":
    main()
