"""Benchmark of ``retool serve``: the same work in-process and through the server, side by side in one run.

For each model (``--model``, default both: the tiny test model and SmolLM2-135M-Instruct, its packaged GGUF
dequantized once to an fp32 HF folder under the system temp folder), one after another:
- sampling throughput (sampled tokens/s) with 1 and 8 concurrent clients: the local backend's sampler in
  this process, then ``retool serve`` through plain HTTP (PyTRIO's JSON sample route, no SDK), the
  ``tinker`` and the ``pytrio`` SDK (each client a thread making sequential requests on one sampling
  client, as a script's worker pool would), and the ratio server / in-process (target: >= 0.8 at 8
  clients); a last row gives each client thread its own training client and samples its adapter
  (``--adapters``: one base, eight adapters, batched together by ``retool.backends.samplers.multi_lora``);
- training throughput (trained tokens/s) of ppo ``forward_backward`` + ``optim_step`` steps, same ratio;
- the latency of a 1-token sample;
- where a request's time goes at 8 clients: the server's own timers (``GET /retool/timers``: validation,
  the sampler call, the engine's inbox wait per row, serialization, the whole HTTP requests) beside the
  latency the client saw (the difference is the client side: SDK, HTTP client, and for Tinker the second
  round trip that fetches the future).

The server runs in a child process on 127.0.0.1 with the same model, LoRA rank, device and thread count,
with its defaults (one shared base; ``--base-per-client`` gives it a model copy per client). Runs happen
one after another (never overlapping), in interleaved rounds (best of each reported), so a busy spell on a
shared machine does not favour one mode. ``--write`` writes the report (machine, versions, date) to
docs/results/serve_throughput.md.

Usage: python bench/serve.py [--model tiny,smollm2|PATH] [--size test|demo] [--device cpu|cuda]
                             [--threads 1] [--requests 4] [--tokens 16] [--steps 3] [--datums 8]
                             [--sdks tinker,pytrio] [--adapters 8] [--rounds 3] [--base-per-client]
                             [--write] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
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

from _harness import ServeProcess

RANK = 8
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "serve_throughput.md"
# Every mode's clients, kept to the end: a collected PyTRIO ServiceClient's finalizer calls the stopped
# server and waits out the SDK's retries.
KEEP: list[object] = []
PROMPTS = [[5 + (7 * i + j) % 200 for j in range(24)] for i in range(64)]


def timed_threads(
    clients: int, requests: int, one: Callable[[int], int], latencies: list[float] | None = None
) -> float:
    """Tokens/s of ``clients`` threads each calling ``one(request_index)`` ``requests`` times in a row
    (each call's seconds appended to ``latencies``)."""

    def worker(c: int) -> int:
        n = 0
        for r in range(requests):
            t = time.perf_counter()
            n += one(c * requests + r)
            if latencies is not None:
                latencies.append(time.perf_counter() - t)
        return n

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
    from retool.backends.interface.types import AdamParams, Datum, SamplingParams
    from retool.backends.local.client import LocalLoraSpec, LocalTrainingClient

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


def server_timers(url: str, reset: bool = True) -> dict[str, dict[str, float]]:
    """The server's request-path timers (``retool.serve.state.RequestTimers``), reset after reading."""
    import httpx

    got: dict[str, dict[str, float]] = httpx.get(f"{url}/retool/timers", params={"reset": reset}).json()
    return got


def sampling_rows(sample: Callable[[int, int], int], args: argparse.Namespace, url: str) -> dict[str, float]:
    """Sampled tokens/s with 1 and 8 client threads (after a warm-up round) and the mean latency of a
    1-token sample, for a ``sample(i, max_tokens) -> tokens`` that goes through the server; with the
    8-client run's per-request cost on the server by phase (``ms <phase>``) and as the client saw it."""
    timed_threads(8, 1, lambda i: sample(i, args.tokens))  # warm-up
    out = {"sample_1": timed_threads(1, args.requests, lambda i: sample(i, args.tokens))}
    server_timers(url)
    latencies: list[float] = []
    out["sample_8"] = timed_threads(8, args.requests, lambda i: sample(i, args.tokens), latencies)
    phases = server_timers(url)
    requests = len(latencies)
    for phase, got in phases.items():
        out[f"ms {phase}"] = 1000 * got["seconds"] / max(got["count"], 1)
    out["ms client latency"] = 1000 * statistics.mean(latencies)
    out["ms server http"] = (
        1000 * sum(v["seconds"] for k, v in phases.items() if k.startswith("http ")) / requests
    )
    t0 = time.perf_counter()
    for i in range(20):
        sample(i, 1)
    out["latency_1tok"] = (time.perf_counter() - t0) / 20
    return out


def per_thread(samplers: list[Any]) -> Callable[[], Any]:
    """Each client thread's own sampler (round robin over ``samplers`` by first use)."""
    local, counter, lock = threading.local(), [0], threading.Lock()

    def mine() -> Any:
        if not hasattr(local, "sampler"):
            with lock:
                local.sampler = samplers[counter[0] % len(samplers)]
                counter[0] += 1
        return local.sampler

    return mine


def bench_sdk(
    sdk: str, url: str, model: Path, args: argparse.Namespace, adapters: int = 1
) -> Callable[[], dict[str, float]]:
    """One round of the same work through one real SDK (``tinker`` or ``pytrio``); clients stay open.
    ``adapters`` > 1: that many training clients, each client thread sampling its own one's weights."""
    if sdk == "tinker":
        import tinker
        from tinker import types

        service: Any = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        trainers = [service.create_lora_training_client(base_model=str(model), rank=RANK, seed=k).result()
                    for k in range(adapters)]  # fmt: skip
        trainer = trainers[0]
        sampler = per_thread([t.save_weights_and_get_sampling_client().result() for t in trainers])

        def sample(i: int, max_tokens: int) -> int:
            params = types.SamplingParams(max_tokens=max_tokens, seed=i)
            prompt = types.ModelInput.from_ints(PROMPTS[i % len(PROMPTS)])
            return len(
                sampler()
                .sample(prompt=prompt, num_samples=1, sampling_params=params)
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
        trainers = [service.create_lora_training_client(base_model=str(model), rank=RANK)
                    for _ in range(adapters)]  # fmt: skip
        trainer = trainers[0]
        sampler = per_thread([t.save_weights_and_get_sampling_client() for t in trainers])

        def sample(i: int, max_tokens: int) -> int:
            params = types.SamplingParams(max_tokens=max_tokens, seed=i)
            prompt = types.ModelInput.from_ints(PROMPTS[i % len(PROMPTS)])
            return len(
                sampler().sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
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
        out = sampling_rows(sample, args, url)
        if adapters > 1:  # a sampling row: training is the same as with one adapter
            out["train"] = float("nan")
            return out
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
        out = sampling_rows(sample, args, url)
        out["train"] = float("nan")
        return out

    return measure


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny,smollm2", help="comma-separated: tiny, smollm2, HF folders")
    ap.add_argument("--size", default="demo", choices=["test", "demo"], help="the tiny model's size")
    ap.add_argument("--base-per-client", action="store_true", help="the server's --base-per-client")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    ap.add_argument("--write", action="store_true", help=f"write the report to {RESULTS.relative_to(REPO)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4, help="sequential requests per client")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens per sample")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--datums", type=int, default=8, help="datums (64 tokens each) per forward_backward")
    ap.add_argument("--sdks", default="tinker,pytrio")
    ap.add_argument("--adapters", type=int, default=8, help="the 'own adapter' rows: training clients")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is reported")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from _machine import machine
    from _results import versions

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"work folder (models, server roots and serve logs): {work}")
    serve_mode = "a model copy per client" if args.base_per_client else "one shared base"
    header = [
        f"machine: {machine()}",
        "versions: " + versions("transformers", "peft", "fastapi", "uvicorn", "httpx", "tinker", "pytrio"),
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average before: "
        f"{os.getloadavg()[0]:.1f}",
        f"LoRA r={RANK}, device {args.device}, {args.threads} torch thread(s); server: {serve_mode}, "
        f"{args.requests} requests x {args.tokens} tokens per client, best of {args.rounds} interleaved rounds",
    ]
    print("\n".join(header), flush=True)
    sections: list[tuple[str, dict[str, dict[str, float]]]] = []
    outs = [Path(args.out)] if args.out else []
    for name in args.model.split(","):
        sections.append(run_model(name, work, args))
        text = report(header, sections)  # written after each model, so a later failure keeps it
        for out in outs + ([RESULTS] if args.write else []):
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
    print("\n" + text)
    if args.write:
        print(f"written to {RESULTS}")


def model_folder(name: str, work: Path, args: argparse.Namespace) -> tuple[Path, str]:
    from _models import smollm2_folder
    from retool.backends.local.tinymodel import build_tiny_model

    if name == "tiny":
        return build_tiny_model(work / f"tiny-{args.size}", size=args.size, seed=0), f"tiny ({args.size})"
    if name == "smollm2":
        return smollm2_folder(Path(tempfile.gettempdir()) / "retool-bench-models"), "SmolLM2-135M"
    return Path(name), name


def run_model(name: str, work: Path, args: argparse.Namespace) -> tuple[str, dict[str, dict[str, float]]]:
    """Every mode on one model, in interleaved rounds (best of each metric)."""
    model, label = model_folder(name, work, args)
    print(f"-- {label}", flush=True)
    measures = {"in-process": bench_local(model, args)}
    KEEP.append(measures)
    extra = ("--base-per-client",) if args.base_per_client else ()
    root = work / f"root-{name.replace('/', '_')}"
    log = root.parent / "serve.log"  # the server's own log, next to its root
    server = ServeProcess(model, root, *extra, device=args.device, threads=args.threads, log=log)
    url = server.start().url
    try:
        measures["serve+http"] = bench_http(url, model, args)
        for sdk in args.sdks.split(","):
            measures[f"serve+{sdk}"] = bench_sdk(sdk, url, model, args)
        if args.adapters > 1:
            sdk = args.sdks.split(",")[0]
            measures[f"serve+{sdk}, {args.adapters} adapters"] = bench_sdk(
                sdk, url, model, args, args.adapters
            )
        # Rounds interleave the modes so a busy spell on a shared machine hits all of them; best per metric.
        results: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for mode, measure in measures.items():
                got = measure()
                print(
                    f"  {mode}: sampled tok/s {got['sample_1']:.1f} (1 client), {got['sample_8']:.1f} (8)",
                    flush=True,
                )
                best = results.setdefault(mode, got)
                if best is got:
                    continue
                for key, value in got.items():
                    if key == "latency_1tok" or key.startswith("ms "):
                        best[key] = min(best[key], value)
                    elif value == value:  # not NaN (plain HTTP has no training row)
                        best[key] = max(best[key], value)
    finally:
        server.stop()
    return label, results


PHASES = ["validate", "sample", "queue", "serialize", "server http", "client latency"]


def report(header: list[str], sections: list[tuple[str, dict[str, dict[str, float]]]]) -> str:
    lines = ["# retool serve throughput (`bench/serve.py`)", "", *[f"- {h}" for h in header]]
    for label, results in sections:
        base = results["in-process"]
        lines += ["", f"## {label}", "", "| mode | sample tok/s, 1 client | 8 clients | ratio 1 cl | ratio 8 cl | "
                  "train tok/s | ratio | 1-token ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for mode, r in results.items():
            lines.append(
                f"| {mode} | {r['sample_1']:.1f} | {r['sample_8']:.1f} | {r['sample_1'] / base['sample_1']:.2f}x | "
                f"**{r['sample_8'] / base['sample_8']:.2f}x** | {r['train']:.1f} | {r['train'] / base['train']:.2f}x | "
                f"{1000 * r['latency_1tok']:.1f} |"
            )
        lines += ["", "Per request at 8 clients, ms (server phases, best round; `queue` per row; target: 8-client ratio >= 0.8x):", "",
                  "| mode | " + " | ".join(PHASES) + " |", "|---|" + "---:|" * len(PHASES)]  # fmt: skip
        for mode, r in results.items():
            if mode == "in-process":
                continue
            cells = [f"{r[f'ms {p}']:.1f}" if f"ms {p}" in r else "" for p in PHASES]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines).replace("nanx", "-").replace("| nan |", "| - |") + "\n"


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
