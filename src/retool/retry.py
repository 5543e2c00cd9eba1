"""Timeouts and bounded, jittered retries for calls to remote services, with an idempotency rule.

Owns how every remote call of the system (sampling, ``forward_backward``, ``optim_step``, save / load,
SandboxFusion's ``run_code``) is bounded in time and retried. Nothing here knows a particular SDK: errors
are classified by type, by the HTTP status they carry and by well-known SDK exception names.

Three outcomes of a failed attempt (``classify``):

- ``NOT_SENT``: the request certainly did not take effect (connection refused, connect timeout, no pooled
  connection, HTTP 429 "too many requests"). Safe to retry any call.
- ``UNKNOWN``: it may or may not have taken effect (the connection dropped or reset mid-request, a read
  timeout, our own per-call timeout, HTTP 408 / 5xx). Safe to retry only an *idempotent* call, or a
  non-idempotent one behind an idempotency guard (see ``retool.backends.remote.guarded`` for
  ``forward_backward`` and ``optim_step``).
- ``PERMANENT``: anything else (4xx, bad arguments, bugs). Never retried.

An exception may state its outcome itself (an ``outcome`` attribute holding a ``Failure``), and
``classify`` then believes it: an adapter whose SDK re-sends requests internally knows what the last
attempt's status cannot say (a final 429 proves nothing about the earlier attempts the SDK made), and an
SDK may report "no HTTP answer" as ``status_code = 0``, which is no status at all (see
``retool.backends.remote.calls.RemoteCallError``).

The rule (``call_with_retry`` / ``acall_with_retry``): at most ``policy.attempts`` attempts; between them
"full jitter" exponential backoff, ``uniform(0, min(max_backoff, backoff * 2**k))`` (a ``Retry-After``
the server sent is honoured up to ``max_backoff``); an ``UNKNOWN`` failure of a non-idempotent call raises
``UnsafeRetryError`` at once instead of re-sending.

Per-call timeouts: ``acall_with_retry`` bounds each attempt with ``asyncio.wait_for``. A *blocking* SDK call
cannot be interrupted from Python, so ``to_thread_with_timeout`` runs it on its own daemon thread and stops
waiting at the deadline: the call is abandoned (and treated as ``UNKNOWN``), and a hung thread never holds
a shared pool's worker nor blocks the interpreter's exit (``asyncio.to_thread`` would do both).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar, TypeVarTuple

logger = logging.getLogger(__name__)

T = TypeVar("T")
Args = TypeVarTuple("Args")


class Failure(enum.Enum):
    NOT_SENT = "not_sent"
    UNKNOWN = "unknown"
    PERMANENT = "permanent"


class CallTimeoutError(TimeoutError):
    """One attempt of a remote call ran past its per-call timeout (its outcome is unknown)."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(f"{what} did not answer within {timeout:g} s")
        self.what = what
        self.timeout = timeout


