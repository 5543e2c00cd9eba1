"""How a managed training service normalises the loss, and the startup self-check that finds out.

Owns the vocabulary the remote adapters share: the batch totals a service can divide by (``BatchTotals``,
counted exactly as PyTRIO's SDK counts them in ``pytrio/client/training_batch.py``), the named
reductions (``ReductionMode``), the per-datum scales that undo each of them (``datum_scales``), and
``verify_reduction``: once per run, before training, the loop calls the training client's
``check_reduction_async`` hook (a no-op but for the remote adapters, which run this check).

The check identifies the reduction in one of two ways:

- **Loss metric** (Tinker's ``loss:sum``, PyTRIO's ``loss_sum``): the adapter asks its service to score a
  tiny probe batch with known weights (a forward pass, no gradient) and compares the loss the service
  reports with the same batch reduced here each known way, from the logprobs it returns.
- **Gradient norms**, for a service whose forward pass reports no loss (SkyRL's Tinker server answers
  ``metrics == {}``): on a scratch LoRA model of its own (never the one being trained, whose optimizer
  state must stay untouched) the adapter runs four on-policy probe batches through ``forward_backward`` +
  ``optim_step`` with learning rate 0 and reads the gradient norm each step reports. The batches are
  chosen so that every known reduction predicts a different set of norm ratios (``GRADIENT_PROBES``).

If a known reduction matches, the adapter adopts it (so what it sends reproduces the loop's weighted sum);
if none does, training is refused with what was measured, because every gradient would be off by an
unknown factor.

Known reductions (per ``forward_backward`` call, or per optimizer step):

- ``sum``: none; Tinker documents a plain sum over tokens and datums.
- ``samples``: the number of datums in the call.
- ``active_tokens``: positions whose target is not ignored (``-100``) and, for cross-entropy, whose
  weight is not 0. A position with a weight but zero advantage is active.
- ``advantage_tokens``: active positions whose advantage is not 0 (RL losses only).
- ``sequence_mean``: SkyRL's (``skyrl/backends/jax.py``, 0.4.0: ``per_seq_loss = per_token_losses.sum(-1)
  / jnp.maximum(loss_mask.sum(-1), 1e-9)``, summed over the call's sequences; ``AccumulatedGradients``
  divides the accumulated gradient by the number of sequences accumulated before ``optim_step``): each
  datum's weighted loss divided by the sum of its own weights (``loss_mask`` is the datum's ``weights``),
  then the mean over the step's datums. No single denominator: each datum is scaled by its own weight sum
  times the step's datum count, so a step must be sent in one ``forward_backward`` call (the adapter
  says so through ``one_call_per_step``). The weights' own scale cancels in that ratio, so a
  cross-entropy gradient cannot be weighted back to the loop's sum on such a service; RL losses carry
  their weights in the advantages and send the weights as a 0/1 mask, which works.

The check runs forward passes only (no gradient is accumulated, nothing reaches the optimizer), and it
assumes the service reports the loss it differentiates, normalised the same way in a forward pass as in a
forward-backward pass (both go through one request type in both SDKs). Only a live account can confirm
that; the check then makes any mismatch loud instead of silent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from retool.backends.interface.types import Datum, ReductionMode, ReductionReport, Tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
REDUCTION_MODES: tuple[ReductionMode, ...] = (
    "sum",
    "samples",
    "active_tokens",
    "advantage_tokens",
    "sequence_mean",
)
SCALAR_MODES: tuple[ReductionMode, ...] = ("sum", "samples", "active_tokens", "advantage_tokens")
# The probe's candidate denominators differ by at least 1.5x, so 2% separates them with room for a
# service that computes its loss in bf16.
MATCH_TOLERANCE = 0.02
# Gradient-norm ratios: the probes' predictions differ by at least 1.33x (GRADIENT_PROBES); 5% leaves room
# for a bf16 service and for the on-policy ratio exp(lp - q) not being exactly 1.
GRADIENT_TOLERANCE = 0.05
# SkyRL's guard against an all-zero mask (``jnp.maximum(loss_mask.sum(-1), 1e-9)``).
SEQUENCE_EPS = 1e-9


class ReductionCheckError(RuntimeError):
    """The service's loss matched none of the known normalisations: training would use a wrong scale."""


