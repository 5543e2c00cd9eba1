"""The local sampler's own decoding loop: batched, KV-cached, left-padded generation with per-sequence RNG.

Why not ``model.generate``: we need (a) the model's *raw* logprob of every chosen token (temperature,
top-k and top-p only shape the choice), (b) one ``torch.Generator`` per sequence so that a seeded request
gives the same tokens whatever else shares its batch, (c) stop strings checked on the decoded tail of the
completion, with the stop tokens kept in the output, and (d) per-row temperature / top-p / top-k.

Each step draws exactly one uniform number per sequence from its generator and picks a token by
inverse-CDF over the filtered distribution, so the random stream never depends on the batch shape.
Rows that finish are dropped from the KV cache once they are the majority, so long tails stay cheap.

Shared prompt prefix: the prompts of one batch usually start alike (system prompt, tool schema, chat
header; a group's branches share the whole question). The longest common prefix is run once, its KV
cache repeated for every row, and only the rest of each prompt is prefilled, laid out as ``[shared
prefix][left padding][own suffix]`` (the attention mask hides the padding, positions continue from the
prefix). With a ~100-token system prompt and short questions this removes most of the prefill work, which
dominates multi-turn sampling on CPU (measured in ``bench/real_model.py``).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from retool.backends.types import Sample, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class GenRequest:
    """One sequence to generate: the prompt, its params and the seed of its private generator."""

    prompt: list[int]
    params: SamplingParams
    seed: int


def _stop_sets(params: SamplingParams, eos_ids: set[int]) -> tuple[set[int], list[str]]:
    ids = set(eos_ids)
    strings: list[str] = []
    for item in params.stop:
        if isinstance(item, str):
            if item:
                strings.append(item)
        else:
            ids.add(int(item))
    return ids, strings


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; older versions ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    base = getattr(model, "get_base_model", None)
    if base is not None and "cache" in inspect.signature(base().forward).parameters:
        return "cache"
    return "past_key_values"


def _output_cache(out: Any) -> Any:
    for key in ("cache", "past_key_values"):
        value = out.get(key) if hasattr(out, "get") else getattr(out, key, None)
        if value is not None:
            return value
    raise RuntimeError("model returned no KV cache")


# Below this many shared tokens, one batched prefill is as cheap as a prefix pass plus a suffix pass.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the common prefix of ``prompts``, leaving every prompt at least one token of its own
    (the suffix pass must produce each row's next-token logits)."""
    if len(prompts) < 2:
        return 0
    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Pick one token per row by inverse CDF of ``uniforms`` over the tempered, top-k/top-p-filtered
    distribution; rows with temperature 0 are greedy. All inputs are per-row tensors on one device."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    filtered = bool(((top_p < 1.0) | ((top_k > 0) & (top_k < vocab))).any())
    if filtered:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        keep = ranks < k[:, None]
        cum_before = torch.cumsum(probs, dim=-1) - probs
        keep &= cum_before < top_p[:, None]
        keep[:, 0] = True  # the most likely token always survives
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    else:
        order = None
        probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
    # right=True: the first slot whose cdf exceeds the target, which always has positive probability.
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1).squeeze(-1)
    picked = idx if order is None else order.gather(-1, idx[:, None]).squeeze(-1)
    argmax = logits.argmax(dim=-1)
    return torch.where(greedy, argmax, picked)


