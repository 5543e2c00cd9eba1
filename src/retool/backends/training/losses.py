"""Per-token policy-gradient and SFT loss math, shared by the local backend and the tests (pure torch).

Tinker semantics: every function returns the per-token loss already multiplied by the datum weights; the
caller SUMS it over tokens and datums (the training loop puts its normalisation into the weights).

- ``ppo``: ``-w * min(r*A, clip(r, lo, hi)*A)`` with ``r = exp(lp - lp_old)``; ``lo``/``hi`` are ratio
  thresholds (``clip_low`` / ``clip_high``, default 0.8 / 1.28), not epsilons.
- ``importance_sampling``: ``-w * r * A``.
- ``cross_entropy``: ``-w * lp``.
- ``cispo``: ``-w * sg(clip(r, lo, hi)) * lp * A`` (the clipped ratio is a constant coefficient, so a
  clipped token still gets gradient, scaled by the bound).
- ``dro``: ``-w * (lp * A - beta/2 * (lp - lp_old)^2)`` (``beta`` default 0.05, the value the Tinker docs
  show; they name no default).
- ``gspo`` (GSPO-token): the sequence log-ratio ``l = mean_{t in M} (sg(lp_t) - lp_old_t)`` over the
  positions ``M`` that the datum's ratio mask marks (default: its trained positions); every token's ratio
  is ``s_t = exp(l + lp_t - sg(lp_t))``: the sequence ratio's value with the token's own gradient; then PPO's
  ``-w * min(s_t*A, clip(s_t, lo, hi)*A)``. Rows of the batch are sequences (one datum per row).
- ``stable_reinforce``: Tinker names it and documents what it needs (sampler-recorded stability info,
  referenced by ``sequence_id`` provenance) but publishes no formula. Retool's version is token-level
  importance-corrected REINFORCE against the *recorded* sampler logprob ``mu`` with a truncated weight and
  an optional KL penalty to the sampler (k3 estimator)::

      -w * sg(min(exp(lp - mu), ratio_cap)) * A * lp  +  kl_coeff * w * (r - 1 - log r),  r = exp(lp - mu)

  defaults ``ratio_cap`` 2, ``kl_coeff`` 0 (``kl_coeff`` is the one config key Tinker's protocol names for
  it). This is the token-level IS-corrected policy gradient of "Stabilizing Reinforcement Learning with
  LLMs" (arXiv 2512.01374) with TIS's cap: a stand-in, not a copy; whether it equals Tinker's server-side
  objective cannot be checked without the service.

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

KL to the reference policy (``ref_lp``: the policy the run started from; the local backend computes it with
the LoRA adapter switched off). Given ``ref_lp``, every RL loss measures the k3 estimate of KL(policy ||
reference) per trained token, ``exp(d) - d - 1`` with ``d = ref_lp - lp`` (>= 0, 0 where the two agree), and
with ``ref_kl_coef = beta > 0`` in the loss config adds ``beta * w * (exp(d) - d - 1)`` to the token's loss
(the "KL loss" of GRPO / verl / SimpleRL, k3 form): its gradient ``beta * w * (1 - exp(d)) * grad lp``
pulls ``lp`` back towards ``ref_lp`` and vanishes where they agree. ``measure_ref_kl = 1`` asks the backend
for the reference logprobs without a penalty (the trainer's ``policy/ref_kl`` instrument); the loss itself
reads only ``ref_kl_coef``.

Positions with weight 0 contribute nothing, not even NaN: their log-ratio is forced to 0 before ``exp`` so
that a padded ``lp_old`` of 0 can never overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from retool.backends.interface.types import ForwardBackwardResult

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.28
DEFAULT_DRO_BETA = 0.05
DEFAULT_RATIO_CAP = 2.0
LOSS_NAMES = ("ppo", "importance_sampling", "cross_entropy", "cispo", "dro", "gspo", "stable_reinforce")
# The config keys each loss reads (cross_entropy accepts the PPO ones and ignores them: the training loop
# passes one config whatever the loss).
# Every RL loss reads the reference-KL keys (module docstring).
REF_KL_KEYS = frozenset({"ref_kl_coef", "measure_ref_kl"})
LOSS_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"clip_low", "clip_high", "tis_cap"}),
    "importance_sampling": frozenset({"clip_low", "clip_high", "tis_cap"}) | REF_KL_KEYS,
    "ppo": frozenset({"clip_low", "clip_high", "tis_cap"}) | REF_KL_KEYS,
    "cispo": frozenset({"clip_low", "clip_high"}) | REF_KL_KEYS,
    "gspo": frozenset({"clip_low", "clip_high"}) | REF_KL_KEYS,
    "dro": frozenset({"beta"}) | REF_KL_KEYS,
    "stable_reinforce": frozenset({"kl_coeff", "ratio_cap"}) | REF_KL_KEYS,
}
_CONFIG_KEYS = frozenset().union(*LOSS_CONFIG_KEYS.values())
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
    # Given the reference logprobs: the k3 estimate of KL(policy || reference) per token (0 at untrained
    # positions), detached.
    ref_kl: torch.Tensor | None = None


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
    # the trained tokens whose reference KL (``TokenLoss.ref_kl``) / policy entropy (``add_entropy``) the
    # backend measured, and their sums
    ref_kl_tokens: int = 0
    ref_kl_sum: float = 0.0
    entropy_tokens: int = 0
    entropy_sum: float = 0.0
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
            if tl.ref_kl is not None:
                self.ref_kl_tokens += n
                self.ref_kl_sum += float(tl.ref_kl[sel].double().sum())
        return sel

    def add_entropy(self, entropy: torch.Tensor, sel: torch.Tensor) -> None:
        """Count the policy's entropy (``entropy``, per position) over the trained positions ``sel``."""
        self.entropy_tokens += int(sel.sum())
        self.entropy_sum += float(entropy[sel].double().sum())

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

    def merge(self, other: LossTally) -> None:
        """Add ``other``'s counts: the tally of a call whose datums were split between processes."""
        for name in (
            *("loss", "trained", "clipped", "ratio_sum", "measured", "diff_sum", "k3_sum"),
            *("ref_kl_tokens", "ref_kl_sum", "entropy_tokens", "entropy_sum"),
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.outside += other.outside
        self.truncated += other.truncated
        self.ratio_min = min(self.ratio_min, other.ratio_min)
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.diff_max = max(self.diff_max, other.diff_max)
        self.extra.update(other.extra)

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
            entropy=self.entropy_sum / self.entropy_tokens if self.entropy_tokens else None,
            ref_kl=self.ref_kl_sum / self.ref_kl_tokens if self.ref_kl_tokens else None,
            extra=dict(extra or {}),
        )


