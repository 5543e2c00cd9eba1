"""Smoke test of the local backend's GPU path, one JSON report at the end (no network needed; well under
5 minutes on one GPU): the trainer's dtype on the device, concurrent batched sampling, the on-policy ratio,
a few PPO steps, save/load in a fresh client, and the vLLM sampler when vLLM is installed (the trainer's
dtype handed to the engine, the LoRA adapter handed over and followed after an update, the on-policy ratio,
start-up time and memory, a clean close).

A file with a main guard, not a script fed to ``python -`` on stdin: vLLM starts its engine process with
spawn (always, once CUDA is initialised), and spawn re-runs the main module from its file.

Usage: python bench/gpu_smoke.py                  # on CUDA (fails when there is none)
       python bench/gpu_smoke.py --device cpu     # the same checks on CPU (vLLM's CPU build: fp32, bounds 1e-3)
       python bench/gpu_smoke.py --device cpu --quick   # reduced sizes (the suite runs this)
``bench/gpu_smoke.sh`` runs it on CUDA and then ``bench/backend.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(SRC))


class Checks:
    """Prints each check as it runs; the failures decide the exit code."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            self.failures.append(what)


def _sample_all(sampler: Any, prompts: list[list[int]], n: int, max_tokens: int) -> list[list[Any]]:
    from retool.backends.interface.types import SamplingParams

    async def go() -> list[list[Any]]:
        return list(
            await asyncio.gather(
                *[
                    sampler.sample_async(p, n, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
                    for i, p in enumerate(prompts)
                ]
            )
        )

    return asyncio.run(go())


def _datums(prompts: list[list[int]], groups: list[list[Any]]) -> list[Any]:
    """PPO datums of sampled groups, alternating advantages, the sampler's logprobs as the old ones."""
    from retool.backends.interface.types import Datum

    out = []
    for gi, (p, g) in enumerate(zip(prompts, groups, strict=True)):
        for si, s in enumerate(g):
            if not s.tokens:
                continue
            seq = p + s.tokens
            k = len(p) - 1
            adv = 1.0 if (si + gi) % 2 else -1.0
            n = len(s.tokens)
            out.append(
                Datum(
                    seq[:-1],
                    seq[1:],
                    [0.0] * k + s.logprobs,
                    [0.0] * k + [adv] * n,
                    [0.0] * k + [1.0 / n] * n,
                )
            )
    return out


def run(device: str, quick: bool, report: dict[str, Any], check: Checks) -> None:
    import torch

    from retool.backends.interface.types import AdamParams
    from retool.backends.local.client import LocalTrainingClient
    from retool.backends.local.tinymodel import build_tiny_model

    seqs, tokens = (4, 32) if quick else (16, 128)
    tmp = Path(tempfile.mkdtemp(prefix="retool_gpu_smoke_"))
    # size "engine": four heads of 32, the smallest head size vLLM's CPU attention runs
    model_dir = build_tiny_model(tmp / "model", size="engine", seed=0)
    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    client = LocalTrainingClient(
        model_dir,
        lora=lora,
        device=device,
        seed=0,
        sample_batch_size=64,
        checkpoint_dir=tmp / "ckpt",
        max_context=1024,
    )
    cuda = client.device.type == "cuda"
    report.update(device=str(client.device), dtype=str(client.dtype), torch=torch.__version__)
    check((client.dtype == torch.bfloat16) == cuda, f"trainer dtype {client.dtype} on {client.device}")
    with torch.no_grad():  # LoRA B starts at zero; perturb it so the adapter matters for the checks below
        for name, p in client.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)

    tok = client.tokenizer
    prompts = [
        tok.encode(t, add_special_tokens=False)
        for t in ("Solve the problem.", "print(sum(range(10)))", "Traceback (most recent call last):", "42")
    ]
    t0 = time.perf_counter()
    groups = _sample_all(client.sampling_client(), prompts, seqs, tokens)
    dt = time.perf_counter() - t0
    n_tok = sum(len(s.tokens) for g in groups for s in g)
    report["hf_sampling_tokens_per_s"] = round(n_tok / dt, 1)
    check(n_tok > 0, f"torch sampler: {n_tok} tokens from {4 * seqs} sequences in {dt:.2f}s")

    datums = _datums(prompts, groups)
    res = client.forward(datums, "ppo")
    report["hf_on_policy_ratio"] = [res.ratio_min, res.ratio_mean, res.ratio_max]
    tol = 0.05 if cuda else 1e-3  # bf16 prefill+cache vs one full forward differ by rounding
    check(
        abs(res.ratio_mean - 1) < tol and res.clip_fraction < 0.05,
        f"torch sampler on-policy ratio mean {res.ratio_mean:.4f} (min {res.ratio_min:.4f} max "
        f"{res.ratio_max:.4f}), clip fraction {res.clip_fraction:.3f}",
    )

    t0 = time.perf_counter()
    for step in range(2 if quick else 3):
        fb = client.forward_backward(datums, "ppo")
        opt = client.optim_step(AdamParams(lr=1e-3))
        check(
            math.isfinite(fb.loss) and math.isfinite(opt.grad_norm),
            f"step {step}: loss {fb.loss:.4f} grad_norm {opt.grad_norm:.3f}",
        )
    report["train_tokens_per_s"] = round(
        (2 if quick else 3) * sum(len(d) for d in datums) / (time.perf_counter() - t0), 1
    )

    path = client.save_state("smoke")
    expected = client.forward(datums, "ppo").loss
    fresh = LocalTrainingClient(
        model_dir, lora=lora, device=device, seed=1, checkpoint_dir=tmp / "ckpt", max_context=1024
    )
    fresh.load_state(path)
    got = fresh.forward(datums, "ppo").loss
    # exact on CPU; on CUDA allow kernel-selection noise between two model instances
    same = got == expected if not cuda else abs(got - expected) <= 1e-5 * max(1.0, abs(expected))
    check(same, f"save/load reproduces the loss ({got!r} vs {expected!r})")
    fresh.close()
    del fresh
    if cuda:
        torch.cuda.empty_cache()

    try:
        import vllm
    except ImportError:
        print("skip  vLLM sampler (vllm not installed)")
        report["vllm"] = None
        client.close()
        return
    report["vllm"] = vllm.__version__
    _vllm_checks(client, prompts, seqs, tokens, cuda, report, check)
    client.close()


