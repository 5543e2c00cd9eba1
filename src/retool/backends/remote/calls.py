"""How an SDK call runs and how its failure reaches the retry guard: ``run_sdk_call`` runs one blocking
call on a daemon thread of its own, ``PendingCall`` cancels its SDK future when nobody waits any more, and
``restate_failure`` turns an SDK exception into what ``retool.retry.classify`` must read
(``RemoteCallError``).

Faults (timeouts, retries, idempotency). The trainer wraps the adapters in
``retool.backends.remote.guarded.GuardedTrainingClient``, which bounds every call by a per-call timeout and
retries transient failures by ``retool.retry``'s rule. What the adapters contribute:

- Every SDK call runs on a daemon thread of its own (``retool.retry.to_thread_with_timeout``), never in
  the event loop's shared pool: when the guard's timeout gives up on a call, the blocked thread can neither
  exhaust a pool nor hold up the interpreter's exit. The adapter then cancels the SDK's future, so the SDK
  stops its own retries and polling and frees what the call held (a PyTRIO sample slot, which a hung
  request otherwise keeps until the SDK's one-hour first-chunk timeout; a Tinker request turn).
- SDK exceptions propagate unchanged where ``retool.retry.classify`` reads them right (HTTP status,
  ``response`` with ``Retry-After``, ``APIConnectionError`` ...). Where it cannot, they are restated as
  ``RemoteCallError`` (chained with ``from``, keeping status and ``Retry-After``) with the outcome the
  guard must assume: each SDK's own rules (``sdk_outcome``: PyTRIO reports "no HTTP answer" as status 0;
  a PyTRIO training run is dead after one failed event submission), and for ``forward_backward`` /
  ``optim_step`` never "not sent": both SDKs re-send those calls themselves before they give up, so a final
  429 says nothing about the earlier attempts.
- Idempotency: neither service lets *this* layer re-send a training call safely. Both SDKs re-send it
  under an idempotency id of their own (PyTRIO: the event id; Tinker: the per-client ``seq_id``) that a
  new call from here cannot reuse, and neither service can discard an accumulated gradient. So the
  adapters declare no request dedupe (``dedupes_request_ids = False``) and no ``zero_grad_async``, and the
  guard applies its third rule: only the SDK re-sends ``forward_backward`` / ``optim_step``; an outcome
  still unknown after that stops the step (``optim_step`` refuses the doubtful gradient) and the run
  resumes from its last checkpoint. Sampling, checkpoints and sampler refreshes are re-sent by the guard.
  The SDK facts behind this are in ``retool.backends.remote.pytrio`` and ``retool.backends.remote.tinker``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

from retool.retry import Failure, classify, retry_after_of, status_code_of, to_thread_with_timeout

logger = logging.getLogger(__name__)

T = TypeVar("T")
Args = TypeVarTuple("Args")


class RemoteCallError(RuntimeError):
    """An SDK failure restated for the retry guard: ``outcome`` is what ``retool.retry.classify`` must
    assume (the SDK's own exception, with the details, is the ``__cause__``)."""

    def __init__(
        self,
        message: str,
        *,
        outcome: Failure,
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.status_code = status_code
        self.retry_after = retry_after


def cancel_future(obj: object) -> None:
    """Best effort: stop the SDK's work on a call nobody waits for any more.

    Tinker's futures hand out their ``concurrent.futures.Future`` through ``.future()`` (cancelling it
    cancels the SDK's task: its retries, its polling, its request turn); PyTRIO's have ``.cancel()``.
    Methods are looked up on the type so Tinker's future-of-client wrappers never forward to the client.
    """
    kind = type(obj)
    try:
        if callable(getattr(kind, "future", None)):
            inner = getattr(obj, "future")()  # noqa: B009 - looked up on the type above
            if isinstance(inner, concurrent.futures.Future):
                inner.cancel()
                return
        if callable(getattr(kind, "cancel", None)):
            getattr(obj, "cancel")()  # noqa: B009 - looked up on the type above
    except Exception:  # a courtesy to the SDK: the call's outcome is already "unknown" to the caller
        logger.debug("could not cancel an abandoned SDK future %r", obj, exc_info=True)


class PendingCall:
    """The SDK future of one call in flight, cancelled if the caller stops waiting (the guard's timeout).

    The worker thread ``hold``s the future as soon as the SDK returns it; ``abandon`` comes from the event
    loop. Whichever comes second cancels, so a future handed over after the timeout is cancelled too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future: object = None
        self._abandoned = False

    def hold(self, future: T) -> T:
        with self._lock:
            self._future = future
            abandoned = self._abandoned
        if abandoned:
            cancel_future(future)
        return future

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            future = self._future
        if future is not None:
            cancel_future(future)


async def run_sdk_call(
    label: str,
    fn: Callable[[PendingCall, *Args], T],
    *args: *Args,
    restate: Callable[[Exception], Exception],
) -> T:
    """Run the blocking SDK call ``fn(pending, *args)`` on its own daemon thread (``label`` names it).

    No timeout here: the guard's per-call timeout cancels this await, and then the SDK's future that
    ``fn`` handed to ``pending`` is cancelled. Failures are re-raised as ``restate`` says.
    """
    pending = PendingCall()
    try:
        return await to_thread_with_timeout(fn, pending, *args, timeout=None, what=label)
    except asyncio.CancelledError:
        pending.abandon()
        raise
    except Exception as exc:
        restated = restate(exc)
        if restated is exc:
            raise
        raise restated from exc


def restate_failure(
    exc: Exception, label: str, told: tuple[Failure, str] | None, *, sdk_resent: bool
) -> Exception:
    """``exc`` of the call ``label`` as the retry guard must read it: unchanged when ``classify`` reads it
    right, else a ``RemoteCallError`` stating the outcome (see the module docstring). ``told``: the
    outcome and why where the SDK's own rules say (``sdk_outcome``); ``sdk_resent``: the SDK re-sends this
    call itself before it gives up (``forward_backward`` / ``optim_step``)."""
    outcome, why = told if told is not None else (classify(exc), "")
    if sdk_resent and outcome is Failure.NOT_SENT:
        # The last attempt was refused, but the SDK re-sent the call before: an earlier attempt may
        # have been applied, and a call from here would carry a new idempotency id.
        outcome = Failure.UNKNOWN
        why = "the SDK re-sent it before giving up, so an earlier attempt may have been applied"
    if told is None and outcome is classify(exc):
        return exc
    status = status_code_of(exc)
    return RemoteCallError(
        f"{label}: {why} ({type(exc).__name__}: {exc})",
        outcome=outcome,
        status_code=status if status and status > 0 else None,
        retry_after=retry_after_of(exc),
    )