@torch.no_grad()
def generate_batch(
    model: Any,
    tokenizer: Any,
    requests: Sequence[GenRequest],
    *,
    pad_id: int,
    eos_ids: set[int],
    max_context: int,
    device: torch.device,
    timings: dict[str, float] | None = None,
    share_prefix: bool = True,
) -> list[Sample]:
    """Generate every request in one left-padded batch; return one ``Sample`` per request, in order.

    ``share_prefix``: run the batch's common prompt prefix once (see the module docstring).
    ``timings["prefill_seconds"]`` (when given) accumulates the time of the prompt forward passes.

    Long because the decode loop is one piece of state (KV cache, attention mask, per-row budgets,
    stop windows, generators, finished rows) advanced together; split up, every helper would take and
    return most of it, and this is the sampler's hot path.
    """
    n = len(requests)
    results: list[Sample | None] = [None] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    stops = [_stop_sets(r.params, eos_ids) for r in requests]
    budgets = [max(0, min(r.params.max_tokens, max_context - len(r.prompt))) for r in requests]
    windows = [max((len(s) for s in strs), default=0) + 4 for _, strs in stops]
    gens = [torch.Generator().manual_seed(r.seed % (2**63)) for r in requests]

    active = [i for i in range(n) if budgets[i] > 0]
    for i in range(n):
        if budgets[i] == 0:
            results[i] = Sample([], [], "length")
    if not active:
        return [r for r in results if r is not None]

    prompts = [requests[i].prompt for i in active]
    shared = shared_prefix_length(prompts) if share_prefix else 0
    if shared < MIN_SHARED_PREFIX:
        shared = 0
    longest = max(len(p) for p in prompts) - shared
    ids = torch.full((len(active), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(active), shared + longest), dtype=torch.long)
    mask[:, :shared] = 1
    for row, p in enumerate(prompts):
        own = p[shared:]
        ids[row, longest - len(own) :] = torch.tensor(own, dtype=torch.long)
        mask[row, shared + longest - len(own) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)

    def per_row(values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = per_row([requests[i].params.temperature for i in active], torch.float32)
    top_p = per_row([requests[i].params.top_p for i in active], torch.float32)
    top_k = per_row([requests[i].params.top_k for i in active], torch.long)

    cache_key = _cache_kwarg(model)
    t_prefill = time.perf_counter()
    if shared:
        head = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device)
        first = model(input_ids=head, use_cache=True, logits_to_keep=1)
        prefix_cache = _output_cache(first)
        prefix_cache.batch_repeat_interleave(len(active))
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions[:, shared:],
            use_cache=True,
            logits_to_keep=1,
            **{cache_key: prefix_cache},
        )
    else:
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
    if timings is not None:
        timings["prefill_seconds"] = timings.get("prefill_seconds", 0.0) + time.perf_counter() - t_prefill
    cache = _output_cache(out)
    logits = out.logits[:, -1, :].float()
    last_pos = positions[:, -1:]

    rows = list(active)  # request index of each row of the KV cache
    done = [False] * n
    while True:
        lp_all = torch.log_softmax(logits, dim=-1)
        # One draw per live sequence per step from its own generator: the stream ignores batch composition.
        uniforms = torch.stack(
            [torch.rand((), generator=gens[i]) if not done[i] else torch.zeros(()) for i in rows]
        ).to(device)
        chosen = choose_tokens(logits, temperature, top_p, top_k, uniforms)
        chosen_list = chosen.tolist()
        lp_list = lp_all.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        for row, i in enumerate(rows):
            if done[i]:
                continue
            tok = chosen_list[row]
            tokens[i].append(tok)
            logprobs[i].append(lp_list[row])
            stop_ids, stop_strs = stops[i]
            reason: str | None = None
            if tok in stop_ids:
                reason = "stop"
            elif stop_strs:
                tail = tokenizer.decode(tokens[i][-windows[i] :], skip_special_tokens=False)
                if any(s in tail for s in stop_strs):
                    reason = "stop"
            if reason is None and len(tokens[i]) >= budgets[i]:
                reason = "length"
            if reason is not None:
                done[i] = True
                results[i] = Sample(tokens[i], logprobs[i], reason)  # type: ignore[arg-type]
        live = [row for row, i in enumerate(rows) if not done[i]]
        if not live:
            break
        if len(live) <= len(rows) // 2 and hasattr(cache, "batch_select_indices"):
            # Most rows finished: drop them from the cache so the tail of long generations stays cheap.
            keep = torch.tensor(live, device=device)
            cache.batch_select_indices(keep)
            mask, last_pos, chosen = mask[keep], last_pos[keep], chosen[keep]
            temperature, top_p, top_k = temperature[keep], top_p[keep], top_k[keep]
            rows = [rows[r] for r in live]
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=last_pos,
            use_cache=True,
            **{cache_key: cache},
        )
        cache = _output_cache(out)
        logits = out.logits[:, -1, :].float()
    return [r if r is not None else Sample(tokens[i], logprobs[i], "length") for i, r in enumerate(results)]
