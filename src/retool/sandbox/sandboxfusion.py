"""``SandboxFusionExecutor``: scale execution out to a SandboxFusion service over its HTTP run-code API.

Protocol (bytedance/SandboxFusion, ``sandbox/server/sandbox_api.py``): ``POST {base_url}/run_code`` with
``{"code", "language": "python", "run_timeout", "compile_timeout", "memory_limit_MB"}``; the reply is
``{"status": "Success"|"Failed"|"SandboxError", "message", "compile_result", "run_result": {"status":
"Finished"|"Error"|"TimeLimitExceeded", "execution_time", "return_code", "stdout", "stderr"}, ...}``.

Faults (the rule is ``retool.retry``'s): every request is bounded in time (httpx's connect / read timeouts,
plus a wall-clock bound of the run timeout + ``request_margin`` + the connect timeout per attempt on the
async path); transport failures (refused, reset, dropped, timed out), HTTP 429 / 5xx and ``SandboxError``
replies are retried ``retries`` times with full-jitter exponential backoff (running code is idempotent for
us: it changes nothing outside the service's sandbox, so an attempt with an unknown outcome is re-sent).
When every attempt failed, or the service refuses the request (other 4xx), the call raises
``SandboxWorkerError``: an infrastructure failure that ends the trajectory as ``executor_error`` instead of
reaching the model as if its code had failed. A semaphore caps concurrent requests (sync and async
separately). Isolation is whatever the service provides (its ``lite`` mode allows the internet).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from typing import TypedDict, cast

import httpx

from retool.retry import (
    RetriesExhaustedError,
    RetryPolicy,
    RetryStats,
    TransientStatusError,
    acall_with_retry,
    call_with_retry,
    parse_retry_after,
)
from retool.sandbox.base import ExecResult, Executor, SandboxWorkerError, is_memory_failure

logger = logging.getLogger(__name__)

_RETRY_STATUS = {429, 500, 502, 503, 504}


class SandboxFusionError(RuntimeError):
    """The service refused the request (a client error that a retry would not fix)."""


class RunResult(TypedDict, total=False):
    """``run_result`` of SandboxFusion's ``/run_code`` answer (the fields read here)."""

    status: str  # Finished | TimeLimitExceeded | ...
    stdout: str | None
    stderr: str | None
    return_code: int | None


class RunCodeAnswer(TypedDict, total=False):
    """SandboxFusion's ``/run_code`` answer (the fields read here)."""

    status: str  # Success | Failed | SandboxError
    message: str
    run_result: RunResult | None


def _tail(text: str | None, cap: int) -> tuple[str, bool]:
    text = text or ""
    return (text[-cap:], True) if len(text) > cap else (text, False)


def _why(exc: BaseException) -> str:
    last = exc.last if isinstance(exc, RetriesExhaustedError) else exc
    if isinstance(last, TransientStatusError | SandboxFusionError):
        return str(last)
    return f"{type(last).__name__}: {last}"


