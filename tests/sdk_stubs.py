"""Local stand-ins for the PyTRIO and Tinker services, so the real SDK packages can be tested offline.

Each stub is a small threaded HTTP server on 127.0.0.1 (a random port) that answers the routes the real
SDK calls, with the request and response shapes read from the SDK's own code (pytrio 0.2.9, tinker 0.38.0;
the module each route comes from is named next to it). The SDKs run unmodified: their request objects,
futures, retries, serialisation (msgpack for PyTRIO's Actor events, protobuf for Tinker's forward pass
and samples) and configuration code all execute; only the far end is ours.

The "model" behind both stubs is a fixed function ``learner_lp(token)``: the logprob the policy gives a
target token. Losses are computed on the server side from the documented formulas (Tinker's docs; PyTRIO
uses the same names) and then normalised the way the stub is told to (``reduction``):

- ``sum``: no normalisation (Tinker's documented behaviour);
- ``samples`` / ``active_tokens`` / ``advantage_tokens``: divided by one of the three batch totals PyTRIO
  sends with every chunk (``pytrio/protocol/actor/events/trainer/forward.py``); the PyTRIO stub reads
  them from the request, the Tinker stub counts them itself;
- ``per_sequence_mean``: SkyRL's (``skyrl/backends/jax.py``, 0.4.0): each sequence's weighted loss over
  the sum of its weights (``per_token_losses.sum(-1) / jnp.maximum(loss_mask.sum(-1), 1e-9)``, the loss
  mask being the datum's ``weights``, all ones when none are sent, and multiplying RL losses too),
  averaged over sequences;
- ``squared_tokens``: divided by the square of the active tokens, a normalisation no adapter knows (the
  self-check must refuse it).

``SkyrlStub`` is the Tinker stub as SkyRL 0.4.0's Tinker API server behaves (see its docstring): the
per-sequence mean on a gradient it computes, no loss metric, and SkyRL's missing endpoints.

The reported loss is the normalised objective the server would differentiate: PyTRIO's ``loss_sum`` metric,
Tinker's ``loss:sum``. Every request is recorded (``requests``) so tests can read what the SDK really sent.

Faults (``StubServer.fail``): the next requests of a call ("sample", "forward_backward", "optim_step", ...)
can be answered 503 or 429 (with ``Retry-After`` when ``retry_after`` is set; nothing applied), or be
applied and then get no answer: the connection is closed at once ("drop") or held open until ``release()``
("hang"). Both services deduplicate re-sent training requests the way their SDKs rely on: PyTRIO by event
id (a repeat is answered 409 ``event_exists``, and the SDK then polls ``GET /v1/events/{id}``), Tinker by
``(model_id, seq_id)`` (a repeat is answered with the original future, applied once; the SDK's retries
assume this, the real service's behaviour cannot be read from the SDK). ``wire_ids`` lists the id of every
training request and sample that arrived, re-sends included; ``applied`` counts what took effect, and
``steps`` how many gradient accumulations each applied optimizer step consumed.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

REDUCTIONS = ("sum", "samples", "active_tokens", "advantage_tokens", "per_sequence_mean", "squared_tokens")
FAULTS = ("503", "429", "drop", "hang")
IGNORE = -100
PYTRIO_KEY = "trio-test-key"
TINKER_KEY = "tml-test-key"  # the Tinker SDK refuses keys without the tml- prefix


def learner_lp(token: int) -> float:
    """The stub policy's logprob of a target token (what forward passes return)."""
    return -0.25 - 0.1 * (token % 7)