class UnweightableLossError(ValueError):
    """A loss whose gradient the service's reduction cannot be weighted back to the loop's sum."""


@dataclass(frozen=True)
class WireDatum:
    """One datum as the adapter sends it to a service, before the reduction scale is applied."""

    input_tokens: list[int]
    targets: list[int]
    # Cross-entropy: the datum's weights. RL losses: a 0/1 mask (1 where the datum weight is not 0), for
    # adapters that send one (``None`` otherwise); the weights themselves are folded into the advantages.
    weights: list[float] | None = None
    logprobs: list[float] | None = None  # RL losses only
    advantages: list[float] | None = None  # RL losses only (datum weights already folded in)

    @property
    def weight_sum(self) -> float:
        """What a ``sequence_mean`` service divides this datum's loss by (all ones when no weights)."""
        return float(sum(self.weights)) if self.weights is not None else float(len(self.targets))


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
        return {m: d for m in SCALAR_MODES if (d := self.denominator(m)) > 0}


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


def sequence_mean(datum_losses: Sequence[float], data: Sequence[WireDatum]) -> float:
    """SkyRL's objective for one step: each datum's weighted loss over its weight sum, averaged."""
    if not data:
        return 0.0
    return sum(
        loss / max(d.weight_sum, SEQUENCE_EPS) for loss, d in zip(datum_losses, data, strict=True)
    ) / len(data)


def datum_scales(data: Sequence[WireDatum], totals: BatchTotals, mode: ReductionMode) -> list[float]:
    """What each datum's advantages (or CE weights) are multiplied by so that ``mode`` yields the sum.

    ``sequence_mean`` assumes ``data`` is the whole optimizer step (the service divides the gradient by
    the number of datums accumulated); a datum with no weight contributes nothing and keeps scale 1.
    """
    if mode != "sequence_mean":
        return [float(max(totals.denominator(mode), 1))] * len(data)
    n = len(data)
    return [d.weight_sum * n if d.weight_sum > 0 else 1.0 for d in data]


def match_reduction(
    local_loss: float,
    server_loss: float,
    candidates: dict[ReductionMode, int],
    sequence_loss: float | None = None,
) -> ReductionMode | None:
    """The mode whose reduction of the local loss gives the server's, if any is close: a denominator of
    the summed loss, or (``sequence_loss``, when the adapter can adopt it) the per-sequence mean."""
    expected: dict[ReductionMode, float] = {m: local_loss / d for m, d in candidates.items()}
    if sequence_loss is not None:
        expected["sequence_mean"] = sequence_loss
    if not math.isfinite(server_loss) or server_loss == 0.0:
        return None
    best: tuple[float, ReductionMode] | None = None
    for mode, value in expected.items():
        if not math.isfinite(value) or value == 0.0:
            continue
        error = abs(server_loss / value - 1.0)
        if best is None or error < best[0]:
            best = (error, mode)
    return best[1] if best is not None and best[0] <= MATCH_TOLERANCE else None


@dataclass(frozen=True)
class LossProbe:
    """One forward pass scored two ways: by the service and here (for the reduction self-check)."""

    local_loss: float
    server_loss: float | None  # None: the service reported no loss metric
    totals: BatchTotals
    learner_logprobs: list[list[float]]
    sequence_loss: float | None = None  # the per-sequence mean here; None: the adapter cannot adopt it


