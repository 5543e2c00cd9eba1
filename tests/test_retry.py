"""``retool.retry``: per-call timeouts, bounded jittered retries, error classification, the idempotency rule.

Fakes fail in the three ways a remote service does: they hang (past the per-call timeout), drop the
connection (``ConnectionResetError``, an httpx-style ``RemoteProtocolError``), or answer 503 / 429.
Backoff sleeps are real but tiny (``backoff`` 1 ms); nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import pytest

from retool.retry import (
    CallTimeoutError,
    Failure,
    RetriesExhaustedError,
    RetryPolicy,
    RetryStats,
    TransientStatusError,
    UnsafeRetryError,
    acall_with_retry,
    call_with_retry,
    classify,
    parse_retry_after,
    run_with_timeout,
    to_thread_with_timeout,
)

FAST = RetryPolicy(attempts=4, timeout=0.2, backoff=0.001, max_backoff=0.002)


class HTTPError(Exception):
    """An SDK-style error carrying an HTTP status, like the OpenAI-style SDKs' ``APIStatusError``."""

    def __init__(self, status_code: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.response = type("R", (), {"status_code": status_code, "headers": headers or {}})()


class RemoteProtocolError(Exception):
    """Named like httpx's: the server closed the connection without an answer."""


class ConnectError(Exception):
    """Named like httpx's: the connection could not be made (nothing was sent)."""


class Flaky:
    """Fails with the scripted faults, in order, then answers ``"ok"``; counts attempts and sends."""

    def __init__(self, *faults: str, hang_s: float = 5.0) -> None:
        self.faults = list(faults)
        self.attempts = 0
        self.applied = 0  # how many attempts reached "the server" and took effect
        self.hang_s = hang_s
        self.release = threading.Event()

    def _fault(self) -> str | None:
        self.attempts += 1
        return self.faults.pop(0) if self.faults else None

    def _raise(self, fault: str) -> None:
        if fault == "drop":  # the request took effect, the answer was lost
            self.applied += 1
            raise ConnectionResetError("connection reset by peer")
        if fault == "remote-protocol":
            self.applied += 1
            raise RemoteProtocolError("Server disconnected without sending a response.")
        if fault == "503":
            raise HTTPError(503)
        if fault == "429":
            raise HTTPError(429, {"retry-after": "0"})
        if fault == "refused":
            raise ConnectionRefusedError("connection refused")
        if fault == "400":
            raise HTTPError(400)
        if fault == "bug":
            raise ValueError("bad argument")
        raise AssertionError(fault)

    def __call__(self) -> str:
        fault = self._fault()
        if fault == "hang":
            self.release.wait(self.hang_s)
            return "too late"
        if fault is not None:
            self._raise(fault)
        self.applied += 1
        return "ok"

    async def acall(self) -> str:
        fault = self._fault()
        if fault == "hang":
            await asyncio.sleep(self.hang_s)
            return "too late"
        if fault is not None:
            self._raise(fault)
        self.applied += 1
        return "ok"


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionRefusedError(), Failure.NOT_SENT),
        (ConnectError("x"), Failure.NOT_SENT),
        (HTTPError(429), Failure.NOT_SENT),
        (ConnectionResetError(), Failure.UNKNOWN),
        (BrokenPipeError(), Failure.UNKNOWN),
        (RemoteProtocolError("x"), Failure.UNKNOWN),
        (CallTimeoutError("x", 1.0), Failure.UNKNOWN),
        (TimeoutError(), Failure.UNKNOWN),
        (HTTPError(500), Failure.UNKNOWN),
        (HTTPError(503), Failure.UNKNOWN),
        (HTTPError(504), Failure.UNKNOWN),
        (TransientStatusError("x", 503), Failure.UNKNOWN),
        (HTTPError(400), Failure.PERMANENT),
        (HTTPError(404), Failure.PERMANENT),
        (ValueError("x"), Failure.PERMANENT),
        (RuntimeError("x"), Failure.PERMANENT),
    ],
)
def test_classify(exc: BaseException, expected: Failure) -> None:
    assert classify(exc) is expected


def test_classify_real_httpx_errors() -> None:
    httpx = pytest.importorskip("httpx")
    request = httpx.Request("POST", "http://x/run_code")
    assert classify(httpx.ConnectError("refused", request=request)) is Failure.NOT_SENT
    assert classify(httpx.ReadTimeout("slow", request=request)) is Failure.UNKNOWN
    assert classify(httpx.RemoteProtocolError("dropped", request=request)) is Failure.UNKNOWN
    response = httpx.Response(503, request=request)
    assert classify(httpx.HTTPStatusError("503", request=request, response=response)) is Failure.UNKNOWN


def test_backoff_is_full_jitter_bounded_and_honours_retry_after() -> None:
    policy = RetryPolicy(attempts=10, backoff=1.0, max_backoff=8.0)
    rng = random.Random(0)
    for retry, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        delays = [policy.delay(retry, rng) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2 and min(delays) < ceiling / 2  # spread, not a fixed delay
    assert policy.delay(1, rng, HTTPError(429, {"retry-after": "5"})) >= 5.0
    assert policy.delay(1, rng, HTTPError(429, {"retry-after": "500"})) <= 8.0  # capped
    assert parse_retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="timeout"):
        RetryPolicy(timeout=0)