def _vllm_checks(
    client: Any,
    prompts: list[list[int]],
    seqs: int,
    tokens: int,
    cuda: bool,
    report: dict[str, Any],
    check: Checks,
) -> None:
    from retool.backends.interface.types import AdamParams
    from retool.backends.samplers.vllm import attach_vllm_sampler, engine_dtype, running

    try:
        vs = attach_vllm_sampler(client, kv_cache_gib=0.25, gpu_memory_utilization=0.3)
    except Exception as exc:  # report, do not hide
        check(False, f"vLLM engine failed to start: {type(exc).__name__}: {exc}")
        return
    report["vllm_startup_s"] = round(vs.startup_s, 1)
    report["vllm_rss_gib"] = round(vs.engine_rss_bytes / 2**30, 2)
    report["vllm_dtype"] = vs.engine_args["dtype"]
    check(
        vs.engine_args["dtype"] == engine_dtype(client.dtype),
        f"vLLM computes in the trainer's dtype ({vs.engine_args['dtype']})",
    )
    try:
        sampler = client.sampling_client()  # hands the current adapter to vLLM
        t0 = time.perf_counter()
        groups = _sample_all(sampler, prompts, seqs, tokens)
        dt = time.perf_counter() - t0
        n_tok = sum(len(s.tokens) for g in groups for s in g)
        report["vllm_sampling_tokens_per_s"] = round(n_tok / dt, 1)
        check(n_tok > 0, f"vLLM sampler: {n_tok} tokens in {dt:.2f}s (the first batch includes warm-up)")
        res = client.forward(_datums(prompts, groups), "ppo")
        report["vllm_on_policy_ratio"] = [res.ratio_min, res.ratio_mean, res.ratio_max]
        bound = 0.1 if cuda else 1e-3  # bf16 on a GPU: the mean only; fp32 on CPU: every token
        spread = abs(res.ratio_mean - 1) if cuda else max(abs(res.ratio_min - 1), abs(res.ratio_max - 1))
        check(
            spread < bound,
            f"vLLM on-policy ratio min {res.ratio_min:.5f} mean {res.ratio_mean:.5f} max {res.ratio_max:.5f}",
        )
        client.forward_backward(_datums(prompts, groups), "ppo")
        client.optim_step(AdamParams(lr=1e-2))
        before = vs.version
        sampler = client.sampling_client()
        res2 = client.forward(_datums(prompts, _sample_all(sampler, prompts, 2, tokens // 2)), "ppo")
        report["vllm_on_policy_ratio_after_update"] = [res2.ratio_min, res2.ratio_mean, res2.ratio_max]
        spread = abs(res2.ratio_mean - 1) if cuda else max(abs(res2.ratio_min - 1), abs(res2.ratio_max - 1))
        check(
            vs.version == before + 1 and spread < bound,
            f"after an update vLLM serves adapter v{vs.version} (ratio mean {res2.ratio_mean:.5f})",
        )
    except Exception as exc:  # report, do not hide
        check(False, f"vLLM sampler raised {type(exc).__name__}: {exc}")
    pids = list(vs.engine_pids)
    vs.close()
    deadline = time.monotonic() + 30
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    check(not running(pids), f"vLLM engine processes gone after close ({len(pids)} started)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "auto"])
    ap.add_argument("--quick", action="store_true", help="reduced sizes (what the test suite runs)")
    ap.add_argument("--json", type=Path, help="also write the report to this file")
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_smoke: CUDA is not available (use --device cpu to run the same checks on CPU)")
    check = Checks()
    report: dict[str, Any] = {"quick": args.quick, "machine": os.uname().machine}
    t0 = time.perf_counter()
    run(args.device, args.quick, report, check)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["failures"] = check.failures
    text = json.dumps(report)
    print(text, flush=True)
    if args.json:
        args.json.write_text(text + "\n")
    sys.exit(1 if check.failures else 0)


if __name__ == "__main__":
    main()
