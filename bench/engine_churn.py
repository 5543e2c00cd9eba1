"""Benchmark: the local engine when rows finish and join at different steps, the shape of an evaluation.

SmolLM2-135M-Instruct (its packaged GGUF dequantized; bf16 where the CPU has it, as the benches sample),
``--rows`` greedy two-turn requests at once: each turn runs to its own token budget (end-of-sequence
ignored), so a row finishes every few steps, and its second turn (the first turn's text and an interpreter's
output appended) is submitted as soon as it returns, as a retool evaluation resubmits a trajectory after its
tool call.

Side by side in one run, alternating: the engine taking every finished row out of its KV batch at once
and admitting a waiting row as soon as one slot frees (``COMPACT_DEAD_SHARE`` = ``ADMIT_FREE_SHARE`` = 0),
against its defaults (finished rows leave, and waiting rows join, a few at a time). Prints each run's
seconds and tokens/s, the ratio, how often each copied its KV batch, and whether both sampled the same tokens.

    python bench/engine_churn.py [--rows 128] [--repeats 2] [--threads 2] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import recording, write_printed  # bench/, on sys.path when run as a script

OBSERVATION = "\n```output\n42\n```\n"
# A retool evaluation's prompts are long (system prompt, tool protocol, question): the KV batch a finished
# row leaves is wide. Shared by every row, as a system prompt is (prefilled once, then cached).
PREAMBLE = (
    "You are a careful mathematician with a Python interpreter. To run code, write it in a ```python block;"
    " its output comes back in an ```output block. Check every step with code, then give the final answer"
    " in \\boxed{}. "
) * 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128, help="trajectories at once (and the engine's batch)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each engine setting, alternated")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--work", type=Path, default=None, help="where the model's HF folder is kept")
    ap.add_argument("--write", action="store_true", help="also write docs/results/engine_churn.md")
    args = ap.parse_args()
    with recording(args.write) as rec:
        run(args)
    if args.write:
        write_printed("engine_churn.md", "The local engine with rows finishing and joining", rec)


def run(args: argparse.Namespace) -> None:
    import torch

    from _models import smollm2_folder
    from retool.backends.engine import generation
    from retool.backends.interface.types import SamplingParams
    from retool.backends.local.client import LocalTrainingClient

    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.gettempdir()) / "retool-bench-models"
    client = LocalTrainingClient(
        smollm2_folder(work), lora=None, device="cpu", seed=0, sample_batch_size=args.rows
    )
    client.eos_ids = set()  # each turn runs to its own budget: the rows finish at steps the bench sets
    tok = client.tokenizer
    prompts = [
        list(
            tok.encode(PREAMBLE + f"Question {i}: what is {i * 37 % 101} times {i * 53 % 89}, then add {i}?")
        )
        for i in range(args.rows)
    ]
    observation = list(tok.encode(OBSERVATION))

    async def trajectory(i: int) -> list[int]:
        sampler = await client.sampling_client_async()
        first = SamplingParams(max_tokens=24 + (i * 7) % 96, temperature=0.0, seed=i)
        (s1,) = await sampler.sample_async(prompts[i], 1, first)
        second = SamplingParams(max_tokens=16 + (i * 5) % 48, temperature=0.0, seed=i)
        (s2,) = await sampler.sample_async(prompts[i] + s1.tokens + observation, 1, second)
        return s1.tokens + s2.tokens

    copies = 0
    select, extend = generation._Batch.select, generation._Batch.extend

    def counted(method: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            nonlocal copies
            copies += 1
            return method(*a, **k)

        return wrapper

    generation._Batch.select = counted(select)  # type: ignore[method-assign]
    generation._Batch.extend = counted(extend)  # type: ignore[method-assign]
    defaults = (generation.COMPACT_DEAD_SHARE, generation.ADMIT_FREE_SHARE)
    settings = {"at once (before)": (0.0, 0.0), "a few at a time (default)": defaults}
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    tokens: dict[str, list[list[int]]] = {}
    copied: dict[str, int] = {}
    try:
        client.sample(prompts[0], 1, SamplingParams(max_tokens=8, temperature=0.0))  # warm up
        for _ in range(args.repeats):
            for name, (compact, admit) in settings.items():
                generation.COMPACT_DEAD_SHARE, generation.ADMIT_FREE_SHARE = compact, admit
                client.prefix_cache.clear()  # each run prefills its first turns itself
                copies = 0

                async def all_rows() -> list[list[int]]:
                    return await asyncio.gather(*[trajectory(i) for i in range(args.rows)])

                t0 = time.perf_counter()
                tokens[name] = asyncio.run(all_rows())
                seconds[name].append(time.perf_counter() - t0)
                copied[name] = copies
    finally:
        generation.COMPACT_DEAD_SHARE, generation.ADMIT_FREE_SHARE = defaults
        generation._Batch.select, generation._Batch.extend = select, extend  # type: ignore[method-assign]
        client.close()

    sampled = sum(len(t) for t in next(iter(tokens.values())))
    print(
        f"SmolLM2-135M-Instruct, {args.rows} greedy two-turn requests at once ({sampled} tokens sampled a run),"
        f" {args.threads} torch threads, dtype {client.dtype}; runs alternated, {args.repeats} of each."
    )
    print()
    print("| finished rows leave the KV batch | seconds a run | tokens/s (median) | KV batch copies a run |")
    print("|---|---|---|---|")
    rate = {}
    for name in settings:
        rate[name] = sampled / statistics.median(seconds[name])
        runs = ", ".join(f"{s:.1f}" for s in seconds[name])
        print(f"| {name} | {runs} | {rate[name]:.0f} | {copied[name]} |")
    before, after = settings
    print()
    print(f"Default over before: {rate[after] / rate[before]:.2f}x tokens/s.")
    same = sum(x == y for x, y in zip(tokens[before], tokens[after], strict=True))
    # Greedy in bf16: the batch's shape changes a row's logits by rounding, and a near-tie may flip.
    print(f"Trajectories with the same tokens in both: {same} of {args.rows}.")


if __name__ == "__main__":
    main()
