"""SandboxFusionExecutor against a local fake server on 127.0.0.1 that speaks SandboxFusion's run_code protocol.

The fake can also misbehave per request: hang past the client's timeout, drop the connection without an
answer, or answer 503 / 429, for the first N attempts of a code string (``hang:N``, ``drop:N``,
``flaky:N``, ``busy:N``); the client must retry those and fail loudly once its attempts are spent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from retool.sandbox import SandboxFusionExecutor, SandboxWorkerError

DROP = object()  # reply sentinel: close the connection without answering


class FakeSandboxFusion:
    """Replies like SandboxFusion's ``POST /run_code``; behaviour chosen by the code string."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.hang_seconds = 1.5
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    n = fake.attempts[body["code"]] = fake.attempts.get(body["code"], 0) + 1
                try:
                    status, reply = fake.reply(self.path, body, n)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                if reply is DROP:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = json.dumps(reply).encode() if isinstance(reply, dict) else reply
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @staticmethod
    def _run(status: str, run_status: str, stdout: str = "", stderr: str = "", rc: int | None = 0) -> dict:
        return {
            "status": status,
            "message": "",
            "compile_result": None,
            "run_result": {
                "status": run_status,
                "execution_time": 0.01,
                "return_code": rc,
                "stdout": stdout,
                "stderr": stderr,
            },
            "executor_pod_name": None,
            "files": {},
        }

    def reply(self, path: str, body: dict, attempt: int) -> tuple[int, dict | bytes | object]:
        if path != "/run_code":
            return 404, {"detail": "Not Found"}
        code = body["code"]
        if code == "print(1)":
            return 200, self._run("Success", "Finished", "1\n")
        if code == "loop":
            return 200, self._run("Failed", "TimeLimitExceeded", "partial", "", None)
        if code == "raise":
            tb = 'Traceback (most recent call last):\n  File "/tmp/x.py", line 1\nValueError: x\n'
            return 200, self._run("Failed", "Finished", "", tb, 1)
        if code.startswith(("flaky", "busy", "hang", "drop")):
            kind, failures = code.split(":")
            if attempt <= int(failures):
                if kind == "hang":
                    time.sleep(self.hang_seconds)  # past the client's timeout: it gives up first
                    return 200, self._run("Success", "Finished", "too late\n")
                if kind == "drop":
                    return 200, DROP
                return (429 if kind == "busy" else 503), b"service unavailable"
            return 200, self._run("Success", "Finished", "recovered\n")
        if code == "sandbox-error":
            return 200, {"status": "SandboxError", "message": "no runner", "run_result": None}
        if code == "slow":
            time.sleep(0.3)
            return 200, self._run("Success", "Finished", "slow\n")
        if code == "big":
            return 200, self._run("Success", "Finished", "a" * 10000 + "END")
        if code == "bad-request":
            return 422, {"detail": "validation error"}
        return 200, self._run("Success", "Finished", "")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeSandboxFusion]:
    server = FakeSandboxFusion()
    yield server
    server.close()


def test_request_fields_and_success(fake):
    with SandboxFusionExecutor(fake.url, timeout=7, memory_mb=512) as ex:
        r = ex.run("print(1)")
    assert r.ok and r.stdout == "1\n" and r.returncode == 0 and not r.timed_out
    req = fake.requests[0]
    assert req["code"] == "print(1)" and req["language"] == "python"
    assert req["run_timeout"] == 7 and req["memory_limit_MB"] == 512


def test_timeout_error_and_truncation(fake):
    with SandboxFusionExecutor(fake.url, timeout=3, output_cap=100) as ex:
        r = ex.run("loop")
        assert r.timed_out and not r.ok and r.returncode is None
        assert ex.format_tool_content(r) == "Error: execution timed out after 3 seconds."
        r = ex.run("raise")
        assert not r.ok and r.returncode == 1 and "ValueError" in ex.format_tool_content(r)
        r = ex.run("big")
        assert r.ok and r.truncated and len(r.stdout) == 100 and r.stdout.endswith("END")
        assert ex.stats.calls == 3 and ex.stats.timeouts == 1 and ex.stats.truncations == 1


