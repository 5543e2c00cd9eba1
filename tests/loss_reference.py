"""Hand-written per-token references for the policy losses: the value from the formula and its derivative
in the learner's logprob ``lp``, in plain floats (no torch), so the tests check ``retool.backends.training.losses``
against something computed another way. Formulas: the module docstring of ``retool.backends.training.losses``."""

from __future__ import annotations

import math


def ref_cispo(lp: float, old: float, adv: float, w: float, lo: float, hi: float) -> tuple[float, float]:
    c = min(max(math.exp(lp - old), lo), hi)
    return -w * c * lp * adv, -w * c * adv


def ref_dro(lp: float, old: float, adv: float, w: float, beta: float) -> tuple[float, float]:
    return -w * (lp * adv - 0.5 * beta * (lp - old) ** 2), -w * (adv - beta * (lp - old))


def ref_stable(lp: float, mu: float, adv: float, w: float, cap: float, kl: float) -> tuple[float, float]:
    r = math.exp(lp - mu)
    c = min(r, cap)
    value = -w * c * adv * lp + kl * w * (r - 1.0 - (lp - mu))
    return value, -w * c * adv + kl * w * (r - 1.0)


def ref_gspo(
    row: list[tuple[float, float, float, float]], mask: list[float], lo: float, hi: float
) -> list[tuple[float, float]]:
    """GSPO-token: one sequence ratio s = exp(mean over the mask of lp - old); a token's loss is PPO's with
    ratio s, and its gradient in its own lp is -w*A*s on the unclipped branch, 0 on the clipped one (the
    sequence mean is a stop-gradient, so no token's loss depends on another token's lp)."""
    marked = [lp - old for (lp, old, _, _), m in zip(row, mask, strict=True) if m]
    s = math.exp(sum(marked) / len(marked))
    out = []
    for _lp, _old, adv, w in row:
        unclipped, clipped = s * adv, min(max(s, lo), hi) * adv
        value = -w * min(unclipped, clipped)
        grad = -w * adv * s if (unclipped <= clipped or lo <= s <= hi) else 0.0
        out.append((value, grad) if w else (0.0, 0.0))
    return out
