"""What the services see of our ``Datum``: the checks a datum passes before it is sent
(``validate_datums``), the datum with masking and weight folding done (``to_wire``: a ``WireDatum``) and
the loss inputs it is sent as, scaled for the service's reduction (``loss_fn_inputs``).

How our ``Datum`` maps onto the services' loss inputs:

- RL losses (``ppo``, ``importance_sampling``) take no per-token weights on the services, so the datum
  weight is folded into the advantage: ``A' = w * A``. For ``w >= 0`` this is exact for both losses
  (``-min(r wA, clip(r) wA) = -w min(rA, clip(r) A)``); negative weights are refused.
  Positions with ``w = 0`` get advantage 0 (Tinker) and additionally target ``-100`` (PyTRIO, which
  counts every target that is not ``-100`` as an active token). Adapters with ``rl_weights`` (Tinker)
  also send explicit ``weights``: a 0/1 mask, 0 on prompt and observation tokens, so a service that
  counts weights (SkyRL divides each datum's loss by the sum of its weights, all ones when none are
  sent) never counts those tokens; a service that ignores them (Tinker documents none for RL losses,
  ``retool serve`` drops them) sees the same loss as before, the advantages being 0 there.
- ``cross_entropy`` sends ``weights`` directly.
- PPO thresholds go to ``loss_fn_config`` as ``clip_low_threshold`` / ``clip_high_threshold`` (ratios).
- Only these keys are sent: the real SDKs forward any other key to the service without checking it.
- Every advantage / CE weight is multiplied by the denominator the service divides by (see
  ``retool.backends.training.reduction`` and ``retool.backends.remote.service_reduction``), so the
  gradient the loop gets is the one its weights describe (the mean over trained datums) whatever the
  service does with the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from retool.backends.interface.types import Datum
from retool.backends.training.losses import LOSS_NAMES
from retool.backends.training.reduction import IGNORE_INDEX, WireDatum

# The losses this adapter folds the training loop's weights into and mirrors locally for its metrics.
REMOTE_LOSSES = ("ppo", "importance_sampling", "cross_entropy")


def validate_datums(datums: Sequence[Datum], loss_fn: str) -> None:
    """Refuse a loss the services do not train, an empty call or datum, and RL datums without a logprob
    and an advantage for every position."""
    if loss_fn not in REMOTE_LOSSES:
        raise ValueError(
            f"unknown loss_fn {loss_fn!r} for a remote service; known: {', '.join(REMOTE_LOSSES)} "
            f"({', '.join(n for n in LOSS_NAMES if n not in REMOTE_LOSSES)}: the local backend only)"
        )
    if not datums:
        raise ValueError("forward_backward needs at least one datum")
    for k, d in enumerate(datums):
        if len(d) == 0:
            raise ValueError(f"datum {k} is empty")
        if loss_fn != "cross_entropy" and (len(d.logprobs) != len(d) or len(d.advantages) != len(d)):
            raise ValueError(f"datum {k}: loss {loss_fn!r} needs logprobs and advantages for every position")


def to_wire(d: Datum, loss_fn: str, *, mask_targets: bool, rl_weights: bool, sdk_name: str) -> WireDatum:
    """What the service will see for ``d`` (masking and weight folding done, reduction not yet):
    ``mask_targets`` sets the target of a weight-0 position to ``-100``, ``rl_weights`` sends RL datums'
    0/1 weight mask (see the module docstring)."""
    n = len(d)
    w = list(d.weights) if d.weights else [1.0] * n
    targets = [int(t) for t in d.target_tokens]
    if mask_targets:
        targets = [t if wi != 0 else IGNORE_INDEX for t, wi in zip(targets, w, strict=True)]
    inputs = [int(t) for t in d.input_tokens]
    if loss_fn == "cross_entropy":
        return WireDatum(inputs, targets, weights=[float(wi) for wi in w])
    if any(wi < 0 for wi in w):
        raise ValueError(f"{sdk_name}: negative datum weights cannot be folded into advantages")
    adv = [float(a) * float(wi) if wi != 0 else 0.0 for a, wi in zip(d.advantages, w, strict=True)]
    lps = [float(x) if wi != 0 else 0.0 for x, wi in zip(d.logprobs, w, strict=True)]
    mask = [1.0 if wi != 0 else 0.0 for wi in w] if rl_weights else None
    return WireDatum(inputs, targets, weights=mask, logprobs=lps, advantages=adv)


def loss_fn_inputs(
    w: WireDatum, scale: float, tensor: Callable[[list[float] | list[int], str], object]
) -> dict[str, object]:
    """The ``loss_fn_inputs`` of ``w`` with its reduction ``scale`` applied, each list made an SDK tensor
    by ``tensor(values, dtype)``."""
    inputs: dict[str, object] = {"target_tokens": tensor(w.targets, "int64")}
    rl = w.logprobs is not None and w.advantages is not None
    if w.weights is not None:  # CE weights carry the scale; an RL mask stays 0/1
        inputs["weights"] = tensor([x if rl else x * scale for x in w.weights], "float32")
    if w.logprobs is not None and w.advantages is not None:
        inputs["logprobs"] = tensor(w.logprobs, "float32")
        inputs["advantages"] = tensor([a * scale for a in w.advantages], "float32")
    return inputs
