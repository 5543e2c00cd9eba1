"""A lean one-token forward for the local sampler's decode steps on Llama-family models (Llama, Qwen2).

At a small model's size a decode step is mostly Python around a few dozen small tensor ops: the
transformers forward builds a 4-d attention mask, runs its decorators, threads keyword arguments through
every layer and fills output containers. ``lean_decoder`` returns a forward that calls the model's own
modules (embedding, norms, projections, MLP, rotary embedding, output layer) with the same tensor ops in
the same order as transformers' SDPA path, and skips the rest. Measured on the tiny demo model (1
thread, 60 cached columns): 1.19 -> 0.72 ms a step at batch 1, 6.3 -> 5.3 ms at batch 64. Its logits are
transformers' bit for bit where no row has padding, and within float rounding otherwise (the two build the
masked attention differently; ``tests/test_backends_decode_step.py`` samples the same tokens with
logprobs within 1e-6, also on a grouped-query model).

In bf16 (``backend.dtype``, mixed precision) the attention of the one query is two matmuls and a softmax in
fp32 rather than SDPA, whose bf16 CPU kernel is the slower one at this shape (``_one_query_attention``).

It knows one layout: a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` with every layer full attention
through SDPA, the KV cache the engine's own (``retool.backends.engine.generation``: each layer's ``update``
appends a step and returns the whole cache). Anything else (PEFT wrappers, other architectures, sliding
windows, eager attention) gets ``None`` and decodes through the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

_FAMILIES = frozenset({"llama", "qwen2"})


class KVLayer(Protocol):
    """One layer of the engine's KV cache: append a step's keys and values, get the whole cache back."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


# (tokens [rows, 1], attention mask [rows, columns + 1], positions [rows, 1], the cache's layers) -> logits
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[KVLayer]], torch.Tensor]


Op = Callable[[torch.Tensor], torch.Tensor]


class _Model(Protocol):
    """What the lean forward reads of a transformers Llama / Qwen2 causal LM (typed for it)."""

    model: _Inner
    lm_head: Op


class _Inner(Protocol):
    embed_tokens: Op
    layers: Sequence[_Layer]
    norm: Op
    rotary_emb: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _Layer(Protocol):
    self_attn: _Attention
    input_layernorm: Op
    post_attention_layernorm: Op
    mlp: Op


class _Attention(Protocol):
    head_dim: int
    scaling: float
    num_key_value_groups: int
    q_proj: Op
    k_proj: Op
    v_proj: Op
    o_proj: Op


def lean_decoder(model: torch.nn.Module) -> DecodeStep | None:
    """The lean decode forward of ``model``, or None when ``model`` is not a layout it knows."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _FAMILIES:
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    inner = getattr(model, "model", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not hasattr(model, "lm_head") or not all(hasattr(inner, n) for n in names):
        return None
    return _LeanDecoder(cast(_Model, model)).step


class _LeanDecoder:
    def __init__(self, model: _Model) -> None:
        self.model = model

    @torch.no_grad()
    def step(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: list[KVLayer]
    ) -> torch.Tensor:
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, positions)
        # transformers' mask for one query row: attend where the 2-d mask is set (the causal part is all of it)
        allowed = mask[:, None, None, :].bool()
        for layer, kv in zip(inner.layers, cache, strict=True):
            x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, allowed, kv)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x))


def _attention(
    attn: _Attention,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    allowed: torch.Tensor,
    kv: KVLayer,
) -> torch.Tensor:
    """transformers' attention with its SDPA interface for one query position."""
    rows, dim = h.shape[0], attn.head_dim
    q = attn.q_proj(h).view(rows, 1, -1, dim).transpose(1, 2)
    k = attn.k_proj(h).view(rows, 1, -1, dim).transpose(1, 2)
    v = attn.v_proj(h).view(rows, 1, -1, dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = kv.update(k, v)
    groups = attn.num_key_value_groups
    if groups > 1:  # grouped-query attention, one query: transformers packs the query heads by group
        q = q.reshape(rows, q.shape[1] // groups, groups, dim)
    if q.dtype == torch.bfloat16:
        out = _one_query_attention(q, k, v, allowed, attn.scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=attn.scaling)
    out = out.reshape(rows, -1, 1, dim).transpose(1, 2).contiguous()
    return attn.o_proj(out.reshape(rows, 1, -1).contiguous())


def _one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query position in bf16 (mixed precision sampling): two bf16 matmuls around a
    softmax in fp32. On CPU, torch's bf16 SDPA kernel is slower than its fp32 one for a single query
    (SmolLM2's shapes, 200 cached columns, batch 8: 0.34 against 0.23 ms a layer); this takes 0.15 ms, its
    error against fp32 attention of the order of bf16 SDPA's (measured)."""
    # The cache's keys are a view of a buffer with spare columns: bf16 matmul against that view is ~2.7x
    # slower than a contiguous copy and the matmul together (64 rows, 200 columns, measured).
    scores = torch.matmul(q, k.contiguous().transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)
