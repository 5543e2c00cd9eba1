"""One generation engine for every LoRA adapter on a shared base (``retool serve``'s one base, many adapters).

``MultiLoraEngine`` holds a module tree over the shared base's tensors (``share_module``) whose every
``nn.Linear`` is a ``_RowLoraLinear``: it runs the base projection once for the whole batch and then adds,
for each group of rows sampling through the same adapter, that adapter's ``scale * B(A x)`` to those rows
only (the multi-LoRA trick of Punica / S-LoRA / PEFT's ``adapter_names``, here over adapters that live in
different clients' PEFT models). Rows of the base itself (``adapter=None``) get no delta. One
``ContinuousGenerator`` (``retool.backends.engine.generation``) on one thread decodes the rows of every adapter
together: before each forward it hands the engine each row's adapter (``_select``), so requests of eight
clients with eight adapters share decode steps as eight requests of one adapter do. With three or more
adapters on a linear, their rows' A and scaled B are stacked once per batch composition and applied by
two batched matmuls (``torch.bmm``) instead of two matmuls per adapter group.

Weights: an adapter is registered from a PEFT model whose base linears *are* the engine's (same tensors);
the engine keeps references to its LoRA tensors, no copies (on a bf16 base, mixed precision: bf16 copies
of the fp32 adapters), so they must not change while it is registered: the server registers only frozen copies (``frozen_copy``) and clients that never train
(samplers of saved paths). Adapters the engine cannot run (DoRA and other variants, LoRA on embeddings,
biases, another base) are refused (``sampler_for`` returns ``None``) and sample as before, through their
own PEFT model. A row only ever gets its own adapter's tensors: ``_select`` maps rows to adapters by the
key each request carries (``LocalSamplingClient.adapter``), and the prefix cache keeps each adapter's KV
in its own space.

Base linears are prepacked for oneDNN (``PackedLinear``) on fp32 or bf16 CPU, as the merged sampler of an
in-process client is: one packed copy of the base's linear weights per engine (per base model, not per
client); ``pack=False`` keeps memory at the base plus the adapters.

Numerics: per-row deltas and a base projection over a larger batch sum in other orders than a single
adapter's PEFT forward, so tokens are the same as sampling each adapter alone at fixed seeds and logprobs
equal within float rounding (~1e-5), not bitwise (``tests/test_serve_multi_lora.py``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.loading import share_module
from retool.backends.local.packed_linear import PackedLinear, can_pack
from retool.backends.local.sampling_client import LocalSamplingClient
from retool.backends.local.stats import BackendStats

# Stacked per-row LoRA tensors of one linear at most this many elements (else a loop over adapter groups)
STACK_ELEMENTS = 1 << 22
# At least this many adapters with a delta for a linear in one batch before their tensors are stacked
STACK_MIN_ADAPTERS = 3

# (rows, A [rank, in], B [out, rank], scale): one adapter's delta for the rows it owns (``None``: all)
_Delta = tuple[torch.Tensor | slice | None, torch.Tensor, torch.Tensor, float]


@dataclass(eq=False)
class LoraWeights:
    """One registered adapter: (A, B, scale) per adapted linear, by module name in the base model."""

    key: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


class _RowLoraLinear(torch.nn.Module):
    """A base linear plus, per group of rows, that group's adapter delta (see the module docstring)."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.deltas: list[_Delta] = []
        # Many adapters in one batch: every row's A and scaled B stacked ([rows, rank, in], [rows, out,
        # rank]; zeros for rows without a delta here) and applied by two batched matmuls, in place of
        # two matmuls per adapter group (Python dispatch per group and layer dominated at 8 adapters).
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def stack(self, groups: list[tuple[list[int], torch.Tensor, torch.Tensor, float]], rows: int) -> bool:
        """Use stacked per-row tensors for ``groups`` (row indices, A, B, scale) if they are small enough."""
        rank = max(a.shape[0] for _, a, _, _ in groups)
        a0 = groups[0][1]
        if rows * rank * (self.base.in_features + self.base.out_features) > STACK_ELEMENTS:
            return False
        a_rows = a0.new_zeros((rows, rank, self.base.in_features))
        b_rows = a0.new_zeros((rows, self.base.out_features, rank))
        for idx, a, b, scale in groups:
            index = torch.tensor(idx, dtype=torch.long, device=a.device)
            a_rows[index, : a.shape[0]] = a
            b_rows[index, :, : b.shape[1]] = b * scale
        self.stacked = (a_rows.transpose(1, 2), b_rows.transpose(1, 2))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        if self.stacked is not None:
            a_t, b_t = self.stacked
            return out + torch.bmm(torch.bmm(x, a_t), b_t)
        for rows, a, b, scale in self.deltas:
            if rows is None:  # every row: as PEFT computes it (B(A x) * scale, added)
                out = out + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scale
                continue
            delta = torch.nn.functional.linear(torch.nn.functional.linear(x[rows], a), b) * scale
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


