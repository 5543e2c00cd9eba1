"""Compute precision of the local backend (``retool.backends.local.precision``): the CPU detection and what
``backend.dtype = "auto"`` resolves to, the fp32 master copy under bf16 compute (LoRA and full fine-tuning),
the sampler in bf16 (merged view, full-FT copy, frozen copies, the multi-LoRA engine), the sampler/trainer
mismatch metrics (non-zero under bf16, float rounding in fp32) and TIS on by default when they differ.

The bf16 tests run where the CPU computes bf16 natively and skip, saying so, where it would be emulated."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from retool.backends.interface.clients import run_sync
from retool.backends.interface.types import AdamParams, Datum, ForwardBackwardResult, Sample, SamplingParams
from retool.backends.local.client import LocalLoraSpec, LocalTrainingClient, load_base_model
from retool.backends.local.precision import (
    AUTO_BF16_MIN_HIDDEN,
    cast_parameters,
    cpu_bf16_native,
    resolve_precision,
)

NATIVE, EVIDENCE = cpu_bf16_native()
needs_bf16 = pytest.mark.skipif(not NATIVE, reason=f"bf16 is not native on this CPU ({EVIDENCE})")
LORA = LocalLoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj"))
CPU = torch.device("cpu")

X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 fma\n"
X86_AMX = "flags\t\t: fpu avx2 amx_tile amx_bf16\n"
X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 fma\n"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_cpu_detection_reads_the_flags() -> None:
    assert cpu_bf16_native(X86_BF16) == (True, "the CPU has avx512_bf16")
    assert cpu_bf16_native(X86_AMX) == (True, "the CPU has amx_bf16")
    native, why = cpu_bf16_native(X86_AVX2)
    assert not native and "emulated" in why
    # No flags line (another system): torch's own check decides.
    torch_native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert cpu_bf16_native("model name: something")[0] is torch_native


def test_auto_resolves_by_cpu_and_model_width_and_names_override() -> None:
    wide = AUTO_BF16_MIN_HIDDEN
    assert resolve_precision("auto", CPU, wide, X86_BF16).compute == torch.bfloat16
    assert resolve_precision("auto", CPU, wide, X86_AMX).mixed
    emulated = resolve_precision("auto", CPU, wide, X86_AVX2)
    assert emulated.compute == torch.float32 and "emulated" in emulated.reason
    small = resolve_precision("auto", CPU, 128, X86_BF16)
    assert small.compute == torch.float32 and "hidden size 128" in small.reason
    # A named dtype overrides the detection either way.
    assert resolve_precision("bfloat16", CPU, 32).compute == torch.bfloat16
    assert resolve_precision("float32", CPU, wide).compute == torch.float32
    assert "fp32 master" in resolve_precision("bfloat16", CPU).describe()
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_precision("int8", CPU)


def test_cast_parameters_keeps_buffers() -> None:
    module = torch.nn.BatchNorm1d(3)
    cast_parameters(module, torch.bfloat16)
    assert module.weight.dtype == torch.bfloat16 and module.running_mean.dtype == torch.float32


def test_auto_keeps_the_tiny_model_in_fp32(tiny_model_dir: Path) -> None:
    """The tiny models stay fp32 under ``auto`` (bf16 is slower at their size): results unchanged."""
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", seed=0)
    assert c.dtype == torch.float32 and not c.precision.mixed and c.precision_mismatch is None
    assert all(p.dtype == torch.float32 for p in c.model.parameters())


def _rl_datums(c: LocalTrainingClient, seed: int = 1) -> list[Datum]:
    prompt = c.tokenizer.encode("Solve the problem.", add_special_tokens=False)
    samples = c.sample(prompt, 4, SamplingParams(max_tokens=16, temperature=1.0, seed=seed))
    datums = []
    for s in samples:
        seq, n0, n = prompt + s.tokens, len(prompt) - 1, len(s.tokens)
        datums.append(
            Datum(
                input_tokens=seq[:-1],
                target_tokens=seq[1:],
                logprobs=[0.0] * n0 + list(s.logprobs),
                advantages=[0.0] * n0 + [1.0] * n,
                weights=[0.0] * n0 + [1.0] * n,
            )
        )
    return datums


def _step(c: LocalTrainingClient) -> ForwardBackwardResult:
    fb = c.forward_backward(_rl_datums(c), "ppo", {"tis_cap": 2.0})
    c.optim_step(AdamParams(lr=1e-2))
    return fb


def _optimizer_dtypes(c: LocalTrainingClient) -> set[torch.dtype]:
    assert c.optimizer is not None
    return {v.dtype for s in c.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim}


def test_fp32_mismatch_is_float_rounding(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=LORA, device="cpu", dtype="float32", seed=0)
    fb = _step(c)
    assert fb.mismatch_tokens > 0 and fb.logprob_diff_max < 1e-5 and fb.kl_k3 < 1e-10
    assert fb.tis_truncated == 0.0


@needs_bf16
def test_bf16_lora_keeps_fp32_masters_and_samples_in_bf16(tiny_model_dir: Path, tmp_path: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=LORA, device="cpu", dtype="bfloat16", seed=0)
    assert c.precision.mixed and c.precision_mismatch is not None
    assert {p.dtype for p in c.trainable_parameters()} == {torch.float32}
    assert {p.dtype for p in c.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    before = [p.detach().clone() for p in c.trainable_parameters()]
    fb = _step(c)
    assert fb.mismatch_tokens > 0 and fb.logprob_diff_mean > 1e-5 and fb.kl_k3 > 0  # bf16 numerics
    assert _optimizer_dtypes(c) == {torch.float32}
    assert all(p.grad is None for p in c.trainable_parameters())
    # An update far below bf16's resolution of the weights still moves the fp32 masters.
    assert any(not torch.equal(a, p) for a, p in zip(before, c.trainable_parameters(), strict=True))
    sampler = c.sampling_model()
    assert next(sampler.parameters()).dtype == torch.bfloat16
    saved = Path(c.save_state(str(tmp_path / "state")))
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(saved / "adapter_model.safetensors")).values()} == {torch.float32}


@needs_bf16
def test_bf16_full_finetuning_masters_and_a_bf16_sampling_copy(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", dtype="bfloat16", seed=0)
    assert {p.dtype for p in c.model.parameters()} == {torch.float32}
    _step(c)
    assert _optimizer_dtypes(c) == {torch.float32}
    view = c.sampling_model()
    assert view is not c.model
    for master, copied in zip(c.model.parameters(), view.parameters(), strict=True):
        assert copied.dtype == torch.bfloat16 and torch.equal(copied, master.detach().to(torch.bfloat16))
    # The copy follows the next optimizer step; buffers (rotary frequencies) stay the trainer's own.
    _step(c)
    master = next(c.model.parameters())
    assert torch.equal(next(c.sampling_model().parameters()), master.detach().to(torch.bfloat16))
    assert all(b.dtype == torch.float32 for b in view.buffers() if b.is_floating_point())


@needs_bf16
def test_bf16_frozen_sampler_samples_in_bf16(tiny_model_dir: Path) -> None:
    c = LocalTrainingClient(tiny_model_dir, lora=None, device="cpu", dtype="bfloat16", seed=0)
    frozen = run_sync(c.frozen_sampling_client_async())
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}  # type: ignore[attr-defined]
    prompt = c.tokenizer.encode("42", add_special_tokens=False)
    (sample,) = frozen.sample(prompt, 1, SamplingParams(max_tokens=6, temperature=0.0))
    assert len(sample.tokens) == 6 and all(lp <= 0 for lp in sample.logprobs)


@needs_bf16
def test_bf16_shared_base_and_multi_lora_engine(tiny_model_dir: Path) -> None:
    from retool.backends.samplers.multi_lora import MultiLoraEngine

    base = load_base_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in base.parameters()} == {torch.bfloat16}
    clients = [
        LocalTrainingClient(tiny_model_dir, lora=LORA, device="cpu", seed=s, shared_base=base) for s in (0, 1)
    ]
    for c in clients:
        assert c.precision.mixed and {p.dtype for p in c.trainable_parameters()} == {torch.float32}
        _step(c)
    frozen = [run_sync(c.frozen_sampling_client_async()) for c in clients]
    engine = MultiLoraEngine(base, clients[0])
    shared = [engine.sampler_for(c, f.model) for c, f in zip(clients, frozen, strict=True)]  # type: ignore[attr-defined]
    assert all(s is not None for s in shared)
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def both() -> list[list[Sample]]:
        return list(await asyncio.gather(*[s.sample_async(prompt, 1, params) for s in shared if s]))

    together = run_sync(both())
    alone = [f.sample(prompt, 1, params) for f in frozen]
    for g, w in zip(together, alone, strict=True):  # bf16 rounding: close, not bitwise
        assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=0.1)
    engine.close()


def test_tis_auto_follows_the_backend() -> None:
    from retool.config import DEFAULT_TIS_CAP, load_config
    from retool.train.loop import _loss_config, resolve_tis_cap

    class Backend:
        def __init__(self, why: str | None) -> None:
            self.precision_mismatch = why

    cfg = load_config("tiny")
    assert cfg.loss.tis_cap == "auto"
    assert resolve_tis_cap("auto", Backend(None)) == 0.0  # type: ignore[arg-type]
    assert resolve_tis_cap("auto", Backend("bf16 sampler")) == DEFAULT_TIS_CAP  # type: ignore[arg-type]
    assert resolve_tis_cap(3.0, Backend("bf16 sampler")) == 3.0  # type: ignore[arg-type]
    assert resolve_tis_cap(0.0, Backend("bf16 sampler")) == 0.0  # type: ignore[arg-type]
    assert _loss_config(cfg, 0.0) == {"clip_low": 0.8, "clip_high": 1.28}  # fp32: as before
    assert _loss_config(cfg, 2.0) == {"clip_low": 0.8, "clip_high": 1.28, "tis_cap": 2.0}
    assert load_config("tiny", ["backend.kind='tinker'"]).loss.tis_cap == "auto"  # auto is off remotely


def test_one_query_bf16_attention_is_sdpa_within_bf16_rounding() -> None:
    from retool.backends.engine.decode_step import _one_query_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 3, 3, 64), torch.randn(4, 3, 50, 64), torch.randn(4, 3, 50, 64)
    allowed = torch.ones(4, 1, 1, 50, dtype=torch.bool)
    allowed[0, ..., :7] = False  # a left-padded row
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.125)
    got = _one_query_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), allowed, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)