def test_retries_transient_failures(fake):
    with SandboxFusionExecutor(fake.url, timeout=3, retries=3, backoff=0.01) as ex:
        r = ex.run("flaky:2")
    assert r.ok and r.stdout == "recovered\n"
    assert fake.attempts["flaky:2"] == 3


def test_gives_up_with_clear_error(fake):
    """Spent retries are an infrastructure failure (raised), never an observation for the model."""
    with SandboxFusionExecutor(fake.url, timeout=3, retries=2, backoff=0.01) as ex:
        with pytest.raises(SandboxWorkerError, match=r"sandbox service unavailable \(HTTP 503"):
            ex.run("flaky:99")
        assert fake.attempts["flaky:99"] == 3
        with pytest.raises(SandboxWorkerError, match="no runner"):
            ex.run("sandbox-error")
        assert fake.attempts["sandbox-error"] == 3  # SandboxError: nothing ran, retried like a 503
        with pytest.raises(SandboxWorkerError, match="422"):
            ex.run("bad-request")  # client errors are not retried
        assert fake.attempts["bad-request"] == 1
        assert ex.stats.calls == 0 and ex.stats.worker_failures == 3


def test_unreachable_service():
    with (
        SandboxFusionExecutor("http://127.0.0.1:9", timeout=1, retries=1, backoff=0.01) as ex,
        pytest.raises(SandboxWorkerError, match=r"unavailable.*ConnectError"),
    ):
        ex.run("print(1)")


@pytest.mark.parametrize("fault", ["hang", "drop", "flaky", "busy"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hang_drop_503_and_429_are_retried(fake, fault: str, mode: str) -> None:
    code = f"{fault}:2"
    # A 0.2 s run timeout + 0.1 s margin: a hanging attempt is abandoned after ~0.3 s (read timeout).
    with SandboxFusionExecutor(
        fake.url, timeout=0.2, request_margin=0.1, connect_timeout=1.0, retries=3, backoff=0.01
    ) as ex:
        r = ex.run(code) if mode == "sync" else asyncio.run(ex.arun(code))
        assert r.ok and r.stdout == "recovered\n", r
        assert fake.attempts[code] == 3
        assert ex.retry_stats.as_dict() == {"calls": 1, "retries": 2, "timeouts": 0, "failures": 0}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_service_that_always_hangs_fails_after_bounded_attempts(fake, mode: str) -> None:
    with SandboxFusionExecutor(
        fake.url, timeout=0.2, request_margin=0.1, connect_timeout=1.0, retries=1, backoff=0.01
    ) as ex:
        with pytest.raises(SandboxWorkerError, match="ReadTimeout"):
            ex.run("hang:99") if mode == "sync" else asyncio.run(ex.arun("hang:99"))
        assert fake.attempts["hang:99"] == 2


def test_async_concurrency_cap(fake):
    async def main(ex: SandboxFusionExecutor):
        return await asyncio.gather(*(ex.arun("slow") for _ in range(6)))

    with SandboxFusionExecutor(fake.url, timeout=3, max_concurrency=2) as ex:
        results = asyncio.run(main(ex))
        assert all(r.ok and r.stdout == "slow\n" for r in results)
        assert ex.stats.calls == 6
    assert fake.max_in_flight == 2


def test_sync_concurrency_cap(fake):
    with SandboxFusionExecutor(fake.url, timeout=3, max_concurrency=1) as ex:
        threads = [threading.Thread(target=ex.run, args=("slow",)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert fake.max_in_flight == 1


def test_bad_url_is_rejected():
    with pytest.raises(ValueError, match="http"):
        SandboxFusionExecutor("127.0.0.1:8080")