def tis_cap(loss_config: dict[str, float] | None) -> float:
    """The truncated-importance-sampling cap of a loss config; 0 means TIS is off."""
    cap = float((loss_config or {}).get("tis_cap", 0.0))
    if cap < 0 or math.isnan(cap):
        raise ValueError(f"tis_cap must be >= 0 (0 turns TIS off), got {cap}")
    return cap


def check_config(loss_fn: str, loss_config: dict[str, float] | None) -> dict[str, float]:
    """The loss config as floats; a key ``loss_fn`` does not read, or a non-finite value, is an error."""
    cfg = {k: float(v) for k, v in (loss_config or {}).items()}
    known = LOSS_CONFIG_KEYS.get(loss_fn, _CONFIG_KEYS)
    unknown = set(cfg) - known
    if unknown:
        raise ValueError(
            f"unknown loss_config keys {sorted(unknown)} for {loss_fn!r}; known: {sorted(known) or 'none'}"
        )
    bad = [k for k, v in cfg.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"loss_config {bad} must be finite numbers")
    return cfg


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
    ratio_mask: torch.Tensor | None = None,
    ref_lp: torch.Tensor | None = None,
) -> TokenLoss:
    """Weighted per-token loss of ``loss_fn``; ``lp`` is the learner's logprob of each target token,
    ``old_lp`` the sampler's (see the module docstring for TIS). ``ratio_mask`` (gspo only, the shape of
    ``lp``; the last dimension is the sequence) marks the tokens the sequence ratio averages over.
    ``ref_lp`` (RL losses): the reference policy's logprobs, for the KL measure and the ``ref_kl_coef``
    penalty (module docstring)."""
    if loss_fn not in LOSS_NAMES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; known: {', '.join(LOSS_NAMES)}")
    cfg = check_config(loss_fn, loss_config)
    trained = weights != 0
    w = weights.to(lp.dtype)
    if loss_fn == "cross_entropy":
        loss = torch.where(trained, -w * lp, torch.zeros_like(lp))
        ones = torch.ones_like(lp).detach()
        return TokenLoss(loss, ones, torch.zeros_like(trained), trained)
    if old_lp is None or advantages is None:
        raise ValueError(f"loss {loss_fn!r} needs sampler logprobs and advantages")
    if loss_fn in ("cispo", "dro", "gspo", "stable_reinforce"):
        tl = _policy_loss(loss_fn, lp, w, trained, old_lp, advantages, cfg, ratio_mask)
    else:
        tl = _ppo_loss(loss_fn, lp, w, trained, old_lp, advantages, cfg)
    return _with_reference_kl(tl, lp, w, ref_lp, cfg.get("ref_kl_coef", 0.0))


def wants_reference(loss_fn: str, loss_config: dict[str, float] | None) -> bool:
    """Whether a call needs the reference policy's logprobs: an RL loss whose config asks to measure the
    reference KL (``measure_ref_kl``) or penalises it (``ref_kl_coef`` > 0)."""
    cfg = loss_config or {}
    asked = float(cfg.get("measure_ref_kl", 0.0)) > 0 or float(cfg.get("ref_kl_coef", 0.0)) > 0
    return loss_fn != "cross_entropy" and asked