class TransientStatusError(RuntimeError):
    """An answer that carries a retryable status (e.g. HTTP 503, or a service's own "try again" reply)."""

    def __init__(self, message: str, status_code: int, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after = retry_after


class RetriesExhaustedError(RuntimeError):
    """Every attempt of a call failed; ``last`` is the final attempt's error."""

    def __init__(self, what: str, attempts: int, last: BaseException) -> None:
        super().__init__(f"{what} failed after {attempts} attempt(s): {type(last).__name__}: {last}")
        self.what = what
        self.attempts = attempts
        self.last = last


class UnsafeRetryError(RuntimeError):
    """A non-idempotent call failed with an unknown outcome and nothing guards a retry: not re-sent."""


# -------------------------------------------------------------------------------------- classification

_NOT_SENT_STATUS = frozenset({429})
_UNKNOWN_STATUS = frozenset({408, 500, 502, 503, 504})
# Exception class names of HTTP / SDK libraries we do not import (httpx, requests, aiohttp, the OpenAI-style
# SDKs that Tinker and PyTRIO are built on), by what they mean for the outcome.
_NOT_SENT_NAMES = frozenset(
    {"ConnectError", "ConnectTimeout", "PoolTimeout", "ConnectionRefusedError", "ClientConnectorError"}
)
_UNKNOWN_NAMES = frozenset(
    {
        "ReadTimeout",
        "WriteTimeout",
        "TimeoutException",
        "ReadError",
        "WriteError",
        "RemoteProtocolError",
        "NetworkError",
        "APIConnectionError",
        "APITimeoutError",
        "ServerDisconnectedError",
        "ClientOSError",
        "ChunkedEncodingError",
        "IncompleteRead",
    }
)


def status_code_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (``status_code``, or ``response.status_code``), if any."""
    for holder in (exc, getattr(exc, "response", None)):
        code = getattr(holder, "status_code", None) if holder is not None else None
        if isinstance(code, int):
            return code
    return None


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def classify(exc: BaseException) -> Failure:
    """What a failed attempt means for retrying it (see the module docstring)."""
    declared = getattr(exc, "outcome", None)
    if isinstance(declared, Failure):  # the raiser knew better than the status (module docstring)
        return declared
    names = _names(exc)
    if names & _NOT_SENT_NAMES or isinstance(exc, ConnectionRefusedError):
        return Failure.NOT_SENT
    code = status_code_of(exc)
    if code is not None:
        if code in _NOT_SENT_STATUS:
            return Failure.NOT_SENT
        if code in _UNKNOWN_STATUS or code >= 500:
            return Failure.UNKNOWN
        return Failure.PERMANENT
    if names & _UNKNOWN_NAMES or isinstance(exc, ConnectionError | TimeoutError | EOFError):
        return Failure.UNKNOWN
    return Failure.PERMANENT


def parse_retry_after(value: object) -> float | None:
    """A ``Retry-After`` value in seconds; None for a missing value or an HTTP date (the backoff applies)."""
    try:
        return max(0.0, float(value)) if value is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds a server asked us to wait (``retry_after``, or a ``Retry-After`` header), if it said."""
    value = getattr(exc, "retry_after", None)
    if value is None:
        headers = getattr(getattr(exc, "response", None), "headers", None)
        with contextlib.suppress(Exception):
            value = headers.get("retry-after") if headers is not None else None
    return parse_retry_after(value)


# -------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` in all (1 = no retry); ``timeout`` seconds per attempt (None: unbounded);
    ``backoff`` / ``max_backoff``: the full-jitter exponential backoff between attempts."""

    attempts: int = 4
    timeout: float | None = None
    backoff: float = 1.0
    max_backoff: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be positive or None, got {self.timeout}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("backoff and max_backoff must be >= 0")

    def delay(self, retry: int, rng: random.Random, exc: BaseException | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        ceiling = min(self.max_backoff, self.backoff * 2 ** (retry - 1))
        wait = rng.uniform(0.0, ceiling)
        asked = retry_after_of(exc) if exc is not None else None
        if asked is not None:
            wait = max(wait, min(asked, self.max_backoff))
        return wait


@dataclass
class RetryStats:
    """Counters of one guarded client or executor (thread-safe)."""

    calls: int = 0
    retries: int = 0
    timeouts: int = 0
    failures: int = 0  # calls that raised in the end
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "calls": self.calls,
                "retries": self.retries,
                "timeouts": self.timeouts,
                "failures": self.failures,
            }


_RNG = random.Random()


def _decide(exc: Exception, attempt: int, policy: RetryPolicy, what: str, idempotent: bool) -> None:
    """Raise if ``exc`` ends the call (permanent, unsafe to re-send, or the last attempt)."""
    kind = classify(exc)
    if kind is Failure.PERMANENT:
        raise exc
    if kind is Failure.UNKNOWN and not idempotent:
        raise UnsafeRetryError(
            f"{what} failed with an unknown outcome ({type(exc).__name__}: {exc}); it is not idempotent and "
            "nothing guards a retry, so it is not re-sent"
        ) from exc
    if attempt >= policy.attempts:
        raise RetriesExhaustedError(what, attempt, exc) from exc


def _after_failure(
    exc: Exception,
    attempt: int,
    policy: RetryPolicy,
    what: str,
    idempotent: bool,
    stats: RetryStats | None,
    rng: random.Random,
) -> float:
    """Count a failed attempt and either raise (the call ends) or return the backoff before the next one."""
    if isinstance(exc, CallTimeoutError) and stats is not None:
        stats.add(timeouts=1)
    try:
        _decide(exc, attempt, policy, what, idempotent)
    except BaseException:
        if stats is not None:
            stats.add(failures=1)
        raise
    wait = policy.delay(attempt, rng, exc)
    logger.warning(
        "%s failed (%s: %s); retry %d/%d in %.2fs",
        what, type(exc).__name__, exc, attempt, policy.attempts - 1, wait,
    )  # fmt: skip
    if stats is not None:
        stats.add(retries=1)
    return wait


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    idempotent: bool = True,
    stats: RetryStats | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn()`` under ``policy`` (blocking). Each attempt is bounded by ``policy.timeout`` when set
    (on a daemon thread, see ``run_with_timeout``)."""
    rng = rng or _RNG
    if stats is not None:
        stats.add(calls=1)
    attempt = 0
    while True:
        attempt += 1
        try:
            if policy.timeout is None:
                return fn()
            return run_with_timeout(fn, policy.timeout, what)
        except Exception as exc:
            wait = _after_failure(exc, attempt, policy, what, idempotent, stats, rng)
            sleep(wait)


async def acall_with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    what: str,
    idempotent: bool = True,
    stats: RetryStats | None = None,
    rng: random.Random | None = None,
    before_retry: Callable[[BaseException], Awaitable[None]] | None = None,
) -> T:
    """Await ``fn()`` under ``policy``; each attempt bounded by ``policy.timeout`` (a cancellation).

    ``before_retry(exc)`` runs before every re-send (after the backoff): an idempotency guard hooks in
    there (e.g. discard an accumulated gradient and replay earlier calls).
    """
    rng = rng or _RNG
    if stats is not None:
        stats.add(calls=1)
    attempt = 0
    while True:
        attempt += 1
        try:
            return await _bounded(fn(), policy.timeout, what)
        except Exception as exc:
            wait = _after_failure(exc, attempt, policy, what, idempotent, stats, rng)
            await asyncio.sleep(wait)
            if before_retry is not None:
                await before_retry(exc)