class ProbedService(Protocol):
    """What the self-check needs of a remote adapter (``retool.backends.remote.common.RemoteTrainingClient``)."""

    sdk_name: str

    @property
    def held_tokenizer(self) -> Tokenizer | None: ...

    def probe_loss(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> LossProbe: ...

    def set_reduction(self, loss_fn: str, mode: ReductionMode) -> None: ...

    def to_wire(self, d: Datum, loss_fn: str) -> WireDatum: ...


class GradientProbedService(ProbedService, Protocol):
    """An adapter that can run the gradient-norm check on a scratch model (``probe_gradient_norms``)."""

    def probe_gradient_norms(
        self, forward: Datum, build: Callable[[list[float]], list[list[Datum]]], loss_fn: str
    ) -> list[float]:
        """On a scratch model: the learner logprobs of ``forward`` (a forward pass), then for each batch of
        ``build(logprobs)`` one ``forward_backward`` (unscaled) and one ``optim_step`` at learning rate 0;
        the gradient norm each step reports."""
        ...


def probe_datums(tokenizer: Tokenizer | None = None) -> list[Datum]:
    """Two short datums whose totals make every known denominator different: 2 samples, 5 active
    tokens, 3 advantage tokens (a weighted position with advantage 0 is active but not an advantage
    token), and a plain sum of 1. The first position of each is masked, as prompt tokens are. The first
    datum's weights are 2, the second's 1: a per-sequence mean (whose weights cancel within a datum) then
    differs from a token mean even when the model gives every token the same logprob."""
    ids = _probe_ids(tokenizer, 9)
    a, b = ids[:5], ids[5:9]
    return [
        Datum(a[:-1], a[1:], [0.0] * 4, [0.0, 1.0, 0.0, 1.0], [0.0, 2.0, 2.0, 2.0]),
        Datum(b[:-1], b[1:], [0.0] * 3, [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]),
    ]


def _probe_ids(tokenizer: Tokenizer | None, n: int) -> list[int]:
    ids: list[int] = []
    if tokenizer is not None:
        try:
            ids = [int(t) for t in tokenizer.encode("One plus one is two, so the answer is 2.")]
        except Exception:  # any tokenizer oddity: fall back to ids every vocabulary has
            ids = []
    return ids if len(ids) >= n else list(range(1, n + 1))


def _on_policy(datums: Sequence[Datum], learner_logprobs: Sequence[Sequence[float]]) -> list[Datum]:
    """The probe with the service's own logprobs as sampling logprobs, so every ratio is ~1 and the RL
    loss is well away from 0 (``-sum(A)`` over trained positions) whatever the model."""
    out = []
    for d, lps in zip(datums, learner_logprobs, strict=True):
        old = [float(lp) if w != 0 else 0.0 for lp, w in zip(lps, d.weights, strict=True)]
        out.append(Datum(d.input_tokens, d.target_tokens, old, d.advantages, d.weights))
    return out


# -- the gradient-norm check ---------------------------------------------------------------------------

# The RL loss the gradient probes use: on-policy (ratio 1) its gradient is -sum(w * A * grad lp), and a
# position with a weight but advantage 0 adds to a datum's weight sum without adding to its gradient,
# which cross-entropy (gradient -w * grad lp wherever w != 0) cannot do.
GRADIENT_LOSS = "importance_sampling"
# Datum "a": 4 positions, the first masked (a prompt token), 3 trained with advantage 1. "a+": the same 4
# positions and 3 more after them, trained (weight 1) with advantage 0. The model is causal, so a+ has
# a's gradient exactly, but a larger weight sum and more tokens. "a0": a with every weight 0.
_A_LEN, _A_PLUS_LEN = 4, 7
GRADIENT_PROBES = ("[a]", "[a, a]", "[a, a0]", "[a+]")


def gradient_probe_batches(
    tokenizer: Tokenizer | None,
) -> tuple[Datum, Callable[[list[float]], list[list[Datum]]]]:
    """The datum whose learner logprobs make the probes on-policy, and the probe batches built from them
    (in ``GRADIENT_PROBES`` order). Every batch's gradient is a multiple of a's: the ratios of the norms
    the service reports say how it reduced (``predicted_gradient_ratios``)."""
    ids = _probe_ids(tokenizer, _A_PLUS_LEN + 1)[: _A_PLUS_LEN + 1]
    inputs, targets = ids[:-1], ids[1:]
    forward = Datum(inputs, targets, weights=[0.0] + [1.0] * (_A_PLUS_LEN - 1))

    def build(lps: list[float]) -> list[list[Datum]]:
        old = [0.0] + [float(x) for x in lps[1:]]
        n = _A_LEN
        a = Datum(inputs[:n], targets[:n], old[:n], [0.0] + [1.0] * (n - 1), [0.0] + [1.0] * (n - 1))
        a0 = Datum(a.input_tokens, a.target_tokens, a.logprobs, a.advantages, [0.0] * n)
        adv_plus = a.advantages + [0.0] * (_A_PLUS_LEN - n)
        a_plus = Datum(inputs, targets, old, adv_plus, [0.0] + [1.0] * (_A_PLUS_LEN - 1))
        return [[a], [a, a], [a, a0], [a_plus]]

    return forward, build


def predicted_gradient_norm(data: Sequence[WireDatum], loss_fn: str, mode: ReductionMode) -> float:
    """The norm of the service's gradient for ``data`` in units of |grad a|, if it reduces by ``mode``:
    every datum that carries an advantage contributes a's gradient (see ``gradient_probe_batches``)."""
    carries = [1.0 if d.advantages is not None and any(x != 0 for x in d.advantages) else 0.0 for d in data]
    if mode == "sequence_mean":
        return sum(k / max(d.weight_sum, SEQUENCE_EPS) for k, d in zip(carries, data, strict=True)) / len(
            data
        )
    denominator = batch_totals(data, loss_fn).denominator(mode)
    return sum(carries) / denominator if denominator > 0 else math.nan


def predicted_gradient_ratios(
    batches: Sequence[Sequence[WireDatum]], loss_fn: str, modes: Sequence[ReductionMode]
) -> dict[ReductionMode, list[float]]:
    """Per mode: each probe's predicted norm over the first probe's."""
    out: dict[ReductionMode, list[float]] = {}
    for mode in modes:
        norms = [predicted_gradient_norm(b, loss_fn, mode) for b in batches]
        out[mode] = [n / norms[0] for n in norms[1:]]
    return out


def match_gradient_ratios(
    measured: Sequence[float], predicted: dict[ReductionMode, list[float]]
) -> ReductionMode | None:
    """The mode whose predicted ratios all lie within ``GRADIENT_TOLERANCE`` of the measured ones."""
    best: tuple[float, ReductionMode] | None = None
    for mode, ratios in predicted.items():
        if any(not math.isfinite(r) for r in ratios):
            continue
        error = max(abs(m / r - 1.0) for m, r in zip(measured, ratios, strict=True))
        if best is None or error < best[0]:
            best = (error, mode)
    return best[1] if best is not None and best[0] <= GRADIENT_TOLERANCE else None


def _fmt(values: Sequence[float]) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def verify_by_gradients(
    client: GradientProbedService, loss_fn: str, modes: Sequence[ReductionMode]
) -> ReductionReport:
    """Identify the reduction from the gradient norms of the probe batches (on a scratch model)."""
    forward, build = gradient_probe_batches(client.held_tokenizer)
    norms = client.probe_gradient_norms(forward, build, GRADIENT_LOSS)
    wire = [[client.to_wire(d, GRADIENT_LOSS) for d in batch] for batch in build([0.0] * len(forward))]
    predicted = predicted_gradient_ratios(wire, GRADIENT_LOSS, modes)
    measured = [n / norms[0] for n in norms[1:]] if norms and norms[0] > 0 else []
    mode = match_gradient_ratios(measured, predicted) if len(measured) == len(wire) - 1 else None
    probes = ", ".join(f"{p} {n:.6g}" for p, n in zip(GRADIENT_PROBES, norms, strict=False))
    if mode is None:
        known = "; ".join(f"{m} {_fmt(r)}" for m, r in predicted.items())
        raise ReductionCheckError(
            f"{client.sdk_name}: the service's forward pass reports no loss, so the reduction was measured "
            f"from gradient norms (on-policy {GRADIENT_LOSS}, learning rate 0, on a scratch model): {probes}"
            f"; ratios to {GRADIENT_PROBES[0]} {_fmt(measured)} match none of the known reductions' "
            f"predictions ({', '.join(GRADIENT_PROBES[1:])}): {known}. Refusing to train: every gradient "
            "would be scaled by an unknown factor. Check the service's documentation for how it reduces "
            "the loss."
        )
    detail = f"gradient norms {probes}; ratios {_fmt(measured)}, {mode} predicts {_fmt(predicted[mode])}"
    return ReductionReport(loss_fn, mode, 0, math.nan, math.nan, detail)


def _check_weightable(client: ProbedService, loss_fn: str, mode: ReductionMode) -> None:
    if loss_fn == "cross_entropy" and mode == "sequence_mean":
        raise ReductionCheckError(
            f"{client.sdk_name}: the service reduces the loss per sequence (each datum's weighted loss over "
            "the sum of its own weights, then the mean over datums), so a cross-entropy datum's weights "
            "cancel and its gradient cannot be weighted back to the loop's sum. Train an RL loss on this "
            "service, or cross-entropy on the local backend."
        )


def verify_reduction(
    client: ProbedService, loss_fn: str, loss_config: dict[str, float] | None = None
) -> list[ReductionReport]:
    """Probe the service, adopt the reductions it uses, or raise.

    Cross-entropy is probed first with a forward pass (it also yields the learner logprobs the RL probe
    needs); an RL loss is then probed on-policy. A service whose forward pass reports no loss is checked
    by gradient norms instead (``verify_by_gradients``), once for every loss. Returns one report per loss.
    """
    datums = probe_datums(client.held_tokenizer)
    plan: list[tuple[str, dict[str, float] | None]] = [("cross_entropy", None)]
    if loss_fn != "cross_entropy":
        plan.append((loss_fn, loss_config))
    reports: list[ReductionReport] = []
    for name, config in plan:
        probe = client.probe_loss(datums, name, config)
        if probe.server_loss is None:
            return _verify_without_loss_metric(client, loss_fn, [n for n, _ in plan], probe)
        candidates = probe.totals.candidates()
        mode = match_reduction(probe.local_loss, probe.server_loss, candidates, probe.sequence_loss)
        if mode is None:
            ratio = probe.local_loss / probe.server_loss if probe.server_loss else math.inf
            known = ", ".join(f"{m} ({d})" for m, d in candidates.items())
            if probe.sequence_loss is not None:
                known += f", sequence_mean ({probe.sequence_loss:.6g})"
            raise ReductionCheckError(
                f"{client.sdk_name}: the service reported loss {probe.server_loss:.6g} for a probe batch whose "
                f"summed loss is {probe.local_loss:.6g} (ratio {ratio:.4g}), which matches none of the known "
                f"normalisations for {name!r}: {known}. Refusing to train: every gradient would be scaled "
                "by an unknown factor. Check the service's documentation for how it reduces the loss."
            )
        if name == loss_fn:
            _check_weightable(client, name, mode)
        client.set_reduction(name, mode)
        denominator = candidates.get(mode, 0)
        logger.info(
            "%s: the service normalises %s by %s (denominator %s on the probe batch: reported %.6g, summed %.6g)",
            client.sdk_name,
            name,
            mode,
            denominator or "per datum",
            probe.server_loss,
            probe.local_loss,
        )
        reports.append(ReductionReport(name, mode, denominator, probe.local_loss, probe.server_loss))
        if name == "cross_entropy":
            datums = _on_policy(datums, probe.learner_logprobs)
    return reports


def _verify_without_loss_metric(
    client: ProbedService, loss_fn: str, losses: Sequence[str], probe: LossProbe
) -> list[ReductionReport]:
    modes = list(SCALAR_MODES) + (["sequence_mean"] if probe.sequence_loss is not None else [])
    if not callable(getattr(client, "probe_gradient_norms", None)):
        raise ReductionCheckError(
            f"{client.sdk_name}: the forward pass returned per-datum logprobs but no loss metric, and this "
            "adapter cannot measure gradients on a scratch model; cannot tell how the service normalises "
            "the loss"
        )
    report = verify_by_gradients(client, loss_fn, modes)  # type: ignore[arg-type]
    _check_weightable(client, loss_fn, report.mode)
    reports = []
    for name in losses:
        client.set_reduction(name, report.mode)
        reports.append(dataclasses.replace(report, loss_fn=name))
    logger.info("%s: the service reduces the loss by %s (%s)", client.sdk_name, report.mode, report.detail)
    return reports
