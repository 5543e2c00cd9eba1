"""The losses ``retool serve`` trains with, and the checks both wire APIs (``tinker_api``, ``pytrio_api``)
apply to a request's loss name and loss config before it reaches the local backend.

Loss semantics (what the APIs expose): per-token losses are the local backend's
(``retool.backends.training.losses``: cross_entropy, importance_sampling, ppo, cispo, dro, gspo,
stable_reinforce). Tinker's reduction is the documented sum; PyTRIO's is the sum divided by the batch's
active-token count the SDK sends (``total_active_tokens``; for dro the advantage-token count, which the SDK
counts as "dro's denominator"), one of the denominators ``retool.backends.training.reduction`` recognises.
The wire layers turn that into per-token weights. ``custom``: the SDKs' client-side custom losses
(``forward_backward_custom``) arrive as a forward and a cross_entropy backward and just work; Tinker's
server-side custom loss graphs are refused with a 400.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from retool.backends.interface.types import LossName
from retool.serve.state import ServeError

SUPPORTED_LOSSES: tuple[LossName, ...] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)


def check_loss(loss_fn: str) -> LossName:
    for known in SUPPORTED_LOSSES:
        if loss_fn == known:
            return known
    if loss_fn == "custom":
        raise ServeError(
            400,
            "unsupported_loss",
            "loss_fn 'custom' (a loss graph uploaded with create_custom_loss, run on the server) is not "
            "supported by retool serve; pass a Python callable to forward_backward_custom instead, which the "
            "SDK computes client-side through forward. Supported: " + ", ".join(SUPPORTED_LOSSES),
        )
    raise ServeError(
        400,
        "unsupported_loss",
        f"loss_fn {loss_fn!r} is not supported; supported: {', '.join(SUPPORTED_LOSSES)}",
    )


# The SDKs' loss config names (Tinker's documented ones; PyTRIO uses the same) -> the local backend's.
_CONFIG_NAMES = {
    "clip_low_threshold": "clip_low",
    "clip_high_threshold": "clip_high",
    "beta": "beta",
    "kl_coeff": "kl_coeff",
    "ratio_cap": "ratio_cap",  # retool's own (stable_reinforce's importance-weight cap)
}


def loss_config(loss_fn: str, given: Mapping[str, object] | None) -> dict[str, float]:
    """The SDKs' loss config in the local backend's names, checked against what ``loss_fn`` reads, with
    Tinker's documented clip thresholds (0.8 / 1.2) where a clipped loss was given none."""
    from retool.backends.training.losses import LOSS_CONFIG_KEYS  # deferred: losses imports torch

    out: dict[str, float] = {}
    reads = {k for k, v in _CONFIG_NAMES.items() if v in LOSS_CONFIG_KEYS[loss_fn]}
    # cross_entropy and importance_sampling take no config, but clients that send one config for every
    # loss pass PPO's thresholds to them too: accepted and ignored, as before these losses had configs.
    no_config = loss_fn in ("cross_entropy", "importance_sampling")
    ignored = {"clip_low_threshold", "clip_high_threshold"} if no_config else set()
    reads -= ignored
    for key, value in (given or {}).items():
        if key in ignored and isinstance(value, int | float):
            continue
        if key not in reads:
            raise ServeError(
                400,
                "invalid_loss_config",
                f"loss config key {key!r} is not read by {loss_fn}; it reads: {sorted(reads) or 'nothing'}",
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ServeError(400, "invalid_loss_config", f"loss config {key} must be a finite number")
        out[_CONFIG_NAMES[key]] = float(value)
    if loss_fn in ("ppo", "cispo", "gspo"):
        out = {"clip_low": 0.8, "clip_high": 1.2, **out}
        if not 0.0 <= out["clip_low"] <= 1.0 <= out["clip_high"]:
            raise ServeError(
                400,
                "invalid_loss_config",
                f"clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                f"{out['clip_low']}, {out['clip_high']}",
            )
    if any(out.get(k, 0.0) < 0 for k in ("beta", "kl_coeff")) or out.get("ratio_cap", 1.0) <= 0:
        raise ServeError(400, "invalid_loss_config", "beta and kl_coeff must be >= 0, ratio_cap > 0")
    return out