def sampled_tokens(prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """Deterministic 'samples': three tokens that depend on the prompt and the sample index."""
    base = (sum(prompt) + 7 * index) % 50 + 10
    return [base, base + 1, base + 2][:max_tokens]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased (HTTP header names are case-insensitive)
    body: Any  # decoded JSON / msgpack / protobuf message, or raw bytes


@dataclass
class LossDatum:
    """One datum as the server sees it, whatever the wire format."""

    tokens: list[int]
    targets: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None


@dataclass
class Totals:
    samples: int
    active_tokens: int
    advantage_tokens: int


@dataclass
class SentCall:
    """One forward / forward-backward request as the server received it, and what it answered."""

    loss_fn: str
    forward_only: bool
    data: list[LossDatum]
    config: dict[str, float]
    totals: Totals  # PyTRIO: the totals the SDK sent; Tinker: counted by the stub
    reported_loss: float


def count_totals(data: list[LossDatum], loss_fn: str) -> Totals:
    """PyTRIO's batch totals, counted the way ``pytrio/client/training_batch.py`` counts them."""
    active = adv = 0
    for d in data:
        for j, t in enumerate(d.targets):
            if t == IGNORE:
                continue
            if loss_fn == "cross_entropy":
                w = d.weights[j] if d.weights is not None else 1.0
                active += w != 0.0
            else:
                active += 1
                adv += (d.advantages or [0.0] * len(d.targets))[j] != 0.0
    return Totals(len(data), active, adv)


def server_loss(
    data: list[LossDatum], loss_fn: str, config: dict[str, float], reduction: str, totals: Totals
) -> tuple[float, list[list[float]]]:
    """The normalised objective and the per-datum learner logprobs (0 where the target is ignored)."""
    lo = float(config.get("clip_low_threshold", 0.8))
    hi = float(config.get("clip_high_threshold", 1.2))
    per_seq: list[tuple[float, float]] = []
    outputs: list[list[float]] = []
    skyrl = reduction == "per_sequence_mean"
    for d in data:
        lps = [learner_lp(t) if t != IGNORE else 0.0 for t in d.targets]
        outputs.append(lps)
        total, active = 0.0, 0.0
        for j, t in enumerate(d.targets):
            if t == IGNORE:
                continue
            w = d.weights[j] if d.weights is not None else 1.0
            if loss_fn == "cross_entropy":
                total += -w * lps[j]
                active += w if skyrl else float(w != 0.0)
                continue
            assert d.logprobs is not None and d.advantages is not None
            a = d.advantages[j]
            r = math.exp(lps[j] - d.logprobs[j])
            if loss_fn == "ppo":
                token = -min(r * a, min(max(r, lo), hi) * a)
            elif loss_fn == "importance_sampling":
                token = -r * a
            else:
                raise ValueError(f"stub: unsupported loss {loss_fn}")
            # SkyRL's loss mask multiplies RL losses too; the other reductions follow Tinker's docs.
            total += w * token if skyrl else token
            active += w if skyrl else 1.0
        per_seq.append((total, active))
    raw = sum(t for t, _ in per_seq)
    if reduction == "sum":
        loss = raw
    elif reduction == "samples":
        loss = raw / totals.samples
    elif reduction == "active_tokens":
        loss = raw / max(totals.active_tokens, 1)
    elif reduction == "advantage_tokens":
        loss = raw / max(totals.advantage_tokens, 1)
    elif reduction == "per_sequence_mean":
        loss = sum(t / max(n, 1e-9) for t, n in per_seq) / max(len(per_seq), 1)
    elif reduction == "squared_tokens":
        loss = raw / max(totals.active_tokens, 1) ** 2
    else:
        raise ValueError(f"stub: unknown reduction {reduction}")
    return loss, outputs


# -- the HTTP plumbing ----------------------------------------------------------------------------

# (status, content type, body) and optionally extra headers; status 0 (``DROP``): close, no answer.
Response = tuple[int, str, bytes] | tuple[int, str, bytes, dict[str, str]]
DROP: Response = (0, "", b"")


def json_response(data: Any, status: int = 200) -> Response:
    return status, "application/json", json.dumps(data).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as both SDKs' pooled clients expect

    def _dispatch(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        stub: StubServer = self.server.stub  # type: ignore[attr-defined]
        try:
            answer = stub.handle(
                self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
            )
        except Exception as exc:  # a stub bug must show up in the SDK's error, not hang it
            stub.errors.append(f"{self.command} {self.path}: {type(exc).__name__}: {exc}")
            answer = json_response({"code": "stub_error", "message": str(exc)}, 500)
        status, ctype, payload, *extra = answer
        if status == 0:  # a dropped connection: the client reads no answer at all
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (extra[0] if extra else {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _dispatch

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        return


class StubServer:
    """Base: a threaded server on 127.0.0.1 that records requests and routes them to ``handle``."""

    def __init__(self, reduction: str) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}")
        self.reduction = reduction
        self.requests: list[Recorded] = []
        self.calls: list[SentCall] = []
        self.errors: list[str] = []
        self.sample_logprobs = True  # False: samples come back without logprobs
        self.faults: dict[str, list[str]] = {}
        self.retry_after: float | None = None  # Retry-After (seconds) sent with a 503 / 429 fault
        self.hang_limit = 30.0  # seconds a "hang" holds its connection at most, if nobody releases it
        self.wire_ids: defaultdict[str, list[str]] = defaultdict(list)
        self.applied: Counter[str] = Counter()
        self.steps: list[int] = []
        self._accumulated = 0  # forward_backward calls applied since the last optimizer step
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.stub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=type(self).__name__, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        with self._lock:
            self.requests.append(Recorded(method, path, headers, body))

    def bodies(self, path_suffix: str) -> list[Any]:
        return [r.body for r in self.requests if urlsplit(r.path).path.endswith(path_suffix)]

    # -- faults and what took effect ------------------------------------------------------------
    def fail(self, call: str, *faults: str) -> None:
        """Script the next requests of ``call`` (one fault each, in order; see the module docstring)."""
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; use {FAULTS}")
        with self._lock:
            self.faults.setdefault(call, []).extend(faults)

    def release(self) -> None:
        """End every "hang" (now and later): their connections close without an answer."""
        self._released.set()

    def arrived(self, call: str, request_id: str) -> None:
        with self._lock:
            self.wire_ids[call].append(request_id)

    def serve(self, call: str, apply: Callable[[], Response]) -> Response:
        """Answer one request of ``call``: ``apply()`` makes it take effect and returns the answer, unless
        the next scripted fault refuses it (503 / 429) or swallows the answer (drop / hang)."""
        with self._lock:
            queue = self.faults.get(call)
            fault = queue.pop(0) if queue else None
        if fault in ("503", "429"):
            headers = {} if self.retry_after is None else {"Retry-After": f"{self.retry_after:g}"}
            code = "service_unavailable" if fault == "503" else "too_many_requests"
            status, ctype, body = json_response({"code": code, "message": f"stub: {fault}"}, int(fault))
            return status, ctype, body, headers
        answer = apply()
        with self._lock:
            self.applied[call] += 1
            if call == "forward_backward":
                self._accumulated += 1
            elif call == "optim_step":
                self.steps.append(self._accumulated)
                self._accumulated = 0
        if fault == "hang":
            self._released.wait(self.hang_limit)
        return DROP if fault in ("drop", "hang") else answer

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        raise NotImplementedError


def _fake_jwt() -> str:
    """An unsigned JWT the Tinker SDK can read its expiry from (it decodes, never verifies, the claims)."""

    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    now = int(datetime.now(UTC).timestamp())
    return f"{part({'alg': 'none'})}.{part({'iat': now, 'exp': now + 3600})}.sig"


def _iso(dt: datetime) -> str:
    return dt.isoformat().replace("+00:00", "Z")


# -- PyTRIO -----------------------------------------------------------------------------------------

# Event types by the call names ``StubServer.fail`` and ``applied`` use (the rest: the part after "trainer.").
_PYTRIO_CALLS = {
    "trainer.init_run": "init_run",
    "trainer.forward": "forward",
    "trainer.forward_backward": "forward_backward",
    "trainer.optimize_step": "optim_step",
    "trainer.save_state": "save_state",
    "trainer.save_weights": "save_weights",
}


@dataclass
class _PytrioRun:
    cuid: str
    model_id: str
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    restored_from: str = ""
    events: list[str] = field(default_factory=list)


class PytrioStub(StubServer):
    """Control API (``/api/...``, ``pytrio/transport/control/``) and Actor API (``/v1/...``,
    ``pytrio/transport/actor/``) of the PyTRIO service on one port; the Actor endpoint Control hands out
    is this same server over plain HTTP (``ActorConnectionInfo.tls_enabled = False``)."""

    def __init__(self, reduction: str = "active_tokens", *, model_id: str = "Qwen/Qwen3-4B") -> None:
        super().__init__(reduction)
        self.model_id = model_id
        self.runs: dict[str, _PytrioRun] = {}
        self.checkpoints: dict[str, _PytrioRun] = {}
        self.sessions: list[str] = []
        self.event_replies: dict[str, bytes] = {}  # event id -> the msgpack reply of the applied event

    # Control responses share these pieces.
    def _actor(self) -> dict[str, Any]:
        return {
            "actor": {
                "actor_cuid": "actor-1",
                "endpoint": self.url,
                "connect_mode": "direct",
                "tls_enabled": False,
            },
            "actor_jwt": {
                "token": "jwt-test",
                "expires_at": _iso(datetime.now(UTC) + timedelta(days=1)),
            },
        }

    def _capacity(self) -> dict[str, Any]:
        return {"max_batch_size": 4, "max_tokens_per_request": 4096, "max_seq_len": 4096}

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        parts = urlsplit(path)
        route, query = parts.path, parse_qs(parts.query)
        if route.startswith("/api/"):
            data = json.loads(body) if body else {}
            self.record(method, route, headers, data)
            if headers.get("x-api-key") != PYTRIO_KEY and route != "/api/telemetry/event":
                return json_response({"code": "unauthorized", "message": "bad API key"}, 401)
            return self._control(method, route[len("/api") :], query, data)
        return self._actor_api(method, route, headers, body)

    def _control(self, method: str, route: str, query: dict[str, list[str]], data: dict) -> Response:
        now = _iso(datetime.now(UTC))
        if route == "/openapi/v1/api-key/verify":  # transport/control/api_key/verify.py
            return json_response(
                {
                    "api_key_tid": "key-1",
                    "api_key_name": "test",
                    "user_cuid": "user-1",
                    "username": "tester",
                    "display_name": None,
                    "workspace_cuid": "ws-1",
                    "workspace_name": "test",
                    "workspace_type": "personal",
                    "expires_at": None,
                }
            )
        if route == "/sdk/bootstrap":  # transport/control/platform/bootstrap.py
            return json_response(
                {"compatibility": {"status": "compatible", "sdk_version": "0.2.9"}, "notices": []}
            )
        if route == "/openapi/v1/service-sessions" and method == "POST":  # service_session/create.py
            sid = f"ss-{len(self.sessions) + 1}"
            self.sessions.append(sid)
            return json_response(
                {"service_session_cuid": sid, "workspace_cuid": "ws-1", "status": "ACTIVE", "created_at": now}
            )
        segs = route.strip("/").split("/")
        # training_run/create.py: POST /openapi/v1/service-sessions/{sid}/training-runs
        if segs[:3] == ["openapi", "v1", "service-sessions"] and segs[4:5] == ["training-runs"]:
            if method == "POST":
                cuid = f"tr-{len(self.runs) + 1}"
                self.runs[cuid] = _PytrioRun(
                    cuid,
                    self.model_id,
                    int(data["lora_rank"]),
                    data.get("seed"),
                    bool(data["train_mlp"]),
                    bool(data["train_attn"]),
                    bool(data["train_unembed"]),
                )
                return json_response(
                    {
                        "training_run_cuid": cuid,
                        "service_session_cuid": segs[3],
                        "workspace_cuid": "ws-1",
                        "status": "PENDING",
                        "run_index": len(self.runs),
                        "model_spec_cuid": "spec-1",
                        "model_alias": data["base_model"] or self.model_id,
                        "model_id": self.model_id,
                        "trainer": self._capacity(),
                        "created_at": now,
                        **self._actor(),
                    }
                )
            if method == "PATCH":  # training_run/update.py: bind a checkpoint before init
                run = self.runs[segs[5]]
                run.restored_from = data["source_checkpoint_uri"]
                return json_response(
                    {
                        "source_checkpoint_uri": data["source_checkpoint_uri"],
                        "restore_optimizer": data["restore_optimizer"],
                        "trainer": self._capacity(),
                        **self._actor(),
                    }
                )
        if segs[:3] == ["openapi", "v1", "service-sessions"] and segs[4:5] == ["sampling-runs"]:
            cuid = f"sr-{uuid.uuid4().hex[:8]}"  # sampling_run/create.py
            return json_response(
                {
                    "sampling_run_cuid": cuid,
                    "service_session_cuid": segs[3],
                    "workspace_cuid": "ws-1",
                    "status": "RUNNING",
                    "run_index": 1,
                    "model_spec_cuid": "spec-1",
                    "model_alias": data["base_model"],
                    "model_id": self.model_id,
                    "sampler": self._capacity(),
                    "created_at": now,
                    **self._actor(),
                }
            )
        if route == "/openapi/v1/training-runs/by-checkpoint-uri":  # find_by_checkpoint_uri.py
            uri = query["checkpoint_uri"][0]
            run = self.checkpoints.get(uri)
            if run is None:
                return json_response({"code": "not_found", "message": f"no checkpoint {uri}"}, 404)
            return json_response(
                {
                    "base_model": run.model_id,
                    "lora_rank": run.rank,
                    "seed": run.seed,
                    "train_mlp": run.train_mlp,
                    "train_attn": run.train_attn,
                    "train_unembed": run.train_unembed,
                }
            )
        if segs[-1] in ("close", "renew") or route == "/telemetry/event":
            return json_response({})
        return json_response({"code": "not_found", "message": f"stub: no route {method} {route}"}, 404)

    def _actor_api(self, method: str, route: str, headers: dict[str, str], body: bytes) -> Response:
        import msgpack

        if headers.get("authorization") != "Bearer jwt-test":
            self.record(method, route, headers, None)
            return json_response({"code": "unauthorized", "message": "bad actor JWT"}, 401)
        if route == "/v1/client/heartbeat":  # transport/actor/heartbeat.py
            self.record(method, route, headers, json.loads(body or b"{}"))
            return json_response({"heartbeat_ms": 60_000})
        if route == "/v1/events" and method == "POST":  # transport/actor/event/submit.py
            envelope = msgpack.unpackb(body, raw=False)
            self.record(method, route, headers, envelope)
            kind, event_id = envelope["type"], envelope["event_id"]
            call = _PYTRIO_CALLS.get(kind, kind)
            self.arrived(call, event_id)
            with self._lock:
                seen = event_id in self.event_replies
            if seen:  # the event id is the idempotency key: the SDK then polls the original event
                return json_response({"code": "event_exists", "message": f"event {event_id} exists"}, 409)

            def apply() -> Response:
                run = self.runs[envelope["metadata"]["run_id"]]
                run.events.append(kind)
                result = self._event(run, kind, envelope["payload"])
                reply = {
                    "version": 1,
                    "event_id": event_id,
                    "type": kind,
                    "status": "succeeded",
                    "result": result,
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                }
                packed = msgpack.packb(reply, use_bin_type=True)
                with self._lock:
                    self.event_replies[event_id] = packed
                return 200, "application/msgpack", packed

            return self.serve(call, apply)
        if route.startswith("/v1/events/") and method == "GET":  # transport/actor/event/get.py
            self.record(method, route, headers, None)
            with self._lock:
                packed = self.event_replies.get(route.rsplit("/", 1)[1])
            if packed is None:
                return json_response({"code": "not_found", "message": f"stub: no event {route}"}, 404)
            return 200, "application/msgpack", packed
        if route.startswith("/v1/sampling-runs/") and route.endswith("/sample"):
            request = json.loads(body)  # transport/actor/sampling_run/sample.py (JSON in and out)
            self.record(method, route, headers, request)
            self.arrived("sample", request["request_id"])
            return self.serve("sample", lambda: self._sample(request))
        self.record(method, route, headers, body)
        return json_response({"code": "not_found", "message": f"stub: no route {method} {route}"}, 404)

    def _sample(self, request: dict[str, Any]) -> Response:
        prompt = [t for c in request["prompt"]["chunks"] for t in c["tokens"]]
        params = request["sampling_params"]
        seqs = []
        for i in range(int(request["num_samples"])):
            toks = sampled_tokens(prompt, i, int(params["max_tokens"]))
            seqs.append(
                {
                    "tokens": toks,
                    "text": None,
                    "logprobs": [learner_lp(t) for t in toks]
                    if request["return_token_logprobs"] and self.sample_logprobs
                    else [],
                    "stop_reason": "length" if i % 2 else "stop",
                }
            )
        return json_response({"request_id": request["request_id"], "sequences": seqs})

    def _event(self, run: _PytrioRun, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        if kind == "trainer.init_run":
            return {}
        if kind in ("trainer.forward", "trainer.forward_backward"):
            loss_fn = payload["loss"]["type"]
            data = [
                LossDatum(
                    tokens=[t for c in d["model_input"]["chunks"] for t in c["tokens"]],
                    targets=list(d["target_ids"]),
                    weights=d.get("weights"),
                    logprobs=d.get("logprobs"),
                    advantages=d.get("advantages"),
                )
                for d in payload["data"]
            ]
            ga = payload["gradient_accumulation"]  # the server normalises by what the SDK sent
            totals = Totals(ga["total_samples"], ga["total_active_tokens"], ga["total_advantage_tokens"])
            config = dict(payload["loss"].get("config", {}))
            loss, outputs = server_loss(data, loss_fn, config, self.reduction, totals)
            self.calls.append(SentCall(loss_fn, kind == "trainer.forward", data, config, totals, loss))
            count = count_totals(data, loss_fn).active_tokens
            return {
                "loss_fn_outputs": [
                    {
                        "logprobs": {
                            "dtype": "<f4",
                            "shape": [len(lps)],
                            "encoding": "raw_le",
                            "data": struct.pack(f"<{len(lps)}f", *lps),
                        }
                    }
                    for lps in outputs
                ],
                "metrics": {"loss_sum": loss, "loss_mean": loss / max(count, 1), "token_count": count},
            }
        if kind == "trainer.optimize_step":
            return {"metrics": {"grad_norm": 0.75, "learning_rate": payload["adam_params"]["learning_rate"]}}
        if kind in ("trainer.save_state", "trainer.save_weights"):
            uri = f"pytrio-stub://{run.cuid}/{kind.split('.')[1]}/{payload['name']}"
            self.checkpoints[uri] = run
            return {"checkpoint": {"uri": uri, "model_id": run.model_id, "size_bytes": 1}}
        raise ValueError(f"stub: unsupported event {kind}")


# -- Tinker -----------------------------------------------------------------------------------------


class TinkerStub(StubServer):
    """The Tinker REST API (``tinker/resources/*.py``). JSON requests, except ``/forward_backward``, which
    the SDK sends as protobuf (``tinker/proto/request_conv.py``); every training and sampling call returns
    a future id that the SDK polls at ``/api/v1/retrieve_future`` (``tinker/lib/api_future_impl.py``),
    answered with JSON, or protobuf for forward passes and samples (``tinker/proto/response_conv.py``).
    The API key is exchanged for a JWT first (``pjwt_auth_enabled``, which the SDK calls the default;
    ``tinker/lib/_jwt_auth.py``)."""

    def __init__(
        self,
        reduction: str = "sum",
        *,
        model_name: str = "Qwen/Qwen3-4B",
        client_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(reduction)
        self.model_name = model_name
        # The SDK's defaults, plus the JWT exchange its code describes as the service's default.
        self.client_config = {"pjwt_auth_enabled": True, **(client_config or {})}
        self.jwt = _fake_jwt()
        self.futures: dict[str, Response] = {}
        self.models: dict[str, dict[str, Any]] = {}
        self.checkpoints: dict[str, dict[str, Any]] = {}
        self.by_seq_id: dict[str, Response] = {}  # "<model_id>:<seq_id>" -> the answer given when applied
        self._n = 0
        self._sessions = 0

    def _future(self, result: Response, model_id: str | None = None, **extra: Any) -> Response:
        """Store a result under a new future id and answer with the ``UntypedAPIFuture``."""
        with self._lock:
            self._n += 1
            rid = f"req-{self._n}"
            self.futures[rid] = result
        return json_response({"request_id": rid, "model_id": model_id, **extra})

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        route = urlsplit(path).path
        if route == "/api/v1/forward_backward":
            return self._forward_backward(headers, body)
        data = json.loads(body) if body else {}
        self.record(method, route, headers, data)
        if route == "/api/v1/auth/token":  # lib/_jwt_auth.py: the API key buys a short-lived JWT
            if headers.get("x-api-key") != TINKER_KEY:
                return json_response({"detail": "bad API key"}, 401)
            return json_response({"jwt": self.jwt})
        if headers.get("x-api-key") not in (TINKER_KEY, self.jwt):
            return json_response({"detail": "bad API key"}, 401)
        if route == "/api/v1/client/config":
            return json_response(self.client_config)
        if route == "/api/v1/client/dynamic_config":
            return json_response({})
        if route == "/api/v1/create_session":
            with self._lock:
                self._sessions += 1
                sid = f"sess-{self._sessions}"
            return json_response({"type": "create_session", "session_id": sid})
        if route == "/api/v1/session_heartbeat":
            return json_response({"type": "session_heartbeat"})
        if route == "/api/v1/create_model":
            model_id = f"{data['session_id']}:train:{data['model_seq_id']}"
            self.models[model_id] = {"base_model": data["base_model"], "lora": data.get("lora_config")}
            return self._future(json_response({"model_id": model_id, "type": "create_model"}), model_id)
        if route == "/api/v1/get_info":
            model = self.models[data["model_id"]]
            return json_response(
                {
                    "type": "get_info",
                    "model_id": data["model_id"],
                    "model_data": {"model_name": model["base_model"], "tokenizer_id": model["base_model"]},
                    "is_lora": True,
                    "lora_rank": (model["lora"] or {}).get("rank"),
                    "model_name": model["base_model"],
                }
            )
        if route == "/api/v1/load_weights":
            model_id = data.get("model_id") or f"{data['session_id']}:train:{data['model_seq_id']}"
            source = self.checkpoints.get(data["path"])
            if source is None:
                return self._future(
                    json_response({"error": f"no checkpoint {data['path']}", "category": "user"})
                )
            self.models[model_id] = dict(source)
            return self._future(
                json_response({"type": "load_weights", "path": data["path"], "model_id": model_id}), model_id
            )
        if route == "/api/v1/optim_step":
            return self._once(
                "optim_step",
                f"{data['model_id']}:{data.get('seq_id')}",
                lambda: self._future(json_response({"metrics": {"grad_norm:mean": 0.75}})),
            )
        if route == "/api/v1/save_weights":
            path = f"tinker://{data['model_id']}/weights/{data['path']}"

            def save() -> Response:
                self.checkpoints[path] = self.models[data["model_id"]]
                return self._future(json_response({"path": path, "type": "save_weights"}))

            return self._once("save_state", f"{data['model_id']}:{data.get('seq_id')}", save)
        if route == "/api/v1/save_weights_for_sampler":
            sid = f"samp-{uuid.uuid4().hex[:8]}"
            return self._future(
                json_response({"sampling_session_id": sid, "type": "save_weights_for_sampler"})
            )
        if route == "/api/v1/asample":
            # sampling_client.py asserts the promise names one sequence id per sample.
            ids = [f"seq-{uuid.uuid4().hex[:8]}" for _ in range(int(data["num_samples"]))]
            self.arrived("sample", str(data.get("seq_id")))
            return self.serve("sample", lambda: self._future(self._sample(data), sample_sequence_ids=ids))
        if route == "/api/v1/retrieve_future":
            with self._lock:
                result = self.futures.get(data["request_id"])
            if result is None:
                return json_response({"detail": "unknown future"}, 404)
            return result
        if route == "/api/v1/telemetry" or route.endswith("/finish"):
            return json_response({})
        return json_response({"detail": f"stub: no route {method} {route}"}, 404)

    def _once(self, call: str, key: str, apply: Callable[[], Response]) -> Response:
        """A training request, applied once per ``(model_id, seq_id)``: a re-send gets the first answer."""
        self.arrived(call, key)
        with self._lock:
            known = self.by_seq_id.get(key)
        if known is not None:
            return known

        def apply_and_keep() -> Response:
            answer = apply()
            with self._lock:
                self.by_seq_id[key] = answer
            return answer

        return self.serve(call, apply_and_keep)

    def _forward_backward(self, headers: dict[str, str], body: bytes) -> Response:
        from tinker.proto import tinker_public_pb2 as pb

        if headers.get("content-encoding") == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)
        msg = pb.ForwardBackwardRequest.FromString(body)
        self.record("POST", "/api/v1/forward_backward", headers, msg)
        if headers.get("x-api-key") not in (TINKER_KEY, self.jwt):
            return json_response({"detail": "bad API key"}, 401)
        call = "forward" if msg.forward_only else "forward_backward"
        return self._once(call, f"{msg.model_id}:{msg.seq_id}", lambda: self._apply_forward(msg))

    def _apply_forward(self, msg: Any) -> Response:
        import numpy as np
        from tinker.proto import tinker_public_pb2 as pb

        def tensor(t: Any) -> list[float]:
            dtype = np.float32 if t.dtype == pb.DTYPE_FLOAT32 else np.int64
            return np.frombuffer(t.dense, dtype=dtype).tolist()

        data = []
        for d in msg.data:
            tokens = [
                t for c in d.model_input for t in np.frombuffer(c.encoded_text.tokens, np.int32).tolist()
            ]
            inputs = {k: tensor(v) for k, v in d.loss_fn_inputs.items()}
            data.append(
                LossDatum(
                    tokens=tokens,
                    targets=[int(t) for t in inputs["target_tokens"]],
                    weights=inputs.get("weights"),
                    logprobs=inputs.get("logprobs"),
                    advantages=inputs.get("advantages"),
                )
            )
        config = {k: v.number for k, v in msg.loss_fn_config_v2.items()}
        totals = count_totals(data, msg.loss_fn)
        loss, outputs = server_loss(data, msg.loss_fn, config, self.reduction, totals)
        self.calls.append(SentCall(msg.loss_fn, msg.forward_only, data, config, totals, loss))
        out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
        out.metrics["loss:sum"] = loss
        record = out.loss_fn_outputs.add()
        record.num_datums = len(outputs)
        flat = [x for lps in outputs for x in lps]
        offsets = np.cumsum([0] + [4 * len(lps) for lps in outputs]).astype(np.int64)
        field_ = record.fields["logprobs"]
        field_.data = np.asarray(flat, dtype=np.float32).tobytes()
        field_.offsets = offsets.tobytes()
        field_.dtype = pb.DTYPE_FLOAT32
        return self._future((200, "application/x-protobuf", out.SerializeToString()), msg.model_id)

    def _sample(self, request: dict[str, Any]) -> Response:
        import numpy as np
        from tinker.proto import tinker_public_pb2 as pb

        prompt = [t for c in request["prompt"]["chunks"] for t in c["tokens"]]
        params = request["sampling_params"]
        out = pb.SampleResponse()
        for i in range(int(request["num_samples"])):
            toks = sampled_tokens(prompt, i, int(params["max_tokens"]))
            seq = out.sequences.add()
            seq.stop_reason = pb.STOP_REASON_LENGTH if i % 2 else pb.STOP_REASON_STOP
            seq.tokens = np.asarray(toks, dtype=np.int32).tobytes()
            if self.sample_logprobs:
                seq.logprobs = np.asarray([learner_lp(t) for t in toks], dtype=np.float32).tobytes()
        return 200, "application/x-protobuf", out.SerializeToString()


# -- SkyRL's Tinker API server ----------------------------------------------------------------------

GRAD_DIM = 4


def token_feature(token: int) -> list[float]:
    """The SkyRL stub's gradient model: d learner_lp(t) / d theta for a target token ``t``."""
    return [math.cos(token), math.sin(token), math.cos(2.0 * token + 1.0), (token % 5) / 5.0]


def dloss_dlp(loss_fn: str, lp: float, old: float, adv: float, config: dict[str, float]) -> float:
    """d(per-token loss)/d(learner logprob), unweighted: CE ``-lp``; IS ``-r A``; PPO the clipped min."""
    if loss_fn == "cross_entropy":
        return -1.0
    r = math.exp(lp - old)
    if loss_fn == "importance_sampling":
        return -r * adv
    if loss_fn == "ppo":
        lo, hi = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
        # -min(rA, clip(r)A): the unclipped branch (gradient -rA) when it is the smaller, else a constant.
        return -r * adv if r * adv <= min(max(r, lo), hi) * adv else 0.0
    raise ValueError(f"stub: unsupported loss {loss_fn}")


class SkyrlStub(TinkerStub):
    """SkyRL 0.4.0's Tinker API server (``skyrl/tinker/api.py``, ``skyrl/backends/jax.py``, read from the
    wheel and checked against the real server on this machine), as far as the adapter meets it:

    - Reduction: per sequence ``sum(w * l) / max(sum(w), 1e-9)`` (``loss_mask`` = the datum's ``weights``,
      all ones when none are sent), summed over the call's sequences; the gradients accumulate with a
      count of sequences, and ``optim_step`` applies ``grad_sum / count`` and reports its norm as
      ``skyrl.ai/grad_norm`` (``AccumulatedGradients.get_mean``). ``sequence_power=2`` divides by the
      weight sum squared instead: a reduction the adapter cannot know.
    - The forward pass reports ``metrics == {}`` (no ``loss:sum``); each datum's output carries
      ``logprobs`` and ``elementwise_loss``.
    - The gradient is real arithmetic on a model of four parameters: ``d learner_lp(t) / d theta =
      token_feature(t)``; ``grads`` keeps every applied mean gradient per model.
    - Model ids are the server's (``model_<hex>``); ``create_model`` beyond ``max_adapters`` live models
      fails its future with 400 ``Maximum number of LoRA adapters (N) reached``.
    - ``load_weights`` requires ``model_id`` (422 otherwise: what tinker 0.38's
      ``create_training_client_from_state_with_optimizer`` gets) and must be a model's first request
      (400 ``LoadWeights is not permitted with seq_id N``).
    - ``POST /api/v1/unload_model`` frees a model; ``/api/v1/sessions/{id}/finish`` is a 404.
    """

    def __init__(
        self, *, max_adapters: int = 8, sequence_power: int = 1, model_name: str = "Qwen/Qwen3-4B"
    ) -> None:
        super().__init__(
            "per_sequence_mean", model_name=model_name, client_config={"pjwt_auth_enabled": False}
        )
        self.max_adapters = max_adapters
        self.sequence_power = sequence_power
        self.live: list[str] = []
        self.unloaded: list[str] = []
        self.model_requests: Counter[str] = Counter()
        self.accumulated: dict[str, tuple[list[float], int]] = {}
        self.grads: defaultdict[str, list[list[float]]] = defaultdict(list)
        self.loaded: dict[str, str] = {}  # model_id -> checkpoint path it was loaded from

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        route = urlsplit(path).path
        if route == "/api/v1/forward_backward":
            return super().handle(method, path, headers, body)
        data = json.loads(body) if body else {}
        if route.endswith("/finish"):
            self.record(method, route, headers, data)
            return json_response({"detail": "Not Found"}, 404)
        if route == "/api/v1/create_model":
            self.record(method, route, headers, data)
            with self._lock:
                self._n += 1
                model_id = f"model_{self._n:08x}"
                if len(self.live) >= self.max_adapters:
                    error = f"Maximum number of LoRA adapters ({self.max_adapters}) reached"
                    return self._future(json_response({"detail": error}, 400), model_id)
                self.live.append(model_id)
            self.models[model_id] = {"base_model": data["base_model"], "lora": data.get("lora_config")}
            return self._future(json_response({"model_id": model_id, "type": "create_model"}), model_id)
        if route == "/api/v1/unload_model":
            self.record(method, route, headers, data)
            model_id = data["model_id"]
            if model_id not in self.models:
                return json_response({"detail": "Model not found"}, 404)
            with self._lock:
                if model_id in self.live:
                    self.live.remove(model_id)
                    self.unloaded.append(model_id)
            return json_response({"request_id": "unload", "model_id": model_id})
        if route == "/api/v1/load_weights":
            self.record(method, route, headers, data)
            if "model_id" not in data:
                detail = [{"type": "missing", "loc": ["body", "model_id"], "msg": "Field required"}]
                return json_response({"detail": detail}, 422)
            model_id = data["model_id"]
            if self.model_requests[model_id]:
                seq = data.get("seq_id") or self.model_requests[model_id] + 1
                return json_response({"detail": f"LoadWeights is not permitted with seq_id {seq}"}, 400)
            self.model_requests[model_id] += 1
            if data["path"] not in self.checkpoints:
                return self._future(json_response({"detail": f"checkpoint {data['path']} not found"}, 400))
            self.loaded[model_id] = data["path"]
            return self._future(
                json_response({"type": "load_weights", "path": None, "model_id": None}), model_id
            )
        if route == "/api/v1/optim_step":
            self.record(method, route, headers, data)
            model_id = data["model_id"]
            self.model_requests[model_id] += 1
            lr = float((data.get("adam_params") or {}).get("learning_rate", 0.0))
            return self._once(
                "optim_step", f"{model_id}:{data.get('seq_id')}", lambda: self._optim(model_id, lr)
            )
        if route in ("/api/v1/save_weights", "/api/v1/save_weights_for_sampler"):
            self.model_requests[data["model_id"]] += 1
        return super().handle(method, path, headers, body)

    def _optim(self, model_id: str, lr: float) -> Response:
        with self._lock:
            grad_sum, count = self.accumulated.pop(model_id, ([0.0] * GRAD_DIM, 0))
        mean = [g / max(count, 1) for g in grad_sum]
        self.grads[model_id].append(mean)
        norm = math.sqrt(sum(g * g for g in mean))
        return self._future(
            json_response({"metrics": {"skyrl.ai/grad_norm": norm, "skyrl.ai/learning_rate": lr}})
        )

    def _apply_forward(self, msg: Any) -> Response:
        import numpy as np
        from tinker.proto import tinker_public_pb2 as pb

        self.model_requests[msg.model_id] += 1

        def tensor(t: Any) -> list[float]:
            dtype = np.float32 if t.dtype == pb.DTYPE_FLOAT32 else np.int64
            return np.frombuffer(t.dense, dtype=dtype).tolist()

        config = {k: v.number for k, v in msg.loss_fn_config_v2.items()}
        data, outputs, losses = [], [], []
        grad = [0.0] * GRAD_DIM
        for d in msg.data:
            tokens = [
                t for c in d.model_input for t in np.frombuffer(c.encoded_text.tokens, np.int32).tolist()
            ]
            inputs = {k: tensor(v) for k, v in d.loss_fn_inputs.items()}
            targets = [int(t) for t in inputs["target_tokens"]]
            mask = inputs.get("weights") or [1.0] * len(targets)
            old, adv = inputs.get("logprobs"), inputs.get("advantages")
            data.append(LossDatum(tokens, targets, inputs.get("weights"), old, adv))
            lps = [learner_lp(t) for t in targets]
            denominator = max(sum(mask), 1e-9) ** self.sequence_power
            elementwise = []
            for j, t in enumerate(targets):
                o = old[j] if old else 0.0
                a = adv[j] if adv else 0.0
                if msg.loss_fn == "cross_entropy":
                    token = -lps[j]
                elif msg.loss_fn == "importance_sampling":
                    token = -math.exp(lps[j] - o) * a
                else:
                    lo = float(config.get("clip_low_threshold", 0.8))
                    hi = float(config.get("clip_high_threshold", 1.2))
                    r = math.exp(lps[j] - o)
                    token = -min(r * a, min(max(r, lo), hi) * a)
                elementwise.append(mask[j] * token)
                if not msg.forward_only and mask[j] != 0:
                    slope = mask[j] * dloss_dlp(msg.loss_fn, lps[j], o, a, config) / denominator
                    grad = [g + slope * f for g, f in zip(grad, token_feature(t), strict=True)]
            outputs.append(lps)
            losses.append(elementwise)
        if not msg.forward_only:
            with self._lock:
                grad_sum, count = self.accumulated.get(msg.model_id, ([0.0] * GRAD_DIM, 0))
                self.accumulated[msg.model_id] = (
                    [a + b for a, b in zip(grad_sum, grad, strict=True)],
                    count + len(msg.data),
                )
        totals = count_totals(data, msg.loss_fn)
        self.calls.append(SentCall(msg.loss_fn, msg.forward_only, data, config, totals, math.nan))
        out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")  # metrics: none, as SkyRL's
        record = out.loss_fn_outputs.add()
        record.num_datums = len(outputs)
        for name, values in (("logprobs", outputs), ("elementwise_loss", losses)):
            offsets = np.cumsum([0] + [4 * len(v) for v in values]).astype(np.int64)
            field_ = record.fields[name]
            field_.data = np.asarray([x for v in values for x in v], dtype=np.float32).tobytes()
            field_.offsets = offsets.tobytes()
            field_.dtype = pb.DTYPE_FLOAT32
        return self._future((200, "application/x-protobuf", out.SerializeToString()), msg.model_id)
