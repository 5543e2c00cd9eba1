"""The modules generation runs on when it cannot run on the trainer's model itself, each built from it:

- ``MergedLoraView`` (LoRA, ``merge_lora_for_sampling``, default on): a plain copy of the base model whose
  adapted linears hold ``W + scale * B @ A`` (every other tensor is shared with the trainer, so the copy
  costs only the adapted weights), refreshed lazily when the weights version changes. Through the PEFT
  wrapper every adapted linear costs three extra small matmuls and Python dispatch per decoded token.
  Merged and unmerged forwards agree to float rounding (ratio 1 within ~1e-5, not bitwise).
- ``CastView`` (full fine-tuning in mixed precision, ``retool.backends.local.precision``): a copy whose
  parameters are bf16 copies of the fp32 masters (buffers shared).
- ``frozen_copy``: a copy that owns every trainable tensor, for off-policy pipelining (the frozen sampler
  of ``retool.backends.local.sampling_client``).

The two views prepack their linears for oneDNN on CPU (``retool.backends.local.packed_linear``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from retool.backends.local.packed_linear import can_pack, pack_linears
from retool.backends.local.precision import cast_parameters


class MergedLoraView:
    """A LoRA-free copy of a PEFT model for generation: adapted linears hold merged weights, every other
    parameter and buffer is the trainer's own tensor (shared, not copied)."""

    def __init__(self, model: torch.nn.Module, pairs: list[tuple[Any, torch.nn.Linear]]) -> None:
        self.model = model
        self._pairs = pairs  # (live LoRA layer, its merged plain linear in the copy)
        self._version = -1
        # Every linear of the copy prepacked (merged and shared ones: a weight load may change either).
        self._packed = pack_linears(model) if can_pack(model) else []

    @classmethod
    def build(cls, peft_model: Any) -> MergedLoraView | None:
        from peft.tuners.lora import Linear as LoraLinear  # deferred: peft is needed with LoRA only

        base = peft_model.get_base_model()
        live = {name: mod for name, mod in base.named_modules() if isinstance(mod, LoraLinear)}
        if not live or any(len(m.active_adapters) != 1 for m in live.values()):
            return None
        # Deep-copy the module tree but let the copy reference the trainer's parameters and buffers.
        memo: dict[int, torch.Tensor] = {id(t): t for t in base.parameters()}
        memo.update({id(t): t for t in base.buffers()})
        plain = copy.deepcopy(base, memo)
        pairs: list[tuple[Any, torch.nn.Linear]] = []
        for name, layer in live.items():
            inner = layer.base_layer
            if not isinstance(inner, torch.nn.Linear):  # a LoRA layout this view does not know
                return None
            merged = torch.nn.Linear(
                inner.in_features, inner.out_features, bias=inner.bias is not None, device="meta"
            )
            merged.weight = torch.nn.Parameter(inner.weight.detach().clone(), requires_grad=False)
            merged.bias = inner.bias  # shared
            parent_name, _, child = name.rpartition(".")
            parent = plain.get_submodule(parent_name) if parent_name else plain
            setattr(parent, child, merged)
            pairs.append((layer, merged))
        plain.requires_grad_(False)
        return cls(plain, pairs)

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        if version == self._version:
            return
        for layer, merged in self._pairs:
            (adapter,) = layer.active_adapters
            delta = layer.get_delta_weight(adapter) if adapter in layer.lora_A else None
            merged.weight.copy_(layer.base_layer.weight)
            if delta is not None:
                merged.weight.add_(delta.to(merged.weight.dtype))
        for linear in self._packed:
            linear.pack()
        self._version = version


class CastView:
    """Full fine-tuning in mixed precision: a copy of the fp32 model whose parameters are ``dtype`` copies
    of the trainer's (buffers shared), for generation; refreshed from the masters when the weights change."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        memo: dict[int, torch.Tensor] = {id(b): b for b in model.buffers()}
        with torch.no_grad():
            self.model = copy.deepcopy(model, memo)
        cast_parameters(self.model, dtype)
        self.model.requires_grad_(False)
        self.model.eval()
        self._pairs = list(zip(model.parameters(), self.model.parameters(), strict=True))
        self._version = -1
        self._packed = pack_linears(self.model) if can_pack(self.model) else []

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        if version == self._version:
            return
        for master, copied in self._pairs:
            copied.copy_(master)
        for linear in self._packed:
            linear.pack()
        self._version = version


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of ``model`` in eval mode that owns a copy of every trainable tensor and shares the rest;
    with ``dtype``, its copies are in that dtype (full fine-tuning in mixed precision samples in bf16)."""
    memo: dict[int, torch.Tensor] = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    with torch.no_grad():
        frozen = copy.deepcopy(model, memo)
        if dtype is not None:
            for p, q in zip(model.parameters(), frozen.parameters(), strict=True):
                if p.requires_grad and q.is_floating_point():
                    q.data = q.data.to(dtype)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen
