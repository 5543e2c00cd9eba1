"""Benchmark: what measuring the KL to the starting policy (``policy/ref_kl``) costs a training call, and so
an RL step.

The local backend measures it with one more forward per micro-batch, without gradient and with the LoRA
adapter switched off (``train.ref_kl_every``: every N steps; 1 by default). This bench times one
``forward_backward`` (ppo) of the same datums with and without that measurement, alternating which goes
first, side by side in one run, on the model and LoRA width asked for. With ``--run RUN_DIR`` (an RL run's
folder: its ``metrics.jsonl``) it also states the share of that run's step time the training call took,
and so what the measurement adds to a whole step there.

    python bench/ref_kl.py --model runs/bench-mathematics-rl/sft/model_sft --run runs/bench-mathematics-rl/rl-s0
    python bench/ref_kl.py --write          # the tiny demo model; also docs/results/ref_kl.md
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from _results import recording, write_printed  # bench/, on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF model folder (default: the tiny demo model, built)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--datums", type=int, default=64, help="datums a training call (8 groups x 8)")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of timed calls")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--run", type=Path, default=None, help="an RL run folder: its step-time split")
    ap.add_argument("--write", action="store_true", help="also write docs/results/ref_kl.md")
    args = ap.parse_args()
    with recording(args.write) as rec:
        run(args)
    if args.write:
        write_printed(
            "ref_kl.md", "What measuring the KL to the starting policy costs: `bench/ref_kl.py`", rec
        )


def run(args: argparse.Namespace) -> None:
    import torch

    from retool.backends.interface.types import AdamParams, Datum
    from retool.backends.local.client import LocalTrainingClient
    from retool.backends.local.loading import LocalLoraSpec
    from retool.backends.local.tinymodel import build_tiny_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny", size="demo", seed=0))
        lora = LocalLoraSpec(rank=args.rank, alpha=2 * args.rank)
        client = LocalTrainingClient(model, lora=lora, device="cpu", dtype=args.dtype, seed=0)
        # RL-like lengths: a long tail of tool transcripts, a quarter of each sequence prompt (weight 0).
        rng = random.Random(0)
        lengths = [min(int(rng.lognormvariate(5.3, 0.5)), 900) + 16 for _ in range(args.datums)]
        datums = []
        for n in lengths:
            seq = [rng.randrange(5, client.vocab_size) for _ in range(n + 1)]
            n_prompt = n // 4
            lp = [-rng.random() * 3 for _ in range(n)]
            adv = rng.choice([-1.0, 1.0])
            datums.append(
                Datum(
                    seq[:-1],
                    seq[1:],
                    [0.0] * n_prompt + lp[n_prompt:],
                    [0.0] * n_prompt + [adv] * (n - n_prompt),
                    [0.0] * n_prompt + [1.0 / n / len(lengths)] * (n - n_prompt),
                )
            )

        def timed(measure: bool) -> tuple[float, float | None]:
            t = time.perf_counter()
            res = client.forward_backward(datums, "ppo", {"measure_ref_kl": 1.0} if measure else None)
            dt = time.perf_counter() - t
            for p in client.trainable_parameters():
                p.grad = None
            return dt, res.ref_kl

        # Warm-up, and one update so the policy is not the starting one (the adapter starts at zero).
        client.forward_backward(datums[:8], "ppo", {"measure_ref_kl": 1.0})
        client.optim_step(AdamParams(lr=2e-4))
        seconds: dict[bool, list[float]] = {False: [], True: []}
        kl = None
        for r in range(args.repeats):
            for measure in (False, True) if r % 2 == 0 else (True, False):
                dt, got = timed(measure)
                seconds[measure].append(dt)
                kl = got if measure else kl  # no optimizer step in between: every call sees one policy
        plain, with_kl = statistics.median(seconds[False]), statistics.median(seconds[True])
        ratio = with_kl / plain
        print(f"model: {args.model or 'tiny demo model'}  LoRA r{args.rank}  dtype: {client.dtype}")
        print(f"torch threads: {torch.get_num_threads()}  datums: {len(datums)}  tokens: {sum(lengths)}")
        print()
        print("| training call (ppo) | median seconds | calls |")
        print("|---|---|---|")
        print(f"| without ref_kl | {plain:.2f} | {len(seconds[False])} |")
        print(
            f"| with ref_kl (one more forward, adapter off, no gradient) | {with_kl:.2f} | {len(seconds[True])} |"
        )
        print()
        print(f"ref_kl makes a training call {ratio:.2f}x as long (KL measured after one update: {kl:.2e})")
        if args.run is not None:
            step_share(args.run, ratio)


def step_share(run: Path, ratio: float) -> None:
    """The run's training share of step time, and what ``ratio`` adds to a step there."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = sum(float(r.get("time/step") or 0.0) for r in rows)
    train = sum(float(r.get("time/train") or 0.0) for r in rows)
    if not step:
        print(f"{run}: no step times")
        return
    share = train / step
    # The run measured ref_kl every step: its training calls already hold the extra forward.
    added = share * (1 - 1 / ratio)
    print(
        f"{run.name} ({len(rows)} steps, ref_kl every step): training {100 * share:.1f}% of step time; "
        f"measuring ref_kl took about {100 * added:.1f}% of a step (ref_kl_every = 10: about "
        f"{10 * added:.1f}%)"
    )


if __name__ == "__main__":
    main()