# -------------------------------------------------------------------------------------- blocking calls


def run_with_timeout(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Run blocking ``fn()`` on a daemon thread; raise ``CallTimeoutError`` if it has not returned in time.

    On a timeout the thread is left to finish (or hang) on its own: Python cannot interrupt it.
    """
    done = threading.Event()
    values: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            values.append(fn())
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=target, name=f"retool-call:{what}", daemon=True).start()
    if not done.wait(timeout):
        raise CallTimeoutError(what, timeout)
    if errors:
        raise errors[0]
    return values[0]


async def to_thread_with_timeout(
    fn: Callable[[*Args], T], *args: *Args, timeout: float | None, what: str
) -> T:
    """``asyncio.to_thread`` for calls that may hang: its own daemon thread, a deadline, no shared pool."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    # If the waiter gave up (timeout, cancellation), the late answer is dropped.
    def settle_value(value: T) -> None:
        if not future.done():
            future.set_result(value)

    def settle_error(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle_error, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle_value, value)

    threading.Thread(target=target, name=f"retool-call:{what}", daemon=True).start()
    return await _bounded(future, timeout, what)


async def _bounded(awaitable: Awaitable[T], timeout: float | None, what: str) -> T:
    """Await with a deadline; only *our* deadline becomes ``CallTimeoutError`` (a ``TimeoutError`` the
    call raised itself passes through unchanged)."""
    if timeout is None:
        return await awaitable
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            return await awaitable
    except TimeoutError as exc:
        if deadline.expired():
            raise CallTimeoutError(what, timeout) from exc
        raise
