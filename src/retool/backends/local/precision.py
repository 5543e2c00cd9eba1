"""The local backend's compute precision: which dtype its matmuls run in, decided once per client (and
which dtype training forwards autocast to when ``sft.autocast`` asks: ``autocast_dtype``).

``backend.dtype`` is the *compute* dtype. ``float32`` and ``float16`` mean what they say (the model is
held and computed in it, as before). ``bfloat16`` is mixed precision with fp32 masters:

- the trainable tensors (the LoRA adapters, or every weight in full fine-tuning) and AdamW's state stay
  fp32: the optimizer updates the fp32 master, so small updates are not lost to bf16's 8-bit mantissa;
- with LoRA the frozen base is *stored* in bf16: it never changes, so its bf16 copy needs no master (and
  trainer and sampler share it: no second copy, half the memory); PEFT keeps the adapters fp32;
- training forwards run under ``torch.autocast(bfloat16)`` (matmuls in bf16, the autocast cast of each
  fp32 master is differentiable, so gradients accumulate into the fp32 tensors; norms, softmax and the
  residual sums stay fp32 where autocast keeps them). Measured on SmolLM2-135M-shaped LoRA (4 x 256 tokens,
  1 thread, AMD EPYC with avx512_bf16): fp32 11.5 s a forward+backward, autocast over an fp32 base 5.6 s,
  a bf16-stored base without autocast 5.6 s, a bf16 base under autocast 4.6 s: the last is what this does;
- the sampler computes in bf16: the merged LoRA view (or, in full fine-tuning, a bf16 copy of the weights
  refreshed after every optimizer step), its prefix cache's KV in bf16.

So the sampler's logprobs are bf16 numerics and the trainer's a mixed forward: they differ even on the same
weights, which is what ``offpolicy/*`` measures and truncated importance sampling corrects
(``loss.tis_cap = "auto"`` turns TIS on when ``LocalTrainingClient.precision.mixed``).

``auto`` picks bfloat16 where it is native and pays: on CUDA when the device supports it, on a CPU that
computes bf16 natively (``avx512_bf16`` or ``amx_bf16`` among /proc/cpuinfo's flags; torch's own check
elsewhere) for a model of ``AUTO_BF16_MIN_HIDDEN`` or more hidden units. Below that, small matmuls are
slower in bf16 than in fp32's prepacked kernels (the tiny demo model, hidden 128: decode 1.7x slower at
batch 8, 2.8x at batch 64, measured), and on a CPU without native bf16 every bf16 op is emulated. Either way
``auto`` stays fp32 and says why (``Precision.reason``, logged when the client starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# "auto" computes in bf16 on a CPU only for models at least this wide (see the module docstring).
AUTO_BF16_MIN_HIDDEN = 512
CPUINFO = Path("/proc/cpuinfo")
_NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")
_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """What a client computes in, and why. ``mixed``: bf16 compute over fp32 masters (module docstring)."""

    compute: torch.dtype
    reason: str

    @property
    def mixed(self) -> bool:
        return self.compute == torch.bfloat16

    @property
    def name(self) -> str:
        return str(self.compute).removeprefix("torch.")

    def describe(self) -> str:
        masters = ", fp32 master weights and optimizer state" if self.mixed else ""
        return f"computes in {self.name}{masters} ({self.reason})"


def cpu_bf16_native(cpuinfo: str | None = None) -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and the evidence: the flags of ``cpuinfo`` (default: read
    /proc/cpuinfo), else torch's own check (other systems)."""
    if cpuinfo is None and CPUINFO.is_file():
        cpuinfo = CPUINFO.read_text(errors="replace")
    if cpuinfo is not None:
        flags: set[str] = set()
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags.update(value.split())
        if flags:
            found = [f for f in _NATIVE_FLAGS if f in flags]
            if found:
                return True, f"the CPU has {' and '.join(found)}"
            return False, "the CPU has no avx512_bf16 nor amx_bf16: bf16 would be emulated"
    native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return native, "torch reports native bf16 on this CPU" if native else "torch reports no native bf16"


def resolve_precision(
    setting: str, device: torch.device, hidden_size: int | None = None, cpuinfo: str | None = None
) -> Precision:
    """The precision ``backend.dtype = setting`` means for a model of ``hidden_size`` on ``device``."""
    if setting in _NAMED:
        return Precision(_NAMED[setting], "set by backend.dtype")
    if setting != "auto":
        raise ValueError(f"unknown dtype {setting!r}; use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision(torch.bfloat16, "auto: the GPU supports bf16")
        return Precision(torch.float32, "auto: the GPU has no bf16")
    if device.type != "cpu":
        return Precision(torch.float32, f"auto: fp32 on {device.type}")
    native, evidence = cpu_bf16_native(cpuinfo)
    if not native:
        return Precision(torch.float32, f"auto: {evidence}")
    if hidden_size is not None and hidden_size < AUTO_BF16_MIN_HIDDEN:
        return Precision(
            torch.float32,
            f"auto: {evidence}, but hidden size {hidden_size} < {AUTO_BF16_MIN_HIDDEN}: small matmuls "
            "are faster in fp32",
        )
    return Precision(torch.bfloat16, f"auto: {evidence}")


def hidden_size(config: object) -> int | None:
    """The width of a transformers config (text config of a multimodal one), if it says."""
    text = getattr(config, "text_config", None) or config
    value = getattr(text, "hidden_size", None)
    return int(value) if isinstance(value, int) else None


def load_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype to load weights in before the precision is known: fp32 for ``auto`` and ``bfloat16``
    (fp32 masters; a bf16 base is cast after loading), else the named dtype."""
    if setting in ("auto", "bfloat16"):
        return torch.float32
    return resolve_precision(setting, device).compute


@torch.no_grad()
def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s floating parameters to ``dtype`` in place (new storage), leaving its buffers
    (rotary frequencies and the like) in their own dtype, unlike ``module.to``."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``setting`` asks training forwards to autocast to: ``off`` None, ``bfloat16``, or
    ``auto``: bfloat16 where the hardware computes it natively (a CUDA device that supports it; a CPU with
    AVX512-BF16 or AMX, where its matmuls run ~2x fp32's: 1.66x on a SmolLM2 LoRA step), else None."""
    if setting == "off":
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    if setting != "auto":
        raise ValueError(f"autocast must be off, bfloat16 or auto, not {setting!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and cpu_bf16_native()[0] else None
