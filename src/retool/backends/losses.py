"""Per-token policy-gradient and SFT loss math, shared by the local backend and the tests (pure torch).

Tinker semantics: every function returns the per-token loss already multiplied by the datum weights; the
caller SUMS it over tokens and datums (the training loop puts its normalisation into the weights).

- ``ppo``: ``-w * min(r*A, clip(r, lo, hi)*A)`` with ``r = exp(lp - lp_old)``; ``lo``/``hi`` are ratio
  thresholds (``clip_low`` / ``clip_high``, default 0.8 / 1.28), not epsilons.
- ``importance_sampling``: ``-w * r * A``.
- ``cross_entropy``: ``-w * lp``.

Truncated importance sampling (``tis_cap = C > 0`` in the loss config; ppo and importance_sampling). The
sampler's logprob ``mu`` (the behaviour policy: an older version when training off-policy, and another
engine's numerics) differs from the trainer's logprob of the same weights. TIS (Yao et al. 2025, as in
verl's rollout correction, slime ``--use-tis``, SkyRL) weights each token by the truncated ratio of the
trainer's policy *before* the update to the sampler's, and takes the PPO ratio against that policy::

    rho = exp(sg(lp) - mu),   r = exp(lp - sg(lp)),   sg = stop-gradient
    ppo:                  -w * min(rho, C) * min(r*A, clip(r, lo, hi)*A)
    importance_sampling:  -w * min(rho, C) * r*A

The loop takes one optimizer step per batch, so ``sg(lp)`` *is* the trainer's policy before the update:
``r`` is 1 in value (the clip never acts in that step; it would with several updates per batch), and
the gradient is ``-w * min(rho, C) * A * grad lp``: the policy gradient corrected to the trainer's policy,
each token's weight bounded by ``C`` instead of being cut to zero by the clip. Without TIS (``tis_cap``
0 or absent) the ratio is taken against the sampler's logprob directly, as on Tinker and PyTRIO.

Every RL evaluation also measures the sampler/trainer mismatch on the trained tokens (``LossTally``):
mean and max ``|lp - mu|``, the k3 estimate of KL(sampler || trainer) (``r - 1 - log r`` with
``r = exp(lp - mu)``, Schulman's estimator, unbiased and >= 0 per token) and the share of tokens whose
ratio lies outside [0.5, 2]; with TIS, the share of tokens whose weight was truncated.

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
_CONFIG_KEYS = {"clip_low", "clip_high", "tis_cap"}
# A token whose sampler/trainer ratio lies outside [1/2, 2] counts as mismatched (``ratio_outside``).
MISMATCH_RATIO_BAND = (0.5, 2.0)


@dataclass
class TokenLoss:
    """Per-token results of one loss evaluation (all tensors have the shape of ``lp``)."""

    loss: torch.Tensor  # weighted per-token loss; sum it
    ratio: torch.Tensor  # r (1 for cross_entropy and at masked positions), detached
    clipped: torch.Tensor  # bool: PPO clipping zeroed this token's gradient
    trained: torch.Tensor  # bool: weight != 0
    # RL losses only: lp - mu, the trainer's logprob minus the sampler's (0 at untrained positions), and
    # with TIS whether the token's importance weight was cut to the cap. Detached.
    behaviour_log_ratio: torch.Tensor | None = None
    truncated: torch.Tensor | None = None


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
    # sampler/trainer mismatch over the trained tokens of RL losses
    measured: int = 0
    diff_sum: float = 0.0
    diff_max: float = 0.0
    k3_sum: float = 0.0
    outside: int = 0
    truncated: int = 0
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
            if tl.behaviour_log_ratio is not None:
                self._add_mismatch(tl.behaviour_log_ratio[sel].double(), tl.truncated, sel)
        return sel

    def _add_mismatch(
        self, log_ratio: torch.Tensor, truncated: torch.Tensor | None, sel: torch.Tensor
    ) -> None:
        ratio = torch.exp(log_ratio)
        lo, hi = MISMATCH_RATIO_BAND
        self.measured += int(log_ratio.numel())
        self.diff_sum += float(log_ratio.abs().sum())
        self.diff_max = max(self.diff_max, float(log_ratio.abs().max()))
        self.k3_sum += float((ratio - 1.0 - log_ratio).sum())
        self.outside += int(((ratio < lo) | (ratio > hi)).sum())
        if truncated is not None:
            self.truncated += int(truncated[sel].sum())

    def result(self, extra: dict[str, float] | None = None) -> ForwardBackwardResult:
        n = self.trained
        return ForwardBackwardResult(
            loss=self.loss,
            trained_tokens=n,
            ratio_mean=self.ratio_sum / n if n else 1.0,
            ratio_min=self.ratio_min if n else 1.0,
            ratio_max=self.ratio_max if n else 1.0,
            clip_fraction=self.clipped / n if n else 0.0,
            mismatch_tokens=self.measured,
            logprob_diff_mean=self.diff_sum / self.measured if self.measured else 0.0,
            logprob_diff_max=self.diff_max,
            kl_k3=self.k3_sum / self.measured if self.measured else 0.0,
            ratio_outside=self.outside / self.measured if self.measured else 0.0,
            tis_truncated=self.truncated / self.measured if self.measured else 0.0,
            extra=dict(extra or {}),
        )


def tis_cap(loss_config: dict[str, float] | None) -> float:
    """The truncated-importance-sampling cap of a loss config; 0 means TIS is off."""
    cap = float((loss_config or {}).get("tis_cap", 0.0))
    if cap < 0 or math.isnan(cap):
        raise ValueError(f"tis_cap must be >= 0 (0 turns TIS off), got {cap}")
    return cap


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
    """Weighted per-token loss of ``loss_fn``; ``lp`` is the learner's logprob of each target token,
    ``old_lp`` the sampler's (see the module docstring for TIS)."""
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
    cap = tis_cap(loss_config)
    old = old_lp.to(lp.dtype)
    adv = advantages.to(lp.dtype)
    behaviour = torch.where(trained, lp - old, torch.zeros_like(lp))
    truncated: torch.Tensor | None = None
    is_weight: torch.Tensor | None = None
    if cap > 0:
        # The PPO ratio against the trainer's own pre-update policy; the sampler enters as a weight.
        log_ratio = torch.where(trained, lp - lp.detach(), torch.zeros_like(lp))
        rho = torch.exp(behaviour.detach())
        is_weight = torch.clamp(rho, max=cap)
        truncated = trained & (rho > cap)
    else:
        log_ratio = behaviour
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
    weight = w if is_weight is None else w * is_weight
    loss = torch.where(trained, weight * per, torch.zeros_like(lp))
    return TokenLoss(loss, ratio.detach(), clipped, trained, behaviour.detach(), truncated)
