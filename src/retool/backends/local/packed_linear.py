"""Prepacked oneDNN linears for CPU generation: ``PackedLinear`` runs on a copy of its weight laid out ahead
of time for oneDNN's kernel, ``can_pack`` says whether a model can use them and ``pack_linears`` swaps them
in over a model's own tensors (the sampling views of ``retool.backends.local.sampling_views`` and the
multi-LoRA engine of ``retool.backends.samplers.multi_lora`` generate through them)."""

from __future__ import annotations

import torch


class PackedLinear(torch.nn.Linear):
    """A linear layer that runs on a copy of its weight laid out ahead of time for oneDNN's kernel
    ("prepacked"), as torch's own compiler does for frozen CPU inference: at decode batch sizes the
    plain kernel re-lays the weight out on every call (measured with SmolLM2-135M on 2 cores: 1.3-2.7x
    faster, the 49k-row output layer 2x, results within 1e-6 relative: another summation order). Same
    parameters and state dict as ``nn.Linear``; ``pack`` must follow every change of the weight."""

    _packed: torch.Tensor | None = None

    @classmethod
    def sharing(cls, linear: torch.nn.Linear) -> PackedLinear:
        packed = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        packed.weight, packed.bias = linear.weight, linear.bias  # the same tensors, not copies
        return packed

    @torch.no_grad()
    def pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None or torch.is_grad_enabled():
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def can_pack(model: torch.nn.Module) -> bool:
    """Whether prepacked oneDNN linears (``PackedLinear``) can run this model: fp32 or bf16 on CPU, torch
    with oneDNN (bf16 packed: as fast as plain bf16 or faster at decode sizes, the output layer 2-2.7x;
    the same results, measured)."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: torch.nn.Module) -> list[PackedLinear]:
    """Replace every plain ``nn.Linear`` of ``model`` by a ``PackedLinear`` over the same tensors."""
    packed: list[PackedLinear] = []
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            replacement = PackedLinear.sharing(module)
            setattr(parent, child, replacement)
            packed.append(replacement)
    return packed
