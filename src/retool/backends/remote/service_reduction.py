"""The adapters' side of the reduction: how the service divides the loss it sums, as an adapter knows it.

``ServiceReduction`` (the base of ``retool.backends.remote.common.RemoteTrainingClient``) owns the mode
an adapter assumes per loss, the scale it gives each datum for that mode, and the probes the startup
self-check (``retool.backends.training.reduction.verify_reduction``) runs through the adapter.

Every advantage / CE weight is multiplied by the denominator the service divides by, so the gradient the
loop gets is the one its weights describe (the mean over trained datums) whatever the service does with the
sum. The adapter starts from the SDK's documented or assumed mode and adopts the one the startup self-check
measures. Under a per-sequence mean (``sequence_mean``) each datum gets its own factor (its weight sum
times the step's datum count), which holds only if the whole optimizer step is one ``forward_backward``
call: the adapter then says ``one_call_per_step`` (``retool.train.step.train_step`` reads it) and refuses
a second call before ``optim_step``.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from retool.backends.interface.clients import TrainingClient
from retool.backends.interface.types import Datum, Tokenizer
from retool.backends.remote.calls import PendingCall
from retool.backends.remote.metrics import learner_logprobs, local_metrics, server_metrics
from retool.backends.remote.sdk import build_model, grad_norm_of, resolve
from retool.backends.training.reduction import (
    REDUCTION_MODES,
    BatchTotals,
    LossProbe,
    ReductionMode,
    ReductionReport,
    UnweightableLossError,
    WireDatum,
    datum_scales,
    sequence_mean,
    verify_reduction,
)


class ServiceReduction(TrainingClient):
    """The reduction side of a remote adapter (see the module docstring); the adapter provides the SDK
    calls (``_submit``, ``_type``) and names (``sdk_name``, ``sdk_label``) it uses."""

    sdk_name: str
    rl_weights: bool  # the adapter sends RL datums' 0/1 weight mask (and so can adopt ``sequence_mean``)
    server_loss_key: str  # the service's name for the (normalised) loss in its metrics

    def _init_reduction(self, mode: ReductionMode) -> None:
        """Start from ``mode`` for every loss, not yet verified."""
        self.reduction_verified = False  # set by ``check_reduction_async``
        if mode not in REDUCTION_MODES:
            raise ValueError(f"unknown reduction {mode!r}; use one of {', '.join(REDUCTION_MODES)}")
        self._default_mode: ReductionMode = mode
        self._modes: dict[str, ReductionMode] = {}

    # -- what the adapter provides ---------------------------------------------------------------
    @abc.abstractmethod
    def _submit(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_config: dict[str, float] | None,
        *,
        forward_only: bool,
        scale: float | None = None,
        pending: PendingCall | None = None,
        client: object = None,
    ) -> tuple[object, list[WireDatum], BatchTotals, list[float]]:
        """Send one forward(-backward) call: the SDK's answer, what was sent, its totals and scales."""

    @abc.abstractmethod
    def _type(self, name: str) -> Callable[..., object]:
        """The SDK's type ``name``."""

    @property
    @abc.abstractmethod
    def sdk_label(self) -> str:
        """The SDK and its installed version, for messages."""

    @property
    @abc.abstractmethod
    def held_tokenizer(self) -> Tokenizer | None:
        """The tokenizer the adapter already has, or ``None`` (the self-check's probe datums use it)."""

    @abc.abstractmethod
    def to_wire(self, d: Datum, loss_fn: str) -> WireDatum:
        """What the service will see for ``d`` (masking and weight folding done, reduction not yet)."""

    # -- the mode and the scales -------------------------------------------------------------------
    def reduction_for(self, loss_fn: str) -> ReductionMode:
        """The denominator this adapter assumes the service divides ``loss_fn`` by."""
        return self._modes.get(loss_fn, self._default_mode)

    def set_reduction(self, loss_fn: str, mode: ReductionMode) -> None:
        if mode not in REDUCTION_MODES:
            raise ValueError(f"unknown reduction {mode!r}; use one of {', '.join(REDUCTION_MODES)}")
        self._modes[loss_fn] = mode

    async def check_reduction_async(
        self, loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> list[ReductionReport]:
        """Verify (once per client) how the service normalises ``loss_fn`` and adopt it, or raise
        ``ReductionCheckError`` (``retool.backends.training.reduction``)."""
        if self.reduction_verified:
            return []
        reports = await asyncio.to_thread(verify_reduction, self, loss_fn, loss_config)
        self.reduction_verified = True
        return reports

    @property
    def one_call_per_step(self) -> bool:
        """True when an optimizer step must be one ``forward_backward`` call: under ``sequence_mean`` the
        service divides the step's gradient by the number of datums it accumulated, which each datum's
        scale must know when it is sent."""
        return "sequence_mean" in (self._default_mode, *self._modes.values())

    def reduction_scales(self, wire: Sequence[WireDatum], totals: BatchTotals, loss_fn: str) -> list[float]:
        """Factor per datum applied to advantages / CE weights so the service's reduction yields the loop's
        sum (``retool.backends.training.reduction.datum_scales``)."""
        mode = self.reduction_for(loss_fn)
        if mode == "sequence_mean" and loss_fn == "cross_entropy":
            raise UnweightableLossError(
                f"{self.sdk_name}: the service reduces the loss per sequence, where a cross-entropy datum's "
                "weights cancel: its gradient cannot be weighted back to the loop's sum. Train an RL loss "
                "on this service, or cross-entropy on the local backend"
            )
        return datum_scales(wire, totals, mode)

    # -- the self-check's probes -----------------------------------------------------------------
    def probe_loss(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> LossProbe:
        """A forward pass (no gradient) with unscaled weights: the service's loss and ours, for the
        reduction self-check."""
        output, wire, totals, _ = self._submit(datums, loss_fn, loss_config, forward_only=True, scale=1.0)
        learner = learner_logprobs(output, len(datums))
        metrics = server_metrics(output)
        if learner is None:
            raise RuntimeError(
                f"{self.sdk_name}: the forward pass returned no per-datum logprobs (metrics: "
                f"{sorted(metrics) or 'none'}); cannot tell how the service normalises the loss"
            )
        server = metrics.get(f"server/{self.server_loss_key}")
        per_datum = [
            local_metrics([d], loss_fn, loss_config, [lps], {}, self.server_loss_key).loss
            for d, lps in zip(datums, learner, strict=True)
        ]
        # Only an adapter that sends RL weights knows the per-datum weight sums a per-sequence service
        # divides by (PyTRIO's SDK drops them), so only it may adopt ``sequence_mean``.
        sequence = sequence_mean(per_datum, wire) if self.rl_weights else None
        return LossProbe(sum(per_datum), server, totals, learner, sequence)

    def scratch_sdk_client(self) -> Any:
        """Hook: a new SDK training client (a LoRA model of its own) for the gradient check, or
        ``NotImplementedError`` where the adapter cannot make one."""
        raise NotImplementedError

    def release_sdk_client(self, client: Any) -> None:
        """Hook: free a model made by ``scratch_sdk_client`` (best effort)."""

    def probe_gradient_norms(
        self, forward: Datum, build: Callable[[list[float]], list[list[Datum]]], loss_fn: str
    ) -> list[float]:
        """The gradient check's measurements (``retool.backends.training.reduction.verify_by_gradients``), on a
        scratch model: the adapter's own model and optimizer state are never touched."""
        try:
            scratch = self.scratch_sdk_client()
        except NotImplementedError:
            raise RuntimeError(
                f"{self.sdk_name}: the service reports no loss metric and this adapter cannot create a scratch "
                "model to measure gradients on; cannot tell how the service normalises the loss"
            ) from None
        try:
            output, *_ = self._submit(
                [forward], "cross_entropy", None, forward_only=True, scale=1.0, client=scratch
            )
            learner = learner_logprobs(output, 1)
            if learner is None:
                raise RuntimeError(f"{self.sdk_name}: the scratch model's forward pass returned no logprobs")
            adam = build_model(self._type("AdamParams"), self.sdk_label, learning_rate=0.0, weight_decay=0.0)
            norms = []
            for batch in build(learner[0]):
                self._submit(batch, loss_fn, None, forward_only=False, scale=1.0, client=scratch)
                norms.append(grad_norm_of(resolve(scratch.optim_step(adam), expect="metrics")))
            return norms
        finally:
            self.release_sdk_client(scratch)
