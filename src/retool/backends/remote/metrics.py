"""What a service's answer to a forward(-backward) call means in our terms: its own metrics
(``server_metrics``), the learner logprobs it returns per datum (``learner_logprobs``) and the loss and
metrics computed here from them (``local_metrics``).

Metrics (loss, ratio stats, clip fraction) are computed client-side from the per-token learner logprobs
the service returns (``loss_fn_outputs[i]["logprobs"]``), with the same loss code as the local backend;
the service's own metrics are passed through in ``extra`` under ``server/``, and ``server/loss_ratio``
(service loss / local loss, 1 while the normalisation is right) is reported for every call whose loss is
not mostly cancellation.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from retool.backends.interface.types import Datum, ForwardBackwardResult
from retool.backends.remote.sdk import to_list
from retool.backends.training.losses import LossTally, token_loss

logger = logging.getLogger(__name__)


def server_metrics(output: object) -> dict[str, float]:
    """The service's numeric metrics of a forward pass, under ``server/``."""
    return {
        f"server/{k}": float(v)
        for k, v in dict(getattr(output, "metrics", None) or {}).items()
        if isinstance(v, int | float)
    }


def learner_logprobs(output: object, n: int) -> list[list[float]] | None:
    """The per-token learner logprobs of each of the ``n`` datums sent; ``None`` unless there are ``n``."""
    outs = list(getattr(output, "loss_fn_outputs", None) or [])
    if len(outs) != n:
        return None
    lps = []
    for o in outs:
        value = o.get("logprobs") if isinstance(o, dict) else getattr(o, "logprobs", None)
        lps.append([float(x) for x in to_list(value)])
    return lps


def local_metrics(
    datums: Sequence[Datum],
    loss_fn: str,
    loss_config: dict[str, float] | None,
    learner: list[list[float]] | None,
    server: dict[str, float],
    server_loss_key: str,
) -> ForwardBackwardResult:
    """The call's result: loss and metrics from ``learner`` (the service's logprobs) by the local loss
    code, ``server`` passed through; from ``server`` alone (its ``server_loss_key``) when ``learner`` is
    ``None``."""
    if learner is None:
        logger.warning(
            "service returned no per-datum logprobs for %d datums; metrics from server only", len(datums)
        )
        trained = sum(sum(1 for w in (d.weights or [1.0] * len(d)) if w != 0) for d in datums)
        loss = server.get(f"server/{server_loss_key}", math.nan)
        return ForwardBackwardResult(loss=loss, trained_tokens=trained, extra=server)
    tally = LossTally()
    magnitude = 0.0  # sum of |per-token loss|: how much of the total could be cancellation
    for d, values in zip(datums, learner, strict=True):
        lp = torch.tensor(values, dtype=torch.float64)
        n = len(d)
        w = torch.tensor(d.weights if d.weights else [1.0] * n, dtype=torch.float64)
        old = torch.tensor(d.logprobs, dtype=torch.float64) if d.logprobs else None
        adv = torch.tensor(d.advantages, dtype=torch.float64) if d.advantages else None
        tl = token_loss(loss_fn, lp, w, old, adv, loss_config)
        tally.add(tl)
        magnitude += float(tl.loss.abs().sum())
    result = tally.result(server)
    reported = server.get(f"server/{server_loss_key}")
    # The service's loss over ours: 1 while the adapter's normalisation is the service's. Skipped when
    # the loss is mostly cancellation (on-policy RL with centred advantages sums to ~0): noise.
    if reported is not None and abs(result.loss) > 1e-3 * magnitude > 0:
        result.extra["server/loss_ratio"] = reported / result.loss
    return result
