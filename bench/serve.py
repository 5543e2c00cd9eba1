"""Benchmark of ``retool serve``: the same work in-process and through the server with the real SDKs.

Prints, side by side in one run (the machine line first):
- sampling throughput (sampled tokens/s) with 1 and 8 concurrent clients: the local backend's sampler
  in this process, then ``retool serve`` through the ``tinker`` and the ``pytrio`` SDK (each client a thread
  making sequential requests on one sampling client, as a script's worker pool would), and the ratio
  server / in-process (target: >= 0.8 at 8 clients);
- training throughput (trained tokens/s) of ppo ``forward_backward`` + ``optim_step`` steps, same ratio;
- the per-request overhead of a 1-token sample: mean latency through each SDK minus in-process;
- the same sampling through plain HTTP (no SDK), to tell the server's cost from the SDKs' client side.

The server runs in a child process on 127.0.0.1 with the same model, LoRA rank, device and thread count.
Runs happen one after another (never overlapping), in interleaved rounds (best of each reported), so a\nbusy spell on a shared machine does not favour one mode.

The model: the tiny test model (``--model tiny``, ``--size``), or SmolLM2-135M-Instruct (``--model
smollm2``: its packaged GGUF dequantized to an HF folder once, under the system temp folder), or an HF
folder. The server runs with its defaults (one shared base; clients sample through their adapter);
``--base-per-client`` gives it a model copy per client, which samples through merged LoRA weights as the
in-process client does.

Usage: python bench/serve.py [--model tiny|smollm2|PATH] [--size test|demo] [--device cpu|cuda]
                             [--threads 1] [--requests 4] [--tokens 16] [--steps 3] [--datums 8]
                             [--sdks tinker,pytrio] [--rounds 3] [--base-per-client] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

RANK = 8
PROMPTS = [[5 + (7 * i + j) % 200 for j in range(24)] for i in range(64)]


def start_server(
    model: Path, root: Path, device: str, threads: int, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "retool", "serve", "--port", "0", "--model", str(model), "--root", str(root)]
    cmd += ["--set", f"backend.device={device}", "--set", f"backend.cpu_threads={threads}", *extra]
    log = (root.parent / "serve.log").open("w")  # the server's own log, next to its root
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("PYTRIO_BASE_URL="):
            return proc, line.strip().split("=", 1)[1]
    proc.kill()
    raise RuntimeError("retool serve did not start")


def timed_threads(clients: int, requests: int, one: Callable[[int], int]) -> float:
    """Tokens/s of ``clients`` threads each calling ``one(request_index)`` ``requests`` times in a row."""

    def worker(c: int) -> int:
        return sum(one(c * requests + r) for r in range(requests))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(worker, range(clients)))
    return total / (time.perf_counter() - t0)


def datums_for(n: int, length: int) -> list[tuple[list[int], list[float], list[float]]]:
    """(sequence, sampler logprobs, advantages) of ``n`` made-up trajectories of ``length`` tokens."""
    return [(PROMPTS[i % len(PROMPTS)][:8] + [10 + (i + j) % 150 for j in range(length - 8)],
             [-1.0] * (length - 1), [1.0 if i % 2 else -1.0] * (length - 1)) for i in range(n)]  # fmt: skip


# -- in-process ---------------------------------------------------------------------------------------


def bench_local(model: Path, args: argparse.Namespace) -> Callable[[], dict[str, float]]:
    """One round of the in-process measurements (the client stays loaded between rounds)."""
    from retool.backends.local import LocalLoraSpec, LocalTrainingClient
    from retool.backends.types import AdamParams, Datum, SamplingParams

    client = LocalTrainingClient(model, lora=LocalLoraSpec(rank=RANK, alpha=2 * RANK), device=args.device,
                                 num_threads=args.threads, checkpoint_dir=tempfile.mkdtemp())  # fmt: skip
    rows = [Datum(s[:-1], s[1:], lp, adv) for s, lp, adv in datums_for(args.datums, 64)]

    async def sample_all(clients: int, max_tokens: int, requests: int) -> tuple[float, float]:
        sampler = await client.sampling_client_async()
        latencies: list[float] = []

        async def worker(c: int) -> int:
            n = 0
            for r in range(requests):
                t = time.perf_counter()
                params = SamplingParams(max_tokens=max_tokens, seed=c * requests + r)
                got = await sampler.sample_async(PROMPTS[(c * requests + r) % len(PROMPTS)], 1, params)
                latencies.append(time.perf_counter() - t)
                n += sum(len(s.tokens) for s in got)
            return n

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*[worker(c) for c in range(clients)]))
        return total / (time.perf_counter() - t0), statistics.mean(latencies)

    def measure() -> dict[str, float]:
        asyncio.run(sample_all(8, args.tokens, 1))  # warm-up (first-call costs), as for the server below
        out = {f"sample_{c}": asyncio.run(sample_all(c, args.tokens, args.requests))[0] for c in (1, 8)}
        out["latency_1tok"] = asyncio.run(sample_all(1, 1, 20))[1]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            client.forward_backward(rows, "ppo", {"clip_low": 0.8, "clip_high": 1.28})
            client.optim_step(AdamParams(lr=1e-4))
        out["train"] = args.steps * sum(len(d) for d in rows) / (time.perf_counter() - t0)
        return out

    return measure


# -- through the server -------------------------------------------------------------------------------


def sampling_rows(sample: Callable[[int, int], int], args: argparse.Namespace) -> dict[str, float]:
    """Sampled tokens/s with 1 and 8 client threads (after a warm-up round) and the mean latency of a
    1-token sample, for a ``sample(i, max_tokens) -> tokens`` that goes through the server."""
    timed_threads(8, 1, lambda i: sample(i, args.tokens))  # warm-up
    out = {f"sample_{c}": timed_threads(c, args.requests, lambda i: sample(i, args.tokens)) for c in (1, 8)}
    t0 = time.perf_counter()
    for i in range(20):
        sample(i, 1)
    out["latency_1tok"] = (time.perf_counter() - t0) / 20
    return out


def bench_sdk(sdk: str, url: str, model: Path, args: argparse.Namespace) -> Callable[[], dict[str, float]]:
    """One round of the same work through one real SDK (``tinker`` or ``pytrio``); clients stay open."""
    if sdk == "tinker":
        import tinker
        from tinker import types

        service: Any = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        trainer = service.create_lora_training_client(base_model=str(model), rank=RANK).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()

        def sample(i: int, max_tokens: int) -> int:
            params = types.SamplingParams(max_tokens=max_tokens, seed=i)
            prompt = types.ModelInput.from_ints(PROMPTS[i % len(PROMPTS)])
            return len(
                sampler.sample(prompt=prompt, num_samples=1, sampling_params=params)
                .result()
                .sequences[0]
                .tokens
            )

        def to_datum(seq: list[int], lp: list[float], adv: list[float]) -> Any:
            inputs = {"target_tokens": seq[1:], "logprobs": lp, "advantages": adv}
            return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)
    else:
        import numpy as np
        import pytrio
        from pytrio import types

        pytrio.configure_observability(enabled=False)
        pytrio.configure(base_url=url, api_key="bench")
        service = pytrio.ServiceClient(api_key="bench")
        trainer = service.create_lora_training_client(base_model=str(model), rank=RANK)
        sampler = trainer.save_weights_and_get_sampling_client()

        def sample(i: int, max_tokens: int) -> int:
            params = types.SamplingParams(max_tokens=max_tokens, seed=i)
            prompt = types.ModelInput.from_ints(PROMPTS[i % len(PROMPTS)])
            return len(
                sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
            )

        def to_datum(seq: list[int], lp: list[float], adv: list[float]) -> Any:
            arrays = {"target_tokens": np.asarray(seq[1:], np.int64), "logprobs": np.asarray(lp, np.float32),
                      "advantages": np.asarray(adv, np.float32)}  # fmt: skip
            inputs = {k: types.TensorData.from_numpy(v) for k, v in arrays.items()}
            return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)

    rows = [to_datum(*d) for d in datums_for(args.datums, 64)]
    adam = types.AdamParams(learning_rate=1e-4)
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}

    def measure() -> dict[str, float]:
        out = sampling_rows(sample, args)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fb = trainer.forward_backward(rows, loss_fn="ppo", loss_fn_config=cfg)
            trainer.optim_step(adam).result()
            fb.result()
        out["train"] = args.steps * args.datums * 63 / (time.perf_counter() - t0)
        return out

    return measure


def bench_http(url: str, model: Path, args: argparse.Namespace) -> Callable[[], dict[str, float]]:
    """Sampling through the server with plain HTTP (PyTRIO's JSON sample route, one httpx client per
    thread): what the server costs without an SDK's client-side machinery. No training row."""
    import httpx

    control = httpx.Client(base_url=url, timeout=600.0)
    sid = control.post("/api/openapi/v1/service-sessions", json={}).json()["service_session_cuid"]
    run = control.post(
        f"/api/openapi/v1/service-sessions/{sid}/sampling-runs", json={"base_model": str(model)}
    )
    route = f"/v1/sampling-runs/{run.json()['sampling_run_cuid']}/sample"
    local = threading.local()

    def sample(i: int, max_tokens: int) -> int:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=600.0)  # a real model on CPU: seconds per batch
        body = {"request_id": f"r{i}", "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPTS[i % len(PROMPTS)]}]},
                "sampling_params": {"max_tokens": max_tokens, "seed": i}, "return_text": False}  # fmt: skip
        return len(local.client.post(route, json=body).json()["sequences"][0]["tokens"])

    def measure() -> dict[str, float]:
        out = sampling_rows(sample, args)
        out["train"] = float("nan")
        return out

    return measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or an HF model folder")
    ap.add_argument("--size", default="demo", choices=["test", "demo"], help="the tiny model's size")
    ap.add_argument("--base-per-client", action="store_true", help="the server's --base-per-client")
    ap.add_argument("--out", default=None, help="also write the report to this file (e.g. docs/results/...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per client")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens per sample")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--datums", type=int, default=8, help="datums (64 tokens each) per forward_backward")
    ap.add_argument("--sdks", default="tinker,pytrio")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is reported")
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    from _machine import machine
    from _models import smollm2_folder
    from retool.backends.tinymodel import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"work folder (model, server root and serve.log): {work}")
    if args.model == "tiny":
        model, name = build_tiny_model(work / "model", size=args.size, seed=0), f"tiny ({args.size})"
    elif args.model == "smollm2":
        model, name = smollm2_folder(Path(tempfile.gettempdir()) / "retool-bench-models"), "SmolLM2-135M"
    else:
        model, name = Path(args.model), args.model
    serve_mode = "a model copy per client" if args.base_per_client else "one shared base"
    header = [
        f"machine: {machine()}",
        f"model: {name}, LoRA r={RANK}, device {args.device}, {args.threads} torch thread(s); server: {serve_mode}",
    ]
    print("\n".join(header))
    measures = {"in-process": bench_local(model, args)}
    extra = ("--base-per-client",) if args.base_per_client else ()
    proc, url = start_server(model, work / "root", args.device, args.threads, extra)
    try:
        measures["serve+http"] = bench_http(url, model, args)
        for sdk in args.sdks.split(","):
            measures[f"serve+{sdk}"] = bench_sdk(sdk, url, model, args)
        # Rounds interleave the modes so a busy spell on a shared machine hits all of them; best per metric.
        results: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for name, measure in measures.items():
                got = measure()
                best = results.setdefault(name, got)
                for key, value in got.items():
                    if key == "latency_1tok":
                        best[key] = min(best[key], value)
                    elif value == value:  # not NaN (plain HTTP has no training row)
                        best[key] = max(best[key], value)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report(results, header, args.out)


def report(results: dict[str, dict[str, float]], header: list[str], out: str | None) -> None:
    base = results["in-process"]
    lines = [
        *header,
        "",
        f"{'':16}{'sample 1 cl':>14}{'sample 8 cl':>14}{'train tok/s':>14}{'1-token ms':>12}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:16}{r['sample_1']:14.1f}{r['sample_8']:14.1f}{r['train']:14.1f}{1000 * r['latency_1tok']:12.1f}"
        )
    for name, r in results.items():
        if name == "in-process":
            continue
        lines.append(
            f"{name}: sampling {r['sample_1'] / base['sample_1']:.2f}x (1 client), "
            f"{r['sample_8'] / base['sample_8']:.2f}x (8 clients; target >= 0.8x), "
            f"training {r['train'] / base['train']:.2f}x, "
            f"1-token overhead {1000 * (r['latency_1tok'] - base['latency_1tok']):+.1f} ms"
        )
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        print(f"written to {out}")


if __name__ == "__main__":
    # The SDKs keep non-daemon threads (heartbeats) that would hold the process after the server is gone.
    code = 0
    try:
        main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
