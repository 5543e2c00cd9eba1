"""What the PyTRIO and Tinker wire layers share: datums built from wire arrays, and sampling parameters.

Both SDKs send per-datum arrays aligned with the model input (``target_tokens[i]`` follows input position
``i``); ``-100`` as a target means "ignore" (PyTRIO). The local backend takes per-token ``weights`` instead:
an ignored position gets weight 0 (and a harmless target id 0), and the API's reduction becomes a factor
on every weight (``scale``: 1 for Tinker's sum, ``1 / total_active_tokens`` for PyTRIO).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import Request

from retool.backends.types import Datum, SamplingParams
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
