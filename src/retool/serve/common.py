"""What the PyTRIO and Tinker wire layers share: datums from wire arrays, sampling params, prompt logprobs.

Both SDKs send per-datum arrays aligned with the model input (``target_tokens[i]`` follows input position
``i``); ``-100`` as a target means "ignore" (PyTRIO). The local backend takes per-token ``weights`` instead:
an ignored position gets weight 0 (and a harmless target id 0), and the API's reduction becomes a factor
on every weight (``scale``: 1 for Tinker's sum, ``1 / total_active_tokens`` for PyTRIO).

Prompt logprobs (``PromptScores``): one forward pass of the sampler's weights over the prompt gives the
next-token distribution at every position; position 0 has no context and gets none. Both SDKs' views come
from it: each prompt token's logprob, the top-k candidates per position, and Tinker's
``target_prompt_logprobs`` (given ids scored at given positions); ``prompt_logprobs_last_n`` keeps only the
last N positions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request, Response

from retool.backends.interface.types import Datum, SamplingParams
from retool.jsonl import JsonObject
from retool.serve.state import ServeError

IGNORE = -100


async def read_json_object(request: Request) -> JsonObject:
    """The request's body as a JSON object (an empty body is ``{}``); anything else is a 400."""
    try:
        data = json.loads(await request.body() or b"{}")
    except ValueError:
        raise ServeError(400, "invalid_request", "the body is not JSON") from None
    if not isinstance(data, dict):
        raise ServeError(400, "invalid_request", "the body must be a JSON object")
    return data


def _floats(values: Sequence[float] | None, n: int, name: str, k: int) -> list[float] | None:
    if values is None:
        return None
    out = [float(v) for v in values]
    if len(out) != n:
        raise ServeError(
            400, "invalid_request", f"datum {k}: {name} has {len(out)} values, the input has {n}"
        )
    if not all(math.isfinite(v) for v in out):
        raise ServeError(400, "invalid_request", f"datum {k}: {name} holds NaN or infinity")
    return out


def build_datum(
    k: int,
    tokens: list[int],
    targets: list[int],
    arrays: Mapping[str, Sequence[float] | None],
    loss_fn: str,
    scale: float,
) -> Datum:
    """One local ``Datum`` from a wire datum (``arrays``: weights, logprobs, advantages and gspo's
    sequence_ratio_mask; any may be None)."""
    n = len(tokens)
    if len(targets) != n:
        raise ServeError(400, "invalid_request", f"datum {k}: {len(targets)} targets for {n} input tokens")
    weights = _floats(arrays.get("weights"), n, "weights", k)
    logprobs = _floats(arrays.get("logprobs"), n, "logprobs", k)
    advantages = _floats(arrays.get("advantages"), n, "advantages", k)
    if loss_fn != "cross_entropy" and (logprobs is None or advantages is None):
        raise ServeError(400, "invalid_request", f"datum {k}: loss {loss_fn!r} needs logprobs and advantages")
    ratio_mask = _floats(arrays.get("sequence_ratio_mask"), n, "sequence_ratio_mask", k)
    if loss_fn == "gspo" and (ratio_mask is None or not any(ratio_mask)):
        # Tinker's sequence ratio is a mean over the positions this mask marks; without it the prompt's
        # padded sampler logprobs (0) would enter the mean.
        raise ServeError(
            400,
            "invalid_request",
            f"datum {k}: gspo needs sequence_ratio_mask marking (non-zero) the sampled tokens",
        )
    base = weights if (loss_fn == "cross_entropy" and weights is not None) else [1.0] * n
    w = [0.0 if t == IGNORE else b * scale for t, b in zip(targets, base, strict=True)]
    return Datum(
        input_tokens=list(tokens),
        target_tokens=[0 if t == IGNORE else int(t) for t in targets],
        logprobs=logprobs or [],
        advantages=advantages or [],
        weights=w,
        ratio_mask=ratio_mask or [],
    )


def sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """The SDKs' sampling params (both use these names) as the local sampler's; bad values: 400."""
    try:
        max_tokens = raw.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise ServeError(400, "invalid_request", "sampling_params.max_tokens must be an integer")
        stop = raw.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if not (all(isinstance(s, str) for s in stop) or all(_is_int(s) for s in stop)):
            raise ServeError(400, "invalid_request", "stop must be strings or token ids, not a mix")
        seed = raw.get("seed")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=int(raw.get("top_k", -1)),
            seed=None if seed is None else int(seed),
            stop=stop,
        )
    except (TypeError, ValueError) as exc:
        raise ServeError(400, "invalid_request", f"bad sampling_params: {exc}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_TOPK = 64  # top-k prompt candidates per position a request may ask for


@dataclass
class PromptScores:
    """What a sample request asked about its prompt, computed from ``scores`` (see the module docstring)."""

    logprobs: list[float | None] | None = None  # one per prompt token (None: not scored)
    topk: list[list[tuple[int, float]] | None] | None = None  # per prompt token
    target: list[float] | None = None  # flat, in the layout of the request's target ids


@dataclass(frozen=True)
class PromptRequest:
    """The prompt-logprob part of a sample request, checked against the prompt."""

    logprobs: bool = False
    topk: int = 0
    last_n: int | None = None
    target_ids: list[int] | None = None  # flat; row of cell j is target_rows[j]
    target_rows: list[int] | None = None

    @property
    def wanted(self) -> bool:
        return self.logprobs or self.topk > 0 or self.target_ids is not None


def prompt_request(
    n_prompt: int,
    logprobs: object,
    topk: object,
    last_n: object = None,
    target_ids: list[int] | None = None,
    target_rows: list[int] | None = None,
    vocab_size: int | None = None,
) -> PromptRequest:
    """Validate the prompt-logprob fields of a sample request (400 with the rule broken)."""
    if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= MAX_TOPK:
        raise ServeError(
            400, "invalid_request", f"topk_prompt_logprobs must be an integer in [0, {MAX_TOPK}]"
        )
    want = bool(logprobs)
    if last_n is not None:
        if not isinstance(last_n, int) or isinstance(last_n, bool) or not 1 <= last_n <= n_prompt - 1:
            raise ServeError(
                400, "invalid_request", f"prompt_logprobs_last_n must be in [1, {n_prompt - 1}], got {last_n}"
            )
        if not (want or topk):
            raise ServeError(400, "invalid_request", "prompt_logprobs_last_n needs prompt_logprobs")
    if target_ids is not None and vocab_size is not None:
        bad = [t for t in target_ids if t != -1 and not 0 <= t < vocab_size]
        if bad:
            raise ServeError(
                400, "invalid_token", f"target_prompt_logprobs ids outside [0, {vocab_size}): {bad[:5]}"
            )
    return PromptRequest(want, topk, last_n, target_ids, target_rows)


def score_prompt(scores: torch.Tensor, prompt: list[int], req: PromptRequest) -> PromptScores:
    """The SDKs' views of ``scores`` (row ``i``: log-softmax after ``prompt[:i+1]``)."""
    n = len(prompt)
    first = 1 if req.last_n is None else n - req.last_n  # positions before it are not scored
    out = PromptScores()
    if req.logprobs and n:
        picked = scores.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist() if n > 1 else []
        scored: list[float | None] = [None]  # position 0 has no context
        scored += [lp if i + 1 >= first else None for i, lp in enumerate(picked)]
        out.logprobs = scored
    if req.topk and n:
        k = min(req.topk, scores.shape[1]) if n > 1 else req.topk
        topk: list[list[tuple[int, float]] | None] = [None]
        if n > 1:
            vals, ids = torch.topk(scores, k, dim=-1)
            for i in range(n - 1):
                row = list(zip(ids[i].tolist(), vals[i].tolist(), strict=True))
                topk.append(row if i + 1 >= first else None)
        out.topk = topk
    if req.target_ids is not None and req.target_rows is not None:
        out.target = [
            0.0 if t == -1 else float(scores[r, t])
            for t, r in zip(req.target_ids, req.target_rows, strict=True)
        ]
    return out


def as_json(data: object) -> Response:
    """A JSON answer (both APIs' control routes)."""
    return Response(json.dumps(data).encode(), media_type="application/json")
