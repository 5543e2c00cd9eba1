"""``SandboxFusionExecutor``: scale execution out to a SandboxFusion service over its HTTP run-code API.

Protocol (bytedance/SandboxFusion, ``sandbox/server/sandbox_api.py``): ``POST {base_url}/run_code`` with
``{"code", "language": "python", "run_timeout", "compile_timeout", "memory_limit_MB"}``; the reply is
``{"status": "Success"|"Failed"|"SandboxError", "message", "compile_result", "run_result": {"status":
"Finished"|"Error"|"TimeLimitExceeded", "execution_time", "return_code", "stdout", "stderr"}, ...}``.

Transport failures, HTTP 5xx/429 and ``SandboxError`` replies are retried with exponential backoff; a
semaphore caps concurrent requests (sync and async separately); every request has a timeout of the run
timeout plus a margin. Isolation is whatever the service provides (its ``lite`` mode allows the internet).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx

from retool.sandbox.base import ExecResult, Executor, is_memory_failure

logger = logging.getLogger(__name__)

_RETRY_STATUS = {429, 500, 502, 503, 504}


class SandboxFusionError(RuntimeError):
    """The service could not run the code after all retries."""


def _tail(text: str | None, cap: int) -> tuple[str, bool]:
    text = text or ""
    return (text[-cap:], True) if len(text) > cap else (text, False)


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
        request_margin: float = 10.0,
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
        self._http_timeout = httpx.Timeout(self.timeout + request_margin, connect=10.0)
        limits = httpx.Limits(max_connections=self.max_concurrency)
        self._client = httpx.Client(timeout=self._http_timeout, limits=limits)
        self._sync_sem = threading.BoundedSemaphore(self.max_concurrency)
        self._async: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient, asyncio.Semaphore]] = {}

    def _payload(self, code: str) -> dict[str, Any]:
        return {
            "code": code,
            "language": "python",
            "run_timeout": self.timeout,
            "compile_timeout": self.timeout,
            "memory_limit_MB": self.memory_mb,
        }

    def _to_result(self, body: dict[str, Any], started: float) -> ExecResult:
        run = body.get("run_result") or {}
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
    def _should_retry(response: httpx.Response | None, body: dict[str, Any] | None) -> bool:
        if response is not None and response.status_code in _RETRY_STATUS:
            return True
        return body is not None and body.get("status") == "SandboxError"

    def _failure(self, started: float, why: str) -> ExecResult:
        logger.error("SandboxFusion request failed after %d retries: %s", self.retries, why)
        return ExecResult(
            ok=False,
            stdout="",
            stderr=f"Error: sandbox service unavailable ({why}).",
            returncode=None,
            timed_out=False,
            latency=time.perf_counter() - started,
        )

    @staticmethod
    def _parse(response: httpx.Response) -> dict[str, Any] | None:
        try:
            body = response.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def _judge(self, response: httpx.Response, started: float) -> tuple[ExecResult | None, str, bool]:
        """One HTTP answer as ``(result, why it failed, worth a retry)``; ``result`` is None on failure."""
        body = self._parse(response)
        if self._should_retry(response, body):
            return (
                None,
                f"HTTP {response.status_code}: {(body or {}).get('message', response.text[:200])}",
                True,
            )
        if body is None or response.status_code >= 400:
            # A client error will not improve with retries.
            return None, f"HTTP {response.status_code}: {response.text[:200]}", False
        return self._to_result(body, started), "", False

    def _run(self, code: str) -> ExecResult:
        started = time.perf_counter()
        why = ""
        with self._sync_sem:
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(self.backoff * 2 ** (attempt - 1))
                try:
                    response = self._client.post(f"{self.url}/run_code", json=self._payload(code))
                except httpx.HTTPError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    continue
                result, why, retry = self._judge(response, started)
                if result is not None:
                    return result
                if not retry:
                    break
        return self._failure(started, why)

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
        why = ""
        result: ExecResult | None = None
        async with sem:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
                try:
                    response = await client.post(f"{self.url}/run_code", json=self._payload(code))
                except httpx.HTTPError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    continue
                result, why, retry = self._judge(response, started)
                if result is not None or not retry:
                    break
        if result is None:
            result = self._failure(started, why)
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