# -- blocking calls -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["hang", "drop", "remote-protocol", "503", "429", "refused"])
def test_sync_transient_faults_are_retried(fault: str) -> None:
    fake = Flaky(fault, fault)
    stats = RetryStats()
    try:
        assert call_with_retry(fake, policy=FAST, what="fake", stats=stats) == "ok"
    finally:
        fake.release.set()
    assert fake.attempts == 3
    assert stats.as_dict() == {
        "calls": 1,
        "retries": 2,
        "timeouts": 2 if fault == "hang" else 0,
        "failures": 0,
    }


@pytest.mark.parametrize("fault", ["400", "bug"])
def test_permanent_errors_are_not_retried(fault: str) -> None:
    fake = Flaky(fault)
    with pytest.raises((HTTPError, ValueError)):
        call_with_retry(fake, policy=FAST, what="fake")
    assert fake.attempts == 1


def test_attempts_are_bounded() -> None:
    fake = Flaky(*["503"] * 10)
    stats = RetryStats()
    with pytest.raises(
        RetriesExhaustedError, match=r"fake failed after 4 attempt\(s\): HTTPError: HTTP 503"
    ) as info:
        call_with_retry(fake, policy=FAST, what="fake", stats=stats)
    assert fake.attempts == 4 and isinstance(info.value.last, HTTPError)
    assert stats.as_dict()["failures"] == 1


def test_non_idempotent_call_is_not_resent_after_an_unknown_outcome() -> None:
    fake = Flaky("drop")
    with pytest.raises(UnsafeRetryError, match=r"unknown outcome.*not idempotent"):
        call_with_retry(fake, policy=FAST, what="fake", idempotent=False)
    assert fake.attempts == 1 and fake.applied == 1  # applied once, never twice


@pytest.mark.parametrize("fault", ["refused", "429"])
def test_non_idempotent_call_is_retried_when_it_certainly_was_not_sent(fault: str) -> None:
    fake = Flaky(fault)
    assert call_with_retry(fake, policy=FAST, what="fake", idempotent=False) == "ok"
    assert fake.attempts == 2 and fake.applied == 1


def test_run_with_timeout_abandons_a_hung_call() -> None:
    release = threading.Event()
    with pytest.raises(CallTimeoutError, match=r"hung call did not answer within 0\.05 s"):
        run_with_timeout(lambda: release.wait(30), 0.05, "hung call")
    release.set()
    assert run_with_timeout(lambda: 7, 1.0, "quick") == 7
    with pytest.raises(KeyError):
        run_with_timeout(lambda: {}["x"], 1.0, "raises")


# -- async calls --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["hang", "drop", "remote-protocol", "503", "429", "refused"])
def test_async_transient_faults_are_retried(fault: str) -> None:
    fake = Flaky(fault, fault)
    stats = RetryStats()
    assert asyncio.run(acall_with_retry(fake.acall, policy=FAST, what="fake", stats=stats)) == "ok"
    assert fake.attempts == 3 and stats.retries == 2
    assert stats.timeouts == (2 if fault == "hang" else 0)


def test_async_timeout_does_not_swallow_the_calls_own_timeout_error() -> None:
    async def raises_timeout() -> None:
        raise TimeoutError("the SDK's own")

    with pytest.raises(RetriesExhaustedError) as info:
        asyncio.run(acall_with_retry(raises_timeout, policy=FAST, what="fake"))
    assert type(info.value.last) is TimeoutError and str(info.value.last) == "the SDK's own"


def test_before_retry_runs_before_each_resend() -> None:
    fake = Flaky("drop", "drop")
    seen: list[str] = []

    async def guard(exc: BaseException) -> None:
        seen.append(type(exc).__name__)

    assert asyncio.run(acall_with_retry(fake.acall, policy=FAST, what="fake", before_retry=guard)) == "ok"
    assert seen == ["ConnectionResetError", "ConnectionResetError"]


def test_to_thread_with_timeout_leaves_no_pool_thread_behind() -> None:
    """A hung blocking call times out on its own daemon thread; the loop's default pool stays free."""
    release = threading.Event()

    async def main() -> tuple[Any, Any]:
        with pytest.raises(CallTimeoutError):
            await to_thread_with_timeout(release.wait, 30, timeout=0.05, what="hung SDK call")
        quick = await to_thread_with_timeout(lambda: "answer", timeout=1.0, what="quick")
        default_pool = await asyncio.to_thread(lambda: "default pool free")
        return quick, default_pool

    quick, default_pool = asyncio.run(main())
    hung = [t for t in threading.enumerate() if t.name == "retool-call:hung SDK call"]
    assert quick == "answer" and default_pool == "default pool free"
    assert hung and all(t.daemon for t in hung)  # still blocked, but cannot block the interpreter's exit
    release.set()
    for t in hung:
        t.join(timeout=5)