def reference_k3(lp: torch.Tensor, ref_lp: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Per token ``exp(d) - d - 1`` with ``d = ref_lp - lp`` (k3 of KL(policy || reference)); 0 where not
    ``trained`` (``d`` is forced to 0 there, so a padded position never reaches ``exp``)."""
    d = torch.where(trained, ref_lp.to(lp.dtype) - lp, torch.zeros_like(lp))
    return torch.exp(d) - d - 1.0


def _with_reference_kl(
    tl: TokenLoss, lp: torch.Tensor, w: torch.Tensor, ref_lp: torch.Tensor | None, coef: float
) -> TokenLoss:
    """``tl`` with the reference KL measured and, for ``coef > 0``, ``coef * w * k3`` added to its loss."""
    if coef < 0:
        raise ValueError(f"ref_kl_coef must be >= 0 (0: no penalty), got {coef}")
    if ref_lp is None:
        if coef > 0:
            raise ValueError("ref_kl_coef > 0 needs the reference policy's logprobs (ref_lp)")
        return tl
    k3 = reference_k3(lp, ref_lp, tl.trained)
    tl.ref_kl = k3.detach()
    if coef > 0:
        tl.loss = tl.loss + torch.where(tl.trained, coef * w * k3, torch.zeros_like(lp))
    return tl


def _ppo_loss(
    loss_fn: str,
    lp: torch.Tensor,
    w: torch.Tensor,
    trained: torch.Tensor,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    cfg: dict[str, float],
) -> TokenLoss:
    """ppo and importance_sampling, with TIS when the config's ``tis_cap`` > 0 (module docstring)."""
    lo, hi = clip_thresholds(cfg)
    cap = tis_cap(cfg)
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


def _policy_loss(
    loss_fn: str,
    lp: torch.Tensor,
    w: torch.Tensor,
    trained: torch.Tensor,
    old_lp: torch.Tensor,
    advantages: torch.Tensor,
    cfg: dict[str, float],
    ratio_mask: torch.Tensor | None,
) -> TokenLoss:
    """cispo, dro, gspo and stable_reinforce (formulas in the module docstring)."""
    zeros = torch.zeros_like(lp)
    old = old_lp.to(lp.dtype)
    adv = advantages.to(lp.dtype)
    # lp - mu at trained positions only: a padded sampler logprob of 0 never reaches exp().
    behaviour = torch.where(trained, lp - old, zeros)
    ratio = torch.exp(behaviour)
    clipped = torch.zeros_like(trained)
    truncated: torch.Tensor | None = None
    if loss_fn == "cispo":
        lo, hi = clip_thresholds(cfg)
        coef = torch.clamp(ratio, lo, hi).detach()
        per = -coef * lp * adv
        clipped = trained & ((ratio < lo) | (ratio > hi))
    elif loss_fn == "dro":
        beta = cfg.get("beta", DEFAULT_DRO_BETA)
        if beta < 0:
            raise ValueError(f"dro beta must be >= 0, got {beta}")
        per = -(lp * adv - 0.5 * beta * behaviour**2)
    elif loss_fn == "gspo":
        lo, hi = clip_thresholds(cfg)
        in_ratio = trained if ratio_mask is None else (ratio_mask != 0)
        counts = in_ratio.sum(dim=-1, keepdim=True)
        empty = (counts == 0) & trained.any(dim=-1, keepdim=True)
        if bool(empty.any()):
            raise ValueError("gspo: a sequence with trained tokens has no token in its sequence ratio mask")
        token_log_ratio = torch.where(in_ratio, lp.detach() - old, zeros)
        seq_log_ratio = token_log_ratio.sum(dim=-1, keepdim=True) / counts.clamp(min=1)
        seq_ratio = torch.exp(seq_log_ratio + lp - lp.detach())
        ratio = torch.where(trained, seq_ratio, torch.ones_like(lp))
        per = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        clipped = trained & (((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo)))
    else:  # stable_reinforce
        cap = cfg.get("ratio_cap", DEFAULT_RATIO_CAP)
        kl = cfg.get("kl_coeff", 0.0)
        if cap <= 0 or kl < 0:
            raise ValueError(f"stable_reinforce needs ratio_cap > 0 and kl_coeff >= 0, got {cap}, {kl}")
        rho = ratio.detach()
        truncated = trained & (rho > cap)
        per = -torch.clamp(rho, max=cap) * adv * lp + kl * (ratio - 1.0 - behaviour)
    loss = torch.where(trained, w * per, zeros)
    return TokenLoss(loss, ratio.detach(), clipped, trained, behaviour.detach(), truncated)
