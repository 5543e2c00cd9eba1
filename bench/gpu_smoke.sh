#!/usr/bin/env bash
# GPU smoke test of the local backend (no network needed; well under 5 minutes on one GPU):
#   bf16 on CUDA, concurrent batched sampling, on-policy ratio ~1, a few PPO steps, save/load in a fresh
#   client, and the vLLM sampler (LoRA hand-over) when vLLM is installed; then bench/backend.py on CUDA.
# Usage: bash bench/gpu_smoke.sh            (RETOOL_SMOKE_ALLOW_CPU=1 runs the same checks on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PWD}/src${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=cuda
if [[ "${RETOOL_SMOKE_ALLOW_CPU:-0}" == "1" ]]; then DEVICE=auto; fi
python - "$DEVICE" <<'PY'
import asyncio, json, math, sys, tempfile, time
from pathlib import Path

import torch

from retool.backends.local import LocalTrainingClient
from retool.backends.types import AdamParams, Datum, SamplingParams
from retool.backends.tinymodel import build_tiny_model

device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_smoke: CUDA is not available (set RETOOL_SMOKE_ALLOW_CPU=1 to run on CPU)")
failures: list[str] = []
report: dict[str, object] = {}


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


tmp = Path(tempfile.mkdtemp(prefix="retool_gpu_smoke_"))
model_dir = build_tiny_model(tmp / "model", size="demo", seed=0)
lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
client = LocalTrainingClient(model_dir, lora=lora, device=device, seed=0, sample_batch_size=64,
                             checkpoint_dir=tmp / "ckpt")
cuda = client.device.type == "cuda"
report["device"] = str(client.device)
report["dtype"] = str(client.dtype)
check((client.dtype == torch.bfloat16) == cuda, f"dtype {client.dtype} on {client.device}")
with torch.no_grad():  # LoRA B starts at zero; perturb it so the adapter matters for the checks below
    for name, p in client.model.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.02)

tok = client.tokenizer
prompts = [tok.encode(t, add_special_tokens=False) for t in
           ("Solve the problem.", "print(sum(range(10)))", "Traceback (most recent call last):", "42")]


async def sample_all(sampler, n_per_prompt: int, max_tokens: int):
    return await asyncio.gather(*[
        sampler.sample_async(p, n_per_prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
        for i, p in enumerate(prompts)])


sampler = client.sampling_client()
t0 = time.perf_counter()
groups = asyncio.run(sample_all(sampler, 16, 128))
dt = time.perf_counter() - t0
n_tok = sum(len(s.tokens) for g in groups for s in g)
report["hf_sampling_tokens_per_s"] = round(n_tok / dt, 1)
check(n_tok > 0, f"HF sampler: {n_tok} tokens from 64 sequences in {dt:.2f}s")


def datums_from(groups):
    out = []
    for gi, (p, g) in enumerate(zip(prompts, groups)):
        for si, s in enumerate(g):
            if not s.tokens:
                continue
            seq = p + s.tokens
            k = len(p) - 1
            adv = 1.0 if (si + gi) % 2 else -1.0
            out.append(Datum(seq[:-1], seq[1:], [0.0] * k + s.logprobs, [0.0] * k + [adv] * len(s.tokens),
                             [0.0] * k + [1.0 / len(s.tokens)] * len(s.tokens)))
    return out


datums = datums_from(groups)
res = client.forward(datums, "ppo")
report["hf_on_policy_ratio"] = [res.ratio_min, res.ratio_mean, res.ratio_max]
tol = 0.05 if cuda else 1e-3  # bf16 prefill+cache vs one full forward differ by rounding
check(abs(res.ratio_mean - 1) < tol and res.clip_fraction < 0.05,
      f"on-policy ratio mean {res.ratio_mean:.4f} (min {res.ratio_min:.3f} max {res.ratio_max:.3f}), "
      f"clip fraction {res.clip_fraction:.3f}")

t0 = time.perf_counter()
losses = []
for step in range(3):
    fb = client.forward_backward(datums, "ppo")
    opt = client.optim_step(AdamParams(lr=1e-3))
    losses.append(fb.loss)
    check(math.isfinite(fb.loss) and math.isfinite(opt.grad_norm), f"step {step}: loss {fb.loss:.4f} grad_norm {opt.grad_norm:.3f}")
dt = time.perf_counter() - t0
report["train_tokens_per_s"] = round(3 * sum(len(d) for d in datums) / dt, 1)

path = client.save_state("smoke")
expected = client.forward(datums, "ppo").loss
fresh = LocalTrainingClient(model_dir, lora=lora, device=device, seed=1, checkpoint_dir=tmp / "ckpt")
fresh.load_state(path)
got = fresh.forward(datums, "ppo").loss
# exact on CPU; on CUDA allow kernel-selection noise between two model instances
same = got == expected if not cuda else abs(got - expected) <= 1e-5 * max(1.0, abs(expected))
check(same, f"save/load reproduces the loss ({got!r} vs {expected!r})")
del fresh
if cuda:
    torch.cuda.empty_cache()

try:
    import vllm  # noqa: F401
except ImportError:
    print("skip  vLLM sampler (vllm not installed)")
else:
    try:
        from retool.backends.vllm_sampler import attach_vllm_sampler

        attach_vllm_sampler(client, gpu_memory_utilization=0.3)
        vs = client.sampling_client()  # hands the current adapter to vLLM
        t0 = time.perf_counter()
        vgroups = asyncio.run(sample_all(vs, 16, 128))
        dt = time.perf_counter() - t0
        n_tok = sum(len(s.tokens) for g in vgroups for s in g)
        report["vllm_sampling_tokens_per_s"] = round(n_tok / dt, 1)
        check(n_tok > 0, f"vLLM sampler: {n_tok} tokens in {dt:.2f}s")
        vres = client.forward(datums_from(vgroups), "ppo")
        report["vllm_on_policy_ratio"] = [vres.ratio_min, vres.ratio_mean, vres.ratio_max]
        check(abs(vres.ratio_mean - 1) < 0.1, f"vLLM on-policy ratio mean {vres.ratio_mean:.4f} "
              f"(min {vres.ratio_min:.3f} max {vres.ratio_max:.3f}) with the trainer's adapter")
        client.forward_backward(datums, "ppo")
        client.optim_step(AdamParams(lr=1e-2))
        vs = client.sampling_client()
        vres2 = client.forward(datums_from(asyncio.run(sample_all(vs, 4, 64))), "ppo")
        check(abs(vres2.ratio_mean - 1) < 0.1, f"after an update, vLLM follows the new adapter "
              f"(ratio mean {vres2.ratio_mean:.4f})")
    except Exception as exc:  # report, do not hide
        check(False, f"vLLM sampler raised {type(exc).__name__}: {exc}")

print(json.dumps(report))
sys.exit(1 if failures else 0)
PY
if [[ "$DEVICE" == "cuda" ]]; then
  python bench/backend.py --device cuda --size demo --samples 64 --tokens 128 --datums 64 --threads 4
fi
