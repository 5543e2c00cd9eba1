"""The PyTRIO wire API (as the ``pytrio`` 0.2.9 SDK speaks it), served from ``ServeState``.

PyTRIO splits its API in two, and this server answers both at one address:

- Control (JSON under ``/api``): API-key check, SDK bootstrap, model catalogue (``/api/models``), service
  sessions, training runs (create; PATCH binds a checkpoint before init), sampling runs, checkpoint lookup,
  renew / close. Each run's answer names the "actor" to talk to next: this same server.
- Actor (under ``/v1``): ``POST /v1/events`` takes a msgpack event envelope (``trainer.init_run``,
  ``trainer.forward``, ``trainer.forward_backward``, ``trainer.optimize_step``, ``trainer.save_state``,
  ``trainer.save_weights``), answers ``accepted`` at once and queues it on its run in arrival order;
  ``GET /v1/events/{id}`` long-polls it (``Prefer: wait=N``). The event id is the idempotency key: a repeat is
  answered 409 ``event_exists``, as the SDK expects. ``POST /v1/sampling-runs/{id}/sample`` samples (JSON).

Payloads are validated with the SDK's own protocol models (``pytrio.protocol``), so a body the SDK could not
have produced is a 4xx naming the field. Reduction: the loss is divided by the batch's
``total_active_tokens`` (dro: ``total_advantage_tokens``; see ``retool.serve.losses``); ``loss_sum`` reports
that normalised objective. Losses: PyTRIO 0.2.9's five (cross_entropy, importance_sampling, ppo, cispo, dro).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import re
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TypeAlias, TypeVar

import msgpack
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError

from retool.backends.interface.types import AdamParams
from retool.jsonl import JsonObject
from retool.serve.common import (
    as_json,
    build_datum,
    prompt_request,
    read_json_object,
    sampling_params,
    score_prompt,
)
from retool.serve.losses import check_loss, loss_config
from retool.serve.state import ServeError, ServeState, TrainingRun
from retool.serve.storage import LoraRequest, StorageError, check_name, new_id

SCHEME = "trio"
# PyTRIO 0.2.9's losses (pytrio/client/training_batch.py); gspo and stable_reinforce need inputs its datums
# cannot carry (a sequence ratio mask, provenance).
PYTRIO_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
_EVENT_CACHE = 10_000

ModelT = TypeVar("ModelT", bound=BaseModel)
# A validated event, applied when run; its result is packed with msgpack (bytes included).
_EventCall: TypeAlias = Callable[[], Awaitable[dict[str, object]]]


def _now(delta_days: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(days=delta_days)).isoformat().replace("+00:00", "Z")


def actor_token(api_key: str | None) -> str:
    """The actor JWT handed out by control: derived from the API key, so it survives a restart."""
    secret = (api_key or "retool-serve").encode()
    return "rts-" + hmac.new(secret, b"pytrio-actor", hashlib.sha256).hexdigest()


def error_json(status: int, code: str, message: str) -> Response:
    body = json.dumps({"code": code, "message": message}).encode()
    return Response(body, status_code=status, media_type="application/json")


def _validated(model: type[ModelT], data: object) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ServeError(400, "invalid_request", f"{where}: {first.get('msg')}") from None


class PytrioApi:
    """Routes and per-server bookkeeping (sessions, runs' model names, events, sampling runs)."""

    def __init__(self, state: ServeState, api_key: str | None) -> None:
        self.state = state
        self.api_key = api_key
        self.sampling_runs: dict[str, tuple[str | None, str | None]] = {}  # id -> (model path, base model)
        self.events: collections.OrderedDict[str, tuple[str, asyncio.Future[dict[str, object]]]] = (
            collections.OrderedDict()
        )
        self.router = APIRouter()
        self._routes()

    # -- shared pieces of control answers -------------------------------------------------------
    def _actor(self, request: Request) -> JsonObject:
        endpoint = str(request.base_url).rstrip("/")
        return {
            "actor": {
                "actor_cuid": "retool-serve",
                "endpoint": endpoint,
                "connect_mode": "direct",
                "tls_enabled": False,
            },
            "actor_jwt": {"token": actor_token(self.api_key), "expires_at": _now(365)},
        }

    def _capacity(self, model_name: str) -> JsonObject:
        served = self.state.model(model_name)
        context = min(served.max_context, self.state.config.model.max_context)
        return {
            "max_batch_size": self.state.limits.max_datums,
            "max_tokens_per_request": context,
            "max_seq_len": context,
        }

    def _routes(self) -> None:
        r = self.router
        r.add_api_route("/api/openapi/v1/api-key/verify", self.verify, methods=["GET"])
        r.add_api_route("/api/sdk/bootstrap", self.bootstrap, methods=["GET"])
        r.add_api_route("/api/models", self.models, methods=["GET"])
        r.add_api_route("/api/openapi/v1/service-sessions", self.create_session, methods=["POST"])
        r.add_api_route(
            "/api/openapi/v1/service-sessions/{sid}/training-runs", self.create_training_run, methods=["POST"]
        )
        r.add_api_route(
            "/api/openapi/v1/service-sessions/{sid}/training-runs/{rid}",
            self.bind_checkpoint,
            methods=["PATCH"],
        )
        r.add_api_route(
            "/api/openapi/v1/service-sessions/{sid}/sampling-runs", self.create_sampling_run, methods=["POST"]
        )
        r.add_api_route(
            "/api/openapi/v1/training-runs/by-checkpoint-uri", self.find_by_checkpoint, methods=["GET"]
        )
        r.add_api_route("/api/telemetry/event", self.nothing, methods=["POST"])
        r.add_api_route("/api/openapi/v1/{rest:path}", self.renew_or_close, methods=["POST"])
        r.add_api_route("/v1/client/heartbeat", self.heartbeat, methods=["POST"])
        r.add_api_route("/v1/events", self.submit_event, methods=["POST"])
        r.add_api_route("/v1/events/{event_id}", self.get_event, methods=["GET"])
        r.add_api_route("/v1/sampling-runs/{srid}/sample", self.sample, methods=["POST"])

    # -- control ---------------------------------------------------------------------------------
    async def verify(self) -> Response:
        return as_json(
            {
                "api_key_tid": "local",
                "api_key_name": "retool serve",
                "user_cuid": "local-user",
                "username": "local",
                "display_name": None,
                "workspace_cuid": "local",
                "workspace_name": "retool serve",
                "workspace_type": "personal",
                "expires_at": None,
            }
        )

    async def bootstrap(self) -> Response:
        return as_json({"compatibility": {"status": "compatible", "sdk_version": "0.2.9"}, "notices": []})

    async def models(self) -> Response:
        items = []
        for served in self.state.models.values():
            cap = self._capacity(served.name)
            items.append(
                {
                    "cuid": served.name,
                    "alias": served.name,
                    "model_id": served.path,
                    "context_length": cap["max_seq_len"],
                    "train_available": True,
                    "sample_available": True,
                    "trainer": cap,
                    "sampler": cap,
                    "created_at": _now(),
                    "updated_at": _now(),
                }
            )
        return as_json({"items": items, "total": len(items), "limit": len(items), "offset": 0})

    async def create_session(self) -> Response:
        sid = new_id("ss")
        self.state.sessions.add(sid)
        return as_json(
            {"service_session_cuid": sid, "workspace_cuid": "local", "status": "ACTIVE", "created_at": _now()}
        )

    def _check_session(self, sid: str) -> None:
        if sid not in self.state.sessions:
            raise ServeError(404, "unknown_session", f"no service session {sid!r} on this server")

    async def create_training_run(self, sid: str, request: Request) -> Response:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.control.training_run.create import TrainingRunCreateRequest

        self._check_session(sid)
        body = _validated(TrainingRunCreateRequest, await read_json_object(request))
        lora = LoraRequest(body.lora_rank, body.seed, body.train_mlp, body.train_attn, body.train_unembed)
        base_model = body.base_model
        if body.source_checkpoint_uri:  # from a saved state: the SDK may leave the base model to us
            base_model = base_model or self.state.checkpoint_meta(body.source_checkpoint_uri).base_model
        run = self.state.create_run(base_model, lora, session=sid)
        if body.source_checkpoint_uri:
            run.restore = (body.source_checkpoint_uri, body.restore_optimizer)
        return as_json(
            {
                "training_run_cuid": run.run_id,
                "service_session_cuid": sid,
                "workspace_cuid": "local",
                "status": "PENDING",
                "run_index": len(self.state.runs),
                "model_spec_cuid": run.model.name,
                "model_alias": run.model.name,
                "model_id": run.model.path,
                "trainer": self._capacity(run.model.name),
                "created_at": _now(),
                **self._actor(request),
            }
        )

    async def bind_checkpoint(self, sid: str, rid: str, request: Request) -> Response:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.control.training_run.update import TrainingRunUpdateRequest

        self._check_session(sid)
        run = self.state.run(rid)
        body = _validated(TrainingRunUpdateRequest, await read_json_object(request))
        if run.client is not None:
            raise ServeError(409, "run_started", "a checkpoint can be bound only before the run's first call")
        self.state.read_checkpoint(body.source_checkpoint_uri)
        run.restore = (body.source_checkpoint_uri, body.restore_optimizer)
        return as_json(
            {
                "source_checkpoint_uri": body.source_checkpoint_uri,
                "restore_optimizer": body.restore_optimizer,
                "trainer": self._capacity(run.model.name),
                **self._actor(request),
            }
        )

    async def create_sampling_run(self, sid: str, request: Request) -> Response:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.control.sampling_run.create import SamplingRunCreateRequest

        self._check_session(sid)
        body = _validated(SamplingRunCreateRequest, await read_json_object(request))
        if body.source_checkpoint_uri:
            served = self.state.model(self.state.checkpoint_meta(body.source_checkpoint_uri).base_model)
        else:
            served = self.state.model(body.base_model)
        srid = new_id("sr")
        self.sampling_runs[srid] = (body.source_checkpoint_uri or None, served.name)
        return as_json(
            {
                "sampling_run_cuid": srid,
                "service_session_cuid": sid,
                "workspace_cuid": "local",
                "status": "RUNNING",
                "run_index": len(self.sampling_runs),
                "model_spec_cuid": served.name,
                "model_alias": served.name,
                "model_id": served.path,
                "sampler": self._capacity(served.name),
                "created_at": _now(),
                **self._actor(request),
            }
        )

    async def find_by_checkpoint(self, checkpoint_uri: str) -> Response:
        meta = self.state.checkpoint_meta(checkpoint_uri)
        lora = meta.lora
        return as_json(
            {
                "base_model": meta.base_model,
                "lora_rank": lora.rank,
                "seed": lora.seed,
                "train_mlp": lora.train_mlp,
                "train_attn": lora.train_attn,
                "train_unembed": lora.train_unembed,
            }
        )

    async def nothing(self) -> Response:
        return as_json({})

    async def renew_or_close(self, rest: str) -> Response:
        if rest.rsplit("/", 1)[-1] not in ("renew", "close"):
            raise ServeError(404, "not_found", f"no route POST /api/openapi/v1/{rest}")
        parts = rest.split("/")
        if parts[0] == "service-sessions" and parts[-1] == "close" and len(parts) == 3:
            self.state.end_session(parts[1])
        return as_json({"expires_at": _now(1)})

    # -- actor -----------------------------------------------------------------------------------
    async def heartbeat(self) -> Response:
        return as_json({"heartbeat_ms": 60_000})

    async def submit_event(self, request: Request) -> Response:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.actor.events.event import EventEnvelope

        try:
            raw = msgpack.unpackb(await request.body(), raw=False)
        except Exception:  # msgpack raises several unrelated types on bad input
            raise ServeError(400, "invalid_request", "the body is not a msgpack map") from None
        envelope = _validated(EventEnvelope, raw)
        if envelope.event_id in self.events:
            return error_json(409, "event_exists", f"event {envelope.event_id} exists")
        run = self.state.run(envelope.metadata.run_id)
        call = self._event_call(run, envelope.type.value, envelope.payload)
        self.events[envelope.event_id] = (envelope.type.value, run.submit(call))
        while len(self.events) > _EVENT_CACHE:
            self.events.popitem(last=False)
        reply = {
            "version": 1,
            "event_id": envelope.event_id,
            "type": envelope.type.value,
            "status": "accepted",
        }
        return Response(msgpack.packb(reply, use_bin_type=True), media_type="application/msgpack")

    async def get_event(self, event_id: str, request: Request) -> Response:
        known = self.events.get(event_id)
        if known is None:
            raise ServeError(404, "event_not_found", f"no event {event_id!r} on this server")
        kind, future = known
        match = re.search(r"wait=(\d+)", request.headers.get("prefer", ""))
        wait = min(float(match.group(1)) if match else 0.0, self.state.limits.max_wait_seconds)
        if not future.done() and wait > 0:
            await asyncio.wait([future], timeout=wait)
        reply: dict[str, object] = {"version": 1, "event_id": event_id, "type": kind}
        usage = {"input_tokens": 0, "output_tokens": 0}
        if not future.done():
            reply["status"] = "running"
        elif future.exception() is not None:
            exc = future.exception()
            code = exc.code if isinstance(exc, ServeError) else type(exc).__name__
            message = exc.message if isinstance(exc, ServeError) else str(exc)
            reply.update(status="failed", error={"code": code, "message": message}, usage=usage)
        else:
            reply.update(status="succeeded", result=future.result(), usage=usage)
        return Response(msgpack.packb(reply, use_bin_type=True), media_type="application/msgpack")

    def _event_call(self, run: TrainingRun, kind: str, payload: JsonObject) -> _EventCall:
        """Validate an event now (a bad one is a 4xx at submission) and return the call that applies it."""
        if kind == "trainer.init_run":
            return self._init_run(run, payload)
        if kind in ("trainer.forward", "trainer.forward_backward"):
            return self._forward(run, payload, backward=kind == "trainer.forward_backward")
        if kind == "trainer.optimize_step":
            return self._optim_step(run, payload)
        if kind in ("trainer.save_state", "trainer.save_weights"):
            return self._save(run, payload, "state" if kind == "trainer.save_state" else "sampler_weights")
        raise ServeError(400, "unsupported_event", f"event type {kind!r} is not supported by retool serve")

    def _init_run(self, run: TrainingRun, payload: JsonObject) -> _EventCall:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.actor.events.trainer.init_run import TrainerInitRunPayload

        body = _validated(TrainerInitRunPayload, payload)
        if body.checkpoint_uri:
            self.state.read_checkpoint(body.checkpoint_uri)
            run.restore = (body.checkpoint_uri, body.load_optimizer)

        async def call() -> dict[str, object]:
            await self.state.client(run)
            return {}

        return call

    def _forward(self, run: TrainingRun, payload: JsonObject, backward: bool) -> _EventCall:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.actor.events.trainer.forward import TrainerForwardBackwardPayload

        body = _validated(TrainerForwardBackwardPayload, payload)
        loss_fn = check_loss(body.loss.type)
        if loss_fn not in PYTRIO_LOSSES:
            raise ServeError(
                400,
                "unsupported_loss",
                f"loss {loss_fn!r} is Tinker's; PyTRIO's are {', '.join(PYTRIO_LOSSES)}",
            )
        cfg = loss_config(loss_fn, body.loss.config)
        totals = body.gradient_accumulation
        # dro's denominator is the advantage-token count (the SDK counts it for that: training_batch.py)
        denominator = totals.total_advantage_tokens if loss_fn == "dro" else totals.total_active_tokens
        scale = 1.0 / max(denominator, 1)
        datums = []
        for k, d in enumerate(body.data):
            tokens = [t for chunk in d.model_input.chunks for t in getattr(chunk, "tokens", [])]
            targets = list(d.target_ids)
            arrays: dict[str, Sequence[float] | None] = {
                "weights": d.weights,
                "logprobs": d.logprobs,
                "advantages": d.advantages,
            }
            if (
                body.auto_shift
            ):  # the trainer drops each sample's first label (pytrio/client/training_batch.py)
                tokens, targets = tokens[:-1], targets[1:]
                arrays = {key: None if v is None else v[1:] for key, v in arrays.items()}
            datums.append(build_datum(k, tokens, targets, arrays, loss_fn, scale))
        self.state.check_datums(run.model, datums)

        async def call() -> dict[str, object]:
            result = await self.state.forward(run, datums, loss_fn, cfg, backward)
            outputs = [
                {
                    "logprobs": {
                        "dtype": "<f4",
                        "shape": [len(lps)],
                        "encoding": "raw_le",
                        "data": struct.pack(f"<{len(lps)}f", *lps),
                    }
                }
                for lps in (result.token_logprobs or [])
            ]
            count = sum(1 for d in datums for w in d.weights if w != 0.0)
            metrics = {
                "loss_sum": result.loss,
                "loss_mean": result.loss / max(count, 1),
                "token_count": count,
            }
            return {"loss_fn_outputs": outputs, "metrics": metrics}

        return call

    def _optim_step(self, run: TrainingRun, payload: JsonObject) -> _EventCall:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.actor.events.trainer.optimize_step import TrainerOptimizeStepPayload

        p = _validated(TrainerOptimizeStepPayload, payload).adam_params
        if p.learning_rate < 0 or not 0 <= p.beta1 < 1 or not 0 <= p.beta2 < 1 or p.eps <= 0:
            raise ServeError(400, "invalid_request", "adam_params: lr >= 0, beta1/beta2 in [0, 1), eps > 0")
        adam = AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)

        async def call() -> dict[str, object]:
            result = await self.state.optim_step(run, adam)
            return {"metrics": {"grad_norm": result.grad_norm, "learning_rate": result.lr}}

        return call

    def _save(self, run: TrainingRun, payload: JsonObject, kind: str) -> _EventCall:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.actor.events.trainer.save import TrainerSavePayload

        body = _validated(TrainerSavePayload, payload)
        try:
            name = check_name(body.name, "checkpoint name")
        except StorageError as exc:
            raise ServeError(400, "invalid_name", str(exc)) from None

        temporary = kind == "sampler_weights" and body.visibility == "TEMPORARY"

        async def call() -> dict[str, object]:
            if temporary:  # save_weights_and_get_sampling_client: a sampler in memory, nothing on disk
                uri = await self.state.snapshot(run, name, SCHEME)
            else:
                overwrite = body.overwrite or kind == "sampler_weights"
                uri = await self.state.save(run, kind, name, SCHEME, overwrite=overwrite)
            return {"checkpoint": {"uri": uri, "model_id": run.model.path, "size_bytes": 0}}

        return call

    async def sample(self, srid: str, request: Request) -> Response:
        # deferred: the pytrio SDK is optional (the serve extra)
        from pytrio.protocol.actor.sampling_run.sample import SampleRequest

        t0 = time.perf_counter()
        if srid not in self.sampling_runs:
            raise ServeError(404, "unknown_sampling_run", f"no sampling run {srid!r} on this server")
        body = _validated(SampleRequest, await read_json_object(request))
        model_path, base_model = self.sampling_runs[srid]
        prompt = [t for chunk in body.prompt.chunks for t in getattr(chunk, "tokens", [])]
        params = sampling_params(body.sampling_params)
        sampler, served = await self.state.sampler(model_path, base_model)
        self.state.check_sample(served, prompt, body.num_samples, params)
        asked = prompt_request(len(prompt), body.return_prompt_logprobs, body.topk_prompt_logprobs)
        self.state.timers.add("validate", time.perf_counter() - t0)
        samples = await self.state.sample(sampler, prompt, body.num_samples, params)
        scored = None
        if asked.wanted:
            scored = score_prompt(await self.state.prompt_scores(sampler, prompt), prompt, asked)
        t1 = time.perf_counter()
        tokenizer = getattr(sampler, "tokenizer", None)
        sequences = [
            {
                "tokens": s.tokens,
                "text": tokenizer.decode(s.tokens) if body.return_text and tokenizer is not None else None,
                "logprobs": s.logprobs if body.return_token_logprobs else [],
                "stop_reason": s.stop_reason,
            }
            for s in samples
        ]
        usage = {
            "input_tokens": len(prompt) * body.num_samples,
            "output_tokens": sum(len(s.tokens) for s in samples),
        }
        answer: dict[str, object] = {
            "request_id": body.request_id,
            "sampling_run": srid,
            "sequences": sequences,
            "usage": usage,
        }
        if scored is not None:
            answer["prompt_logprobs"] = scored.logprobs
            answer["topk_prompt_logprobs"] = scored.topk
        response = as_json(answer)
        self.state.timers.add("serialize", time.perf_counter() - t1)
        return response
