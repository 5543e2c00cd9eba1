"""Timeouts, retries and the gradient-accumulation guard around any training / sampling client.

``guard_training_client(client, config)`` wraps the client the trainer uses (by default only for the
remote backends, ``retry.guard = "remote"``) so that every call is bounded by a per-call timeout and
transient failures (connection refused / reset / dropped, timeouts, HTTP 429 / 5xx) are retried with
jittered backoff, following ``retool.retry``'s rule:

- ``sample`` (and every call of the sampler returned by ``sampling_client``): idempotent (sampling changes
  no state; with a seed even the answer repeats), retried on any transient failure.
- ``save_state`` / ``load_state`` / ``sampling_client``: idempotent (same name, same state; a second
  sampler snapshot of the same weights is harmless), retried likewise.
- ``forward_backward``: **not** idempotent, since it adds to the accumulated gradient. A failure whose
  outcome is unknown (the connection dropped after the request went out, a timeout, a 5xx) may or may not
  have added the micro-batch's gradient, so a blind re-send could count it twice. The guard, in order of
  preference:

  1. the client deduplicates requests (it sets ``dedupes_request_ids = True`` and its
     ``forward_backward_async`` / ``optim_step_async`` accept ``request_id=``): every call carries an id
     that is stable across its retries (``<session>:<window>:fb:<index>``), so the service applies a
     repeated id once and the call is simply re-sent;
  2. the client can discard its accumulated gradient (``zero_grad_async()``): the guard remembers every
     ``forward_backward`` since the last ``optim_step`` (the accumulation window); after an unknown
     outcome it calls ``zero_grad`` and re-issues the whole window from its first call, then the failed
     one, so the gradient holds each micro-batch exactly once;
  3. neither: only failures that certainly did not reach the service (refused connection, 429) are
     retried; an unknown outcome raises ``UnsafeRetryError`` and the step fails, which is safe because a
     resumed run reloads the last checkpoint (weights and optimizer) and never sees the doubtful gradient.

  Until a replay succeeds the window is *tainted*: ``optim_step`` refuses to apply a gradient whose
  content is unknown.
- ``optim_step``: not idempotent (a second application moves the weights again). Retried only when the
  client deduplicates, or when the failure certainly did not reach the service; otherwise
  ``UnsafeRetryError`` (resume from the last checkpoint).

Counters (``retry_stats``: calls, retries, timeouts, failures; ``replays``: windows re-issued) feed the
trainer's ``faults/*`` metrics.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from retool.backends.interface.clients import SamplingClient, TrainingClient
from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    ReductionReport,
    Sample,
    SamplingParams,
)
from retool.retry import Failure, RetryPolicy, RetryStats, UnsafeRetryError, acall_with_retry, classify

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

T = TypeVar("T")


class GuardedSamplingClient(SamplingClient):
    """A sampler whose every request is bounded in time and retried on transient failures."""

    def __init__(self, inner: SamplingClient, policy: RetryPolicy, stats: RetryStats) -> None:
        self._inner = inner
        self._policy = policy
        self._stats = stats

    @property
    def inner(self) -> SamplingClient:
        return self._inner

    def __getattr__(self, name: str) -> Any:  # tokenizer, batch_limit...: whatever the sampler offers
        if name == "_inner":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        prompt = list(prompt_tokens)
        return await acall_with_retry(
            lambda: self._inner.sample_async(prompt, num_samples, params),
            policy=self._policy,
            what="sample",
            stats=self._stats,
        )


@dataclass
class _Call:
    """One ``forward_backward`` of the accumulation window, kept so that it can be re-issued."""

    datums: list[Datum]
    loss_fn: LossName
    loss_config: dict[str, float] | None
    request_id: str


class GuardedTrainingClient(TrainingClient):
    """See the module docstring. Forwards every other attribute to the wrapped client."""

    def __init__(
        self,
        inner: TrainingClient,
        *,
        policy: RetryPolicy,
        sample_policy: RetryPolicy | None = None,
        session: str | None = None,
    ) -> None:
        self._inner = inner
        self.policy = policy
        self.sample_policy = sample_policy or policy
        self.retry_stats = RetryStats()
        self.replays = 0
        self.dedupes = bool(getattr(inner, "dedupes_request_ids", False))
        self._zero_grad: Callable[[], Awaitable[object]] | None = getattr(inner, "zero_grad_async", None)
        self._session = session or uuid.uuid4().hex[:12]
        self._window: list[_Call] = []
        self._window_seq = 0
        self._tainted = False

    @property
    def inner(self) -> TrainingClient:
        return self._inner

    @property
    def tokenizer(self) -> Any:
        return self._inner.tokenizer

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def precision_mismatch(self) -> str | None:
        return self._inner.precision_mismatch

    @property
    def reference_kl_unavailable(self) -> str | None:
        return self._inner.reference_kl_unavailable

    @property
    def guard(self) -> str:
        """Which idempotency guard protects ``forward_backward``: ``dedupe``, ``replay`` or ``none``."""
        if self.dedupes:
            return "dedupe"
        return "replay" if self._zero_grad is not None else "none"

    def _request_id(self, kind: str, index: int) -> str:
        return f"{self._session}:{self._window_seq}:{kind}:{index}"

    async def _retry(self, fn: Callable[[], Awaitable[T]], what: str, idempotent: bool = True) -> T:
        return await acall_with_retry(
            fn, policy=self.policy, what=what, idempotent=idempotent, stats=self.retry_stats
        )

    # -- gradient accumulation -------------------------------------------------------------------
    async def _send(self, call: _Call) -> ForwardBackwardResult:
        if self.dedupes:
            return await self._inner.forward_backward_async(  # type: ignore[call-arg]
                call.datums, call.loss_fn, call.loss_config, request_id=call.request_id
            )
        return await self._inner.forward_backward_async(call.datums, call.loss_fn, call.loss_config)

    async def _replay_window(self) -> None:
        """Discard the accumulated gradient and re-issue every call of the window (guard 2)."""
        assert self._zero_grad is not None
        logger.warning(
            "forward_backward outcome unknown: discarding the accumulated gradient and re-issuing the "
            "%d earlier call(s) of this step",
            len(self._window),
        )
        self.replays += 1
        await self._zero_grad()
        for earlier in self._window:
            await self._send(earlier)
        self._tainted = False

    async def forward_backward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        call = _Call(list(datums), loss_fn, loss_config, self._request_id("fb", len(self._window)))
        guard = self.guard

        async def attempt() -> ForwardBackwardResult:
            if self._tainted and guard == "replay":
                try:
                    await self._replay_window()
                except BaseException:
                    self._tainted = True  # part of the window may have been re-applied
                    raise
            try:
                return await self._send(call)
            except BaseException as exc:
                # Our own timeout arrives here as a cancellation: the outcome is unknown too.
                certainly_not_sent = isinstance(exc, Exception) and classify(exc) is Failure.NOT_SENT
                if guard != "dedupe" and not certainly_not_sent:
                    self._tainted = True
                raise

        if self._tainted and guard == "none":
            raise UnsafeRetryError(
                "an earlier forward_backward of this step failed with an unknown outcome; the accumulated "
                "gradient cannot be trusted (resume from the last checkpoint)"
            )
        result = await self._retry(attempt, "forward_backward", idempotent=guard != "none")
        self._window.append(call)
        return result

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        if self._tainted:
            raise UnsafeRetryError(
                "optim_step refused: a forward_backward of this step failed with an unknown outcome and was "
                "not replayed, so the accumulated gradient may count a micro-batch twice or not at all "
                "(resume from the last checkpoint)"
            )
        request_id = self._request_id("optim", 0)

        async def attempt() -> OptimStepResult:
            if self.dedupes:
                return await self._inner.optim_step_async(adam, request_id=request_id)  # type: ignore[call-arg]
            return await self._inner.optim_step_async(adam)

        result = await self._retry(attempt, "optim_step", idempotent=self.dedupes)
        self._window.clear()
        self._window_seq += 1
        return result

    # -- idempotent calls ------------------------------------------------------------------------
    async def save_state_async(self, name: str) -> str:
        return await self._retry(lambda: self._inner.save_state_async(name), "save_state")

    async def load_state_async(self, path: str) -> None:
        await self._retry(lambda: self._inner.load_state_async(path), "load_state")
        # Loading replaces weights and optimizer and drops any accumulated gradient.
        self._window.clear()
        self._tainted = False

    async def sampling_client_async(self) -> SamplingClient:
        sampler = await self._retry(self._inner.sampling_client_async, "sampling_client")
        return GuardedSamplingClient(sampler, self.sample_policy, self.retry_stats)

    async def frozen_sampling_client_async(self) -> SamplingClient:
        sampler = await self._retry(self._inner.frozen_sampling_client_async, "sampling_client")
        return GuardedSamplingClient(sampler, self.sample_policy, self.retry_stats)

    async def check_reduction_async(
        self, loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> list[ReductionReport]:
        # Forward passes only, run once before training: a failure there stops the run before it starts.
        return await self._inner.check_reduction_async(loss_fn, loss_config)

    async def close_async(self) -> None:
        await self._inner.close_async()

    @property
    def one_call_per_step(self) -> bool:
        return self._inner.one_call_per_step

    def fault_counters(self) -> dict[str, float]:
        counts = {f"faults/remote_{k}": float(v) for k, v in self.retry_stats.as_dict().items()}
        counts["faults/remote_replays"] = float(self.replays)
        return counts


def guard_training_client(client: TrainingClient, config: Config) -> TrainingClient:
    """Wrap ``client`` as ``config.retry`` says (unchanged when the guard does not apply)."""
    retry = config.retry
    remote = config.backend.kind != "local"
    if retry.guard == "never" or (retry.guard == "remote" and not remote):
        return client
    if isinstance(client, GuardedTrainingClient):
        return client
    return GuardedTrainingClient(
        client,
        policy=RetryPolicy(
            attempts=retry.attempts,
            timeout=retry.call_timeout or None,
            backoff=retry.backoff,
            max_backoff=retry.max_backoff,
        ),
        sample_policy=RetryPolicy(
            attempts=retry.attempts,
            timeout=retry.sample_timeout or None,
            backoff=retry.backoff,
            max_backoff=retry.max_backoff,
        ),
    )