class SandboxFusionExecutor(Executor):
    def __init__(
        self,
        url: str = "http://127.0.0.1:8080",
        *,
        timeout: float = 30.0,
        memory_mb: int = 1024,
        output_cap: int = 4096,
        max_concurrency: int = 8,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        request_margin: float = 10.0,
        connect_timeout: float = 10.0,
    ) -> None:
        super().__init__()
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"SandboxFusion url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.memory_mb = int(memory_mb)
        self.output_cap = int(output_cap)
        self.max_concurrency = max(1, int(max_concurrency))
        self.retries = max(0, int(retries))
        self.backoff = float(backoff)
        # The service may take the whole run timeout before it answers; the margin covers its overhead.
        self._http_timeout = httpx.Timeout(self.timeout + request_margin, connect=connect_timeout)
        self.policy = RetryPolicy(
            attempts=self.retries + 1,
            timeout=self.timeout + request_margin + connect_timeout,
            backoff=self.backoff,
            max_backoff=max_backoff,
        )
        self.retry_stats = RetryStats()
        limits = httpx.Limits(max_connections=self.max_concurrency)
        self._client = httpx.Client(timeout=self._http_timeout, limits=limits)
        self._sync_sem = threading.BoundedSemaphore(self.max_concurrency)
        self._async: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient, asyncio.Semaphore]] = {}

    def _payload(self, code: str) -> dict[str, str | float | int]:
        return {
            "code": code,
            "language": "python",
            "run_timeout": self.timeout,
            "compile_timeout": self.timeout,
            "memory_limit_MB": self.memory_mb,
        }

    def _to_result(self, body: RunCodeAnswer, started: float) -> ExecResult:
        run: RunResult = body.get("run_result") or {}
        status = body.get("status")
        stdout, t1 = _tail(run.get("stdout"), self.output_cap)
        stderr, t2 = _tail(run.get("stderr"), self.output_cap)
        if not run:
            stderr = stderr or f"Error: sandbox service: {status}: {body.get('message', '')}".strip()
        timed_out = run.get("status") == "TimeLimitExceeded"
        returncode = None if timed_out else run.get("return_code")
        ok = not timed_out and run.get("status") == "Finished" and returncode == 0
        return ExecResult(
            ok=ok,
            stdout=stdout,
            stderr=stderr,
            returncode=returncode,
            timed_out=timed_out,
            latency=time.perf_counter() - started,
            memory_killed=not ok and is_memory_failure(stderr, returncode, timed_out),
            truncated=t1 or t2,
        )

    @staticmethod
    def _parse(response: httpx.Response) -> RunCodeAnswer | None:
        try:
            body = response.json()
        except ValueError:
            return None
        return cast(RunCodeAnswer, body) if isinstance(body, dict) else None

    def _judge(self, response: httpx.Response, started: float) -> ExecResult:
        """One HTTP answer as a result, or the error that says whether a retry could help."""
        body = self._parse(response)
        code = response.status_code
        if code in _RETRY_STATUS:
            detail = (body or {}).get("message") or response.text[:200]
            raise TransientStatusError(
                f"HTTP {code}: {detail}", code, parse_retry_after(response.headers.get("retry-after"))
            )
        if body is not None and body.get("status") == "SandboxError":
            # The service's own "no runner available": nothing ran, try again (as a 503 would).
            raise TransientStatusError(f"HTTP {code}: SandboxError: {body.get('message', '')}", 503)
        if body is None or code >= 400:
            raise SandboxFusionError(f"HTTP {code}: {response.text[:200]}")
        return self._to_result(body, started)

    def _lost(self, started: float, exc: BaseException) -> SandboxWorkerError:
        why = _why(exc)
        with self._stats_lock:
            self.stats.worker_failures += 1
        logger.error("SandboxFusion call failed after %.1fs: %s", time.perf_counter() - started, why)
        return SandboxWorkerError(f"sandbox service unavailable ({why})")

    def _run(self, code: str) -> ExecResult:
        started = time.perf_counter()

        def attempt() -> ExecResult:
            return self._judge(self._client.post(f"{self.url}/run_code", json=self._payload(code)), started)

        with self._sync_sem:
            try:
                # httpx's own timeouts bound the blocking call; no extra thread per request.
                return call_with_retry(
                    attempt,
                    policy=replace(self.policy, timeout=None),
                    what="SandboxFusion run_code",
                    stats=self.retry_stats,
                )
            except Exception as exc:
                raise self._lost(started, exc) from exc

    async def arun(self, code: str) -> ExecResult:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        entry = self._async.get(id(loop))
        if entry is None or entry[0] is not loop:
            client = httpx.AsyncClient(
                timeout=self._http_timeout, limits=httpx.Limits(max_connections=self.max_concurrency)
            )
            entry = (loop, client, asyncio.Semaphore(self.max_concurrency))
            self._async[id(loop)] = entry
        _, client, sem = entry

        async def attempt() -> ExecResult:
            return self._judge(await client.post(f"{self.url}/run_code", json=self._payload(code)), started)

        async with sem:
            try:
                result = await acall_with_retry(
                    attempt, policy=self.policy, what="SandboxFusion run_code", stats=self.retry_stats
                )
            except Exception as exc:
                raise self._lost(started, exc) from exc
        with self._stats_lock:
            self.stats.record(result)
        return result

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._async.pop(id(loop), None)
        if entry is not None:
            await entry[1].aclose()

    def close(self) -> None:
        self._client.close()
        for loop, client, _ in list(self._async.values()):
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(client.aclose())
        self._async.clear()
