"""Training forwards that run the prefix a micro-batch's rows share once, not once per row.

Why: the rows of an RL step share long prefixes (the system prompt, the tool schema; within a group the
whole question), and their loss weights are zero there, yet a plain forward computes every row's prefix
again, forward and backward. Measured on the peer bench's job (SmolLM2, prompts of ~290 tokens whose
first ~250 every row shares, completions of tens of tokens) that repeated prefix was most of a training
step.

How: the shared prefix runs once (one row, with gradients), its KV is expanded to every row (a view: the
gradient of each row's attention to it adds up in the one prefix pass) and each row's own tokens run after
it. The logits of the prefix positions are the same for every row (the same inputs before them), so each
row's target logprob there is gathered from the one prefix pass; from the first own position on, from the
row's own pass. The result is the plain forward's ``[rows, width]`` logprob tensor, equal up to float
rounding (matmuls of other shapes), gradients included.

The same logits give the policy's entropy at the positions asked for (``logprobs_and_entropy``: the
trainer's ``policy/entropy``), without gradient, a bounded number of positions at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from retool.backends.engine.generation import cache_kwarg, cache_layers, output_cache, shared_prefix_length
from retool.backends.interface.types import Datum

# A second forward call costs about this many padded tokens of a micro-batch (the demo preset's measured
# micro-batch overhead); sharing pays when it saves more than that.
SHARE_MIN_SAVED_TOKENS = 64
# Positions whose entropy is computed at once: bounds the [positions, vocab] fp32 temporaries (with a
# 150k-token vocabulary, about 150 MB each).
ENTROPY_CHUNK = 256


def shared_input_prefix(datums: Sequence[Datum], rows: list[int]) -> int:
    """How many leading input tokens every row of the micro-batch ``rows`` shares (0: not worth a
    second forward); each row keeps at least one position of its own."""
    if len(rows) < 2:
        return 0
    shared = shared_prefix_length([datums[i].input_tokens for i in rows])
    return shared if shared * (len(rows) - 1) >= SHARE_MIN_SAVED_TOKENS else 0


def _gather_logprobs(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    # gather - logsumexp avoids materialising a second [B, T, V] log_softmax tensor
    return logits.gather(-1, tgt[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _entropy_at(logits: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` at the positions ``at`` marks (bool, ``logits``' shape
    without the vocabulary), 0 elsewhere; float32, no gradient."""
    out = torch.zeros(at.shape, dtype=torch.float32, device=logits.device)
    positions = at.reshape(-1).nonzero().squeeze(1)
    if not len(positions):
        return out
    flat = logits.detach().reshape(-1, logits.shape[-1])
    values = []
    with torch.no_grad():
        for chunk in positions.split(ENTROPY_CHUNK):
            logp = torch.log_softmax(flat.index_select(0, chunk).float(), dim=-1)
            # a -inf logit (a masked token) has p = 0 and adds nothing, not NaN
            values.append(-torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0).sum(-1))
        out.reshape(-1)[positions] = torch.cat(values)
    return out


def target_logprobs(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, tgt: torch.Tensor, shared: int = 0
) -> torch.Tensor:
    """Float32 logprob of each target token (``[rows, width]``, with grad if enabled); the first
    ``shared`` input positions, identical in every row, run once."""
    return logprobs_and_entropy(model, ids, mask, tgt, shared)[0]


def logprobs_and_entropy(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    tgt: torch.Tensor,
    shared: int = 0,
    entropy_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``target_logprobs``, and from the same logits the policy's entropy at the positions
    ``entropy_at`` marks (bool ``[rows, width]``; 0 elsewhere; None when not asked)."""
    if not shared:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        entropy = None if entropy_at is None else _entropy_at(logits, entropy_at)
        return _gather_logprobs(logits, tgt), entropy
    rows, width = ids.shape
    head = model(input_ids=ids[:1, :shared], attention_mask=mask[:1, :shared], use_cache=True)
    head_logits = head.logits.float()  # [1, shared, vocab]: every row's, the same inputs before them
    head_lp = head_logits.expand(rows, -1, -1).gather(-1, tgt[:, :shared, None]).squeeze(-1)
    head_lp = head_lp - torch.logsumexp(head_logits, dim=-1)
    kv = [(layer.keys, layer.values) for layer in cache_layers(output_cache(head))]
    cache = DynamicCache(
        ddp_cache_data=[(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in kv]
    )
    pos = torch.arange(shared, width, device=ids.device).expand(rows, -1)
    tail = model(
        input_ids=ids[:, shared:], attention_mask=mask, position_ids=pos, **{cache_kwarg(model): cache}
    )
    tail_logits = tail.logits.float()
    lp = torch.cat([head_lp, _gather_logprobs(tail_logits, tgt[:, shared:])], dim=1)
    if entropy_at is None:
        return lp, None
    # the prefix's entropy once (where any row asks for it), then each row's own positions
    head_at = entropy_at[:, :shared]
    head_entropy = _entropy_at(head_logits, head_at.any(dim=0, keepdim=True)).expand(rows, -1)
    entropy = torch.cat(
        [torch.where(head_at, head_entropy, 0.0), _entropy_at(tail_logits, entropy_at[:, shared:])], dim=1
    )
    return lp, entropy
