"""How a managed training service normalises the loss, and the startup self-check that finds out.

Owns the vocabulary the remote adapters share: the batch totals a service can divide by (``BatchTotals``,
counted exactly as PyTRIO's SDK counts them in ``pytrio/client/training_batch.py``), the named
denominators (``ReductionMode``), and ``verify_reduction``: once per run, before training, the loop
calls the training client's ``check_reduction_async`` hook (a no-op but for the remote adapters, which
run this check): the adapter asks its service to score a tiny probe batch with known weights and compares the loss the service
reports with the same loss computed here from the logprobs it returns. Their ratio is the denominator the
service used. If it is one of the known ones the adapter adopts it (so what it sends reproduces the loop's
weighted sum); if not, training is refused, because every gradient would be off by an unknown factor.

Known denominators (per ``forward_backward`` call):

- ``sum``: none; Tinker documents a plain sum over tokens and datums.
- ``samples``: the number of datums in the call.
- ``active_tokens``: positions whose target is not ignored (``-100``) and, for cross-entropy, whose
  weight is not 0. A position with a weight but zero advantage is active.
- ``advantage_tokens``: active positions whose advantage is not 0 (RL losses only).

The check runs forward passes only (no gradient is accumulated, nothing reaches the optimizer), and it
assumes the service reports the loss it differentiates, normalised the same way in a forward pass as in a
forward-backward pass (both go through one request type in both SDKs). Only a live account can confirm
that; the check then makes any mismatch loud instead of silent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from retool.backends.types import Datum, Tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
ReductionMode = Literal["sum", "samples", "active_tokens", "advantage_tokens"]
REDUCTION_MODES: tuple[ReductionMode, ...] = ("sum", "samples", "active_tokens", "advantage_tokens")
# The probe's candidate denominators differ by at least 1.5x, so 2% separates them with room for a
# service that computes its loss in bf16.
MATCH_TOLERANCE = 0.02


class ReductionCheckError(RuntimeError):
    """The service's loss matched none of the known normalisations: training would use a wrong scale."""


@dataclass(frozen=True)
class WireDatum:
    """One datum as the adapter sends it to a service, before the reduction scale is applied."""

    input_tokens: list[int]
    targets: list[int]
    weights: list[float] | None = None  # cross-entropy only
    logprobs: list[float] | None = None  # RL losses only
    advantages: list[float] | None = None  # RL losses only (datum weights already folded in)


@dataclass(frozen=True)
class BatchTotals:
    samples: int
    active_tokens: int
    advantage_tokens: int

    def denominator(self, mode: ReductionMode) -> int:
        return {
            "sum": 1,
            "samples": self.samples,
            "active_tokens": self.active_tokens,
            "advantage_tokens": self.advantage_tokens,
        }[mode]

    def candidates(self) -> dict[ReductionMode, int]:
        """Every known denominator that is defined for this batch (a zero count is not a denominator)."""
        return {m: d for m in REDUCTION_MODES if (d := self.denominator(m)) > 0}


def batch_totals(data: Sequence[WireDatum], loss_fn: str) -> BatchTotals:
    """The totals PyTRIO sends with every chunk of a call, from what is actually sent."""
    active = advantage = 0
    for d in data:
        for j, target in enumerate(d.targets):
            if target == IGNORE_INDEX:
                continue
            if loss_fn == "cross_entropy":
                active += (d.weights[j] if d.weights is not None else 1.0) != 0.0
            else:
                active += 1
                advantage += d.advantages is not None and d.advantages[j] != 0.0
    return BatchTotals(len(data), active, advantage)


def match_reduction(
    local_loss: float, server_loss: float, candidates: dict[ReductionMode, int]
) -> ReductionMode | None:
    """The mode whose denominator turns the local (summed) loss into the server's, if any is close."""
    if not (math.isfinite(local_loss) and math.isfinite(server_loss)) or server_loss == 0.0:
        return None
    best: tuple[float, ReductionMode] | None = None
    for mode, denominator in candidates.items():
        error = abs(server_loss * denominator / local_loss - 1.0)
        if best is None or error < best[0]:
            best = (error, mode)
    return best[1] if best is not None and best[0] <= MATCH_TOLERANCE else None


