"""Per-token policy-gradient and SFT loss math, shared by the local backend and the tests (pure torch).

Tinker semantics: every function returns the per-token loss already multiplied by the datum weights; the
caller SUMS it over tokens and datums (the training loop puts its normalisation into the weights).

- ``ppo``: ``-w * min(r*A, clip(r, lo, hi)*A)`` with ``r = exp(lp - lp_old)``; ``lo``/``hi`` are ratio
  thresholds (``clip_low`` / ``clip_high``, default 0.8 / 1.28), not epsilons.
- ``importance_sampling``: ``-w * r * A``.
- ``cross_entropy``: ``-w * lp``.

Positions with weight 0 contribute nothing, not even NaN: their log-ratio is forced to 0 before ``exp`` so
that a padded ``lp_old`` of 0 can never overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from retool.backends.types import ForwardBackwardResult

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.28
LOSS_NAMES = ("ppo", "importance_sampling", "cross_entropy")
_CONFIG_KEYS = {"clip_low", "clip_high"}


@dataclass
class TokenLoss:
    """Per-token results of one loss evaluation (all tensors have the shape of ``lp``)."""

    loss: torch.Tensor  # weighted per-token loss; sum it
    ratio: torch.Tensor  # r (1 for cross_entropy and at masked positions), detached
    clipped: torch.Tensor  # bool: PPO clipping zeroed this token's gradient
    trained: torch.Tensor  # bool: weight != 0


@dataclass
class LossTally:
    """The metrics of one ``forward_backward`` call, summed over its micro-batches (local) or datums
    (remote), so every backend reports loss, ratio and clipping alike."""

    loss: float = 0.0
    trained: int = 0
    clipped: int = 0
    ratio_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    extra: dict[str, float] = field(default_factory=dict)

    def add(self, tl: TokenLoss) -> torch.Tensor:
        """Count one ``TokenLoss``; returns its trained-token mask."""
        self.loss += float(tl.loss.detach().sum())
        sel = tl.trained
        n = int(sel.sum())
        if n:
            self.trained += n
            r = tl.ratio[sel]
            self.ratio_sum += float(r.sum())
            self.ratio_min = min(self.ratio_min, float(r.min()))
            self.ratio_max = max(self.ratio_max, float(r.max()))
            self.clipped += int(tl.clipped[sel].sum())
        return sel

    def result(self, extra: dict[str, float] | None = None) -> ForwardBackwardResult:
        n = self.trained
        return ForwardBackwardResult(
            loss=self.loss,
            trained_tokens=n,
            ratio_mean=self.ratio_sum / n if n else 1.0,
            ratio_min=self.ratio_min if n else 1.0,
            ratio_max=self.ratio_max if n else 1.0,
            clip_fraction=self.clipped / n if n else 0.0,
            extra=dict(extra or {}),
        )


def clip_thresholds(loss_config: dict[str, float] | None) -> tuple[float, float]:
    """Read ``clip_low`` / ``clip_high`` from a loss config (unknown keys are an error, not ignored)."""
    cfg = dict(loss_config or {})
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown loss_config keys {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}")
    lo = float(cfg.get("clip_low", DEFAULT_CLIP_LOW))
    hi = float(cfg.get("clip_high", DEFAULT_CLIP_HIGH))
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"ppo ratio thresholds must satisfy 0 <= clip_low <= 1 <= clip_high, got {lo}, {hi}")
    return lo, hi


def token_loss(
    loss_fn: str,
    lp: torch.Tensor,
    weights: torch.Tensor,
    old_lp: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    loss_config: dict[str, float] | None = None,
) -> TokenLoss:
    """Weighted per-token loss of ``loss_fn``; ``lp`` is the learner's logprob of each target token."""
    if loss_fn not in LOSS_NAMES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; known: {', '.join(LOSS_NAMES)}")
    trained = weights != 0
    w = weights.to(lp.dtype)
    if loss_fn == "cross_entropy":
        clip_thresholds(loss_config)  # validate keys even though CE ignores them
        loss = torch.where(trained, -w * lp, torch.zeros_like(lp))
        ones = torch.ones_like(lp).detach()
        return TokenLoss(loss, ones, torch.zeros_like(trained), trained)
    if old_lp is None or advantages is None:
        raise ValueError(f"loss {loss_fn!r} needs sampler logprobs and advantages")
    lo, hi = clip_thresholds(loss_config)
    old = old_lp.to(lp.dtype)
    adv = advantages.to(lp.dtype)
    log_ratio = torch.where(trained, lp - old, torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    if loss_fn == "importance_sampling":
        per = -ratio * adv
        clipped = torch.zeros_like(trained)
    else:
        unclipped = ratio * adv
        clipped_obj = torch.clamp(ratio, lo, hi) * adv
        per = -torch.minimum(unclipped, clipped_obj)
        # The gradient vanishes exactly where the clipped branch is the smaller one and r is outside [lo, hi].
        clipped = trained & (((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo)))
    loss = torch.where(trained, w * per, torch.zeros_like(lp))
    return TokenLoss(loss, ratio.detach(), clipped, trained)