def _row_groups(keys: list[Hashable], device: torch.device) -> dict[Hashable, torch.Tensor | slice | None]:
    """Each adapter's rows: ``None`` for all of them, a slice when contiguous, else an index tensor."""
    rows: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        rows.setdefault(key, []).append(i)
    out: dict[Hashable, torch.Tensor | slice | None] = {}
    for key, idx in rows.items():
        if len(idx) == len(keys):
            out[key] = None
        elif idx[-1] - idx[0] + 1 == len(idx):
            out[key] = slice(idx[0], idx[-1] + 1)
        else:
            out[key] = torch.tensor(idx, dtype=torch.long, device=device)
    return out


class MultiLoraEngine:
    """The shared base's module tree with per-row adapters and its generation engine (module docstring)."""

    def __init__(self, base: torch.nn.Module, owner: LocalTrainingClient, pack: bool = True) -> None:
        self.model = share_module(base)
        self.model.eval()
        self.layers: dict[str, _RowLoraLinear] = {}
        for name, module in list(self.model.named_modules()):
            if type(module) is torch.nn.Linear:
                inner: torch.nn.Linear = module
                if pack and can_pack(self.model):
                    inner = PackedLinear.sharing(module)
                    inner.pack()
                parent_name, _, child = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                self.layers[name] = _RowLoraLinear(inner)
                setattr(parent, child, self.layers[name])
        self._adapters: weakref.WeakValueDictionary[int, LoraWeights] = weakref.WeakValueDictionary()
        self._keys = itertools.count(1)
        self._selected: list[Hashable] | None = None
        self.stats = BackendStats()
        self.device = owner.device
        self.thread = owner._worker_thread("retool-multi-lora")
        self.engine = owner.make_engine(
            lambda: self.model,
            lambda: "shared-base",  # the base never changes; adapters keep apart by cache space
            self.thread,
            stats=self.stats,
            select_adapters=self._select,
        )

    def register(self, model: Any) -> LoraWeights | None:
        """The LoRA tensors of ``model`` (a PEFT model over this engine's base), or ``None`` where the
        engine cannot run them; held only as long as the returned object is."""
        from peft.tuners.lora import Linear as LoraLinear  # deferred: peft is needed with LoRA only
        from peft.tuners.tuners_utils import BaseTunerLayer  # deferred: as above

        layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        modules: Any = model.get_base_model().named_modules()
        for name, mod in modules:
            if not isinstance(mod, BaseTunerLayer):
                continue
            mine = self.layers.get(name)
            if not isinstance(mod, LoraLinear) or mine is None or len(mod.active_adapters) != 1:
                return None
            (adapter,) = mod.active_adapters
            if adapter not in mod.lora_A:
                continue
            a: Any = mod.lora_A[adapter]
            b: Any = mod.lora_B[adapter]
            plain = isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear) and b.bias is None
            same_base = mod.base_layer.weight is mine.base.weight
            if not plain or not same_base or adapter in getattr(mod, "lora_variant", {}) or mod.merged:
                return None
            scale = mod.scaling[adapter]
            dtype = mine.base.weight.dtype  # a bf16 base: fp32 adapters copied to bf16 (else the tensors)
            layers[name] = (a.weight.detach().to(dtype), b.weight.detach().to(dtype), float(scale))
        weights = LoraWeights(next(self._keys), layers)
        self._adapters[weights.key] = weights
        return weights

    def sampler_for(self, owner: LocalTrainingClient, model: Any) -> SharedBaseSamplingClient | None:
        """A sampler of ``model``'s weights (a PEFT model, or the plain shared base) on this engine."""
        weights = self.register(model) if hasattr(model, "get_base_model") else None
        if weights is None and hasattr(model, "get_base_model"):
            return None
        return SharedBaseSamplingClient(owner, self, model, weights)

    def _select(self, keys: list[Hashable]) -> None:
        """Engine thread, before each forward: give every linear the deltas of the rows' adapters."""
        if keys == self._selected:
            return
        for layer in self.layers.values():
            layer.deltas, layer.stacked = [], None
        groups: dict[str, list[tuple[list[int], torch.Tensor, torch.Tensor, float]]] = {}
        for key, rows in _row_groups(keys, self.device).items():
            weights = self._adapters.get(key) if isinstance(key, int) else None
            if weights is None:  # the base (or a request cancelled meanwhile: its rows are dropped)
                continue
            idx = [i for i, k in enumerate(keys) if k == key]
            for name, (a, b, scale) in weights.layers.items():
                self.layers[name].deltas.append((rows, a, b, scale))
                groups.setdefault(name, []).append((idx, a, b, scale))
        for name, adapted in groups.items():
            if len(adapted) >= STACK_MIN_ADAPTERS:
                self.layers[name].stack(adapted, len(keys))
        self._selected = list(keys)

    def close(self) -> None:
        self.thread.shutdown(wait=False)


class SharedBaseSamplingClient(LocalSamplingClient):
    """A sampler of one adapter (or the base) whose requests run on a ``MultiLoraEngine``; prompt
    logprobs are scored by ``model`` (its PEFT model) on the engine's thread."""

    def __init__(
        self, owner: LocalTrainingClient, engine: MultiLoraEngine, model: Any, weights: LoraWeights | None
    ) -> None:
        super().__init__(owner, gather_ms=owner._gather_ms, engine=engine.engine)
        self._worker = engine.thread
        self.model = model
        self.weights = weights  # the engine holds the adapter only while this sampler does
        self.adapter = None if weights is None else weights.key

    def _scoring_model(self) -> Any:
        return self.model