@dataclass(frozen=True)
class ReductionReport:
    """What the probe found for one loss: the matched mode and the numbers it was read from."""

    loss_fn: str
    mode: ReductionMode
    denominator: int
    local_loss: float
    server_loss: float


@dataclass(frozen=True)
class LossProbe:
    """One forward pass scored two ways: by the service and here (for the reduction self-check)."""

    local_loss: float
    server_loss: float
    totals: BatchTotals
    learner_logprobs: list[list[float]]


class ProbedService(Protocol):
    """What the self-check needs of a remote adapter (``retool.backends.remote.RemoteTrainingClient``)."""

    sdk_name: str

    @property
    def held_tokenizer(self) -> Tokenizer | None: ...

    def probe_loss(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> LossProbe: ...

    def set_reduction(self, loss_fn: str, mode: ReductionMode) -> None: ...


def probe_datums(tokenizer: Tokenizer | None = None) -> list[Datum]:
    """Two short datums whose totals make every known denominator different: 2 samples, 5 active
    tokens, 3 advantage tokens (a weighted position with advantage 0 is active but not an advantage
    token), and a plain sum of 1. The first position of each is masked, as prompt tokens are."""
    ids: list[int] = []
    if tokenizer is not None:
        try:
            ids = [int(t) for t in tokenizer.encode("One plus one is two, so the answer is 2.")]
        except Exception:  # any tokenizer oddity: fall back to ids every vocabulary has
            ids = []
    if len(ids) < 9:
        ids = list(range(1, 10))
    a, b = ids[:5], ids[5:9]
    return [
        Datum(a[:-1], a[1:], [0.0] * 4, [0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]),
        Datum(b[:-1], b[1:], [0.0] * 3, [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]),
    ]


def _on_policy(datums: Sequence[Datum], learner_logprobs: Sequence[Sequence[float]]) -> list[Datum]:
    """The probe with the service's own logprobs as sampling logprobs, so every ratio is ~1 and the RL
    loss is well away from 0 (``-sum(A)`` over trained positions) whatever the model."""
    out = []
    for d, lps in zip(datums, learner_logprobs, strict=True):
        old = [float(lp) if w != 0 else 0.0 for lp, w in zip(lps, d.weights, strict=True)]
        out.append(Datum(d.input_tokens, d.target_tokens, old, d.advantages, d.weights))
    return out


def verify_reduction(
    client: ProbedService, loss_fn: str, loss_config: dict[str, float] | None = None
) -> list[ReductionReport]:
    """Probe the service (forward passes only), adopt the denominators it uses, or raise.

    Cross-entropy is probed first (it also yields the learner logprobs the RL probe needs); an RL loss is
    then probed on-policy. Returns one report per loss probed.
    """
    datums = probe_datums(client.held_tokenizer)
    plan: list[tuple[str, dict[str, float] | None]] = [("cross_entropy", None)]
    if loss_fn != "cross_entropy":
        plan.append((loss_fn, loss_config))
    reports: list[ReductionReport] = []
    for name, config in plan:
        probe = client.probe_loss(datums, name, config)
        candidates = probe.totals.candidates()
        mode = match_reduction(probe.local_loss, probe.server_loss, candidates)
        if mode is None:
            ratio = probe.local_loss / probe.server_loss if probe.server_loss else math.inf
            known = ", ".join(f"{m} ({d})" for m, d in candidates.items())
            raise ReductionCheckError(
                f"{client.sdk_name}: the service reported loss {probe.server_loss:.6g} for a probe batch whose "
                f"summed loss is {probe.local_loss:.6g} (ratio {ratio:.4g}), which matches none of the known "
                f"normalisations for {name!r}: {known}. Refusing to train: every gradient would be scaled "
                "by an unknown factor. Check the service's documentation for how it reduces the loss."
            )
        client.set_reduction(name, mode)
        denominator = candidates[mode]
        logger.info(
            "%s: the service normalises %s by %s (denominator %d on the probe batch: reported %.6g, summed %.6g)",
            client.sdk_name,
            name,
            mode,
            denominator,
            probe.server_loss,
            probe.local_loss,
        )
        reports.append(ReductionReport(name, mode, denominator, probe.local_loss, probe.server_loss))
        if name == "cross_entropy":
            datums = _on_policy(datums, probe.learner_logprobs)
    return reports
