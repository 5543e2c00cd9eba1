"""The ASGI application of ``retool serve``: both APIs' routes, authentication, and size limits.

- Authentication. Without an API key every request is accepted (the server then refuses to bind anything
  but a loopback address; see ``retool.serve.cli``). With one, each SDK's own header is required: PyTRIO's
  control calls send ``X-API-Key``, its actor calls ``Authorization: Bearer <actor token>`` (handed out by
  control, derived from the key); Tinker sends ``X-API-Key``. Wrong or missing: 401.
- Size. A request body over ``Limits.max_body_bytes`` is refused with 413 while it is read (chunked bodies
  included), before any of it is parsed.
- Errors. A ``ServeError`` becomes its status with ``{"code", "message"}`` (PyTRIO's error shape) and
  ``detail`` (what Tinker's SDK shows); an unexpected exception is a 500 with its message, logged, and the
  server goes on serving everyone else.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from retool.serve.pytrio_api import PytrioApi, actor_token
from retool.serve.state import RequestTimers, ServeError, ServeState
from retool.serve.tinker_api import TinkerApi

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, "detail": message}, status_code=status)


class _TooLarge(Exception):
    pass


_TIMED_ROUTES = {"sample", "asample", "retrieve_future"}  # the sample path (``RequestTimers``)


class GuardMiddleware:
    """Checks the API key and bounds the body size of every HTTP request (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, timers: RequestTimers | None = None
    ) -> None:
        self.app = app
        self.timers = timers
        self.api_key = api_key
        self.actor_token = actor_token(api_key)
        self.max_body = max_body_bytes

    def _authorised(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        path: str = scope.get("path", "")
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if path.startswith("/v1/"):  # PyTRIO actor calls carry the token control handed out
            return hmac.compare_digest(headers.get("authorization", ""), f"Bearer {self.actor_token}")
        if path == "/api/telemetry/event" or path == "/api/v1/healthz":
            return True
        return hmac.compare_digest(headers.get("x-api-key", ""), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorised(scope):
            await error_response(401, "unauthorized", "missing or wrong API key")(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise _TooLarge
            return message

        t0 = time.perf_counter()
        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._too_large(scope, receive, send)
        route = str(scope.get("path", "")).rsplit("/", 1)[-1]
        if self.timers is not None and route in _TIMED_ROUTES:
            self.timers.add(f"http {route}", time.perf_counter() - t0)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than {self.max_body} bytes"
        await error_response(413, "too_large", message)(scope, receive, send)


def create_app(state: ServeState, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``state`` through both APIs."""
    app = FastAPI(title="retool serve", docs_url=None, redoc_url=None, openapi_url=None)
    pytrio_api = PytrioApi(state, api_key)
    tinker_api = TinkerApi(state)
    app.include_router(pytrio_api.router)
    app.include_router(tinker_api.router)
    app.state.serve = state

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, "invalid_request", f"the body is not JSON: {exc}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")

    @app.get("/retool/timers")
    async def _timers(reset: bool = False) -> JSONResponse:  # the request path's phases (bench/serve.py)
        return JSONResponse(state.timings(reset))

    @app.on_event("shutdown")
    async def _close() -> None:
        await state.close()

    app.add_middleware(
        GuardMiddleware, api_key=api_key, max_body_bytes=state.limits.max_body_bytes, timers=state.timers
    )
    return app
