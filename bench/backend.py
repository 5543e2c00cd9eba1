"""Benchmark of the local backend on a tiny random model (CPU by default).

Prints, side by side in one run:
- sampling tokens/s: sequential requests vs concurrent requests gathered into one batched generation;
- forward_backward tokens/s (ppo) with dynamic packing vs one-datum micro-batches;
- the packer's padding efficiency (real / padded tokens) vs greedy sorted filling and fixed-size batches
  in arrival order.

Usage: python bench/backend.py [--size test|demo] [--device cpu|cuda] [--samples 16] [--tokens 48] [--threads 1]
       [--write]

``--write`` also writes what it printed to docs/results/backend.md and refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import recording, write_printed  # bench/, on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="test", choices=["test", "demo"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="an HF model folder or Hub id instead of the tiny model")
    ap.add_argument("--samples", type=int, default=16, help="sequences per sampling measurement")
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens per sequence")
    ap.add_argument("--datums", type=int, default=32, help="datums per forward_backward")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy CPU)")
    ap.add_argument("--write", action="store_true", help="also write docs/results/backend.md")
    args = ap.parse_args()
    with recording(args.write) as rec:
        run(args)
    if args.write:
        write_printed("backend.md", "The local backend on a tiny model: `bench/backend.py`", rec)


def run(args: argparse.Namespace) -> None:
    """Sampling one at a time vs gathered, forward_backward packed vs one datum per micro-batch, and the
    packers' padding efficiency; prints all three."""

    import torch

    from retool.backends.local.client import LocalTrainingClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the packing baseline
    from packing_baseline import greedy_micro_batches
    from retool.backends.interface.types import Datum, SamplingParams
    from retool.backends.local.tinymodel import build_tiny_model
    from retool.backends.training.packing import pack_micro_batches, padding_efficiency

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny", size=args.size, seed=0))
        client = LocalTrainingClient(
            model, lora=None, device=args.device, seed=0, sample_batch_size=64, num_threads=args.threads
        )
        tok = client.tokenizer
        prompt = tok.encode("Solve the problem. Use the code_interpreter tool.", add_special_tokens=False)
        # ignore EOS so every sequence runs to max_tokens: a fair tokens/s comparison
        client.eos_ids = set()
        params = [SamplingParams(max_tokens=args.tokens, seed=i) for i in range(args.samples)]

        client.sample(prompt, 1, SamplingParams(max_tokens=4, seed=0))  # warm-up
        t0 = time.perf_counter()
        seq_tokens = sum(len(client.sample(prompt, 1, p)[0].tokens) for p in params)
        t_seq = time.perf_counter() - t0

        async def concurrent() -> int:
            sampler = await client.sampling_client_async()
            outs = await asyncio.gather(*[sampler.sample_async(prompt, 1, p) for p in params])
            return sum(len(o[0].tokens) for o in outs)

        t0 = time.perf_counter()
        bat_tokens = asyncio.run(concurrent())
        t_bat = time.perf_counter() - t0

        # forward_backward on datums with a long-tailed length distribution, like RL trajectories
        rng = random.Random(0)
        lengths = [min(int(rng.lognormvariate(4.3, 0.6)), 600) + 8 for _ in range(args.datums)]
        datums = []
        for n in lengths:
            seq = [rng.randrange(5, client.vocab_size) for _ in range(n + 1)]
            n_prompt = n // 4
            lp = [-rng.random() * 5 for _ in range(n)]
            datums.append(
                Datum(
                    seq[:-1],
                    seq[1:],
                    [0.0] * n_prompt + lp[n_prompt:],
                    [0.0] * n_prompt + [1.0] * (n - n_prompt),
                    [0.0] * n_prompt + [1.0 / n / len(lengths)] * (n - n_prompt),
                )
            )
        real = sum(lengths)

        def timed_fb(area: int) -> tuple[float, float]:
            client.micro_batch_tokens = area
            client.forward_backward(datums[:2], "ppo")  # warm-up
            for p in client.trainable_parameters():
                p.grad = None
            t = time.perf_counter()
            res = client.forward_backward(datums, "ppo")
            dt = time.perf_counter() - t
            for p in client.trainable_parameters():
                p.grad = None
            return dt, res.extra["micro_batches"]

        t_packed, mb_packed = timed_fb(4096)
        t_single, mb_single = timed_fb(1)  # every datum alone

        area = 4096
        packed = pack_micro_batches(lengths, area)
        naive = [list(range(i, min(i + 8, len(lengths)))) for i in range(0, len(lengths), 8)]
        greedy = greedy_micro_batches(lengths, area)
        print(
            f"model: {model if args.model else 'tiny-' + args.size}  device: {client.device}  dtype: {client.dtype}"
        )
        print(
            f"trainable parameters: {client.num_trainable_parameters():,}  torch threads: {torch.get_num_threads()}"
        )
        print()
        print(f"{'sampling':32s} {'tokens':>8s} {'seconds':>8s} {'tok/s':>9s}")
        print(f"{'  sequential (1 at a time)':32s} {seq_tokens:8d} {t_seq:8.2f} {seq_tokens / t_seq:9.1f}")
        print(f"{'  concurrent, gathered batch':32s} {bat_tokens:8d} {t_bat:8.2f} {bat_tokens / t_bat:9.1f}")
        print(f"  batched / sequential speed-up: {(bat_tokens / t_bat) / (seq_tokens / t_seq):.2f}x")
        print()
        print(
            f"{'forward_backward (ppo)':32s} {'tokens':>8s} {'seconds':>8s} {'tok/s':>9s} {'micro-batches':>14s}"
        )
        print(
            f"{'  packed (area 4096)':32s} {real:8d} {t_packed:8.2f} {real / t_packed:9.1f} {int(mb_packed):14d}"
        )
        print(
            f"{'  one datum per micro-batch':32s} {real:8d} {t_single:8.2f} {real / t_single:9.1f} {int(mb_single):14d}"
        )
        print(f"  packed / single speed-up: {t_single / t_packed:.2f}x")
        print()
        print(
            f"padding efficiency (real / padded tokens), {len(lengths)} datums, median length "
            f"{statistics.median(lengths):.0f}, max {max(lengths)}:"
        )
        print(
            f"  packer (sorted, area {area}):        {padding_efficiency(lengths, packed):.3f} "
            f"in {len(packed)} micro-batches"
        )
        print(
            f"  greedy sorted fill (same area):      {padding_efficiency(lengths, greedy):.3f} "
            f"in {len(greedy)} micro-batches"
        )
        print(
            f"  arrival order, 8 rows per batch:     {padding_efficiency(lengths, naive):.3f} "
            f"in {len(naive)} micro-batches"
        )


if __name__ == "__main__":
    main()
