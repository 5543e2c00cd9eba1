"""The Tinker REST API (as the ``tinker`` 0.38 SDK speaks it), served from ``ServeState``.

Routes under ``/api/v1``: ``healthz``, ``client/config`` (feature flags: no JWT exchange, no zstd, plain
per-request future polling), ``create_session``, ``session_heartbeat``, ``get_server_capabilities``,
``create_model`` (LoRA rank, seed and train_mlp / train_attn / train_unembed), ``get_info``, ``weights_info``,
``forward_backward`` (protobuf, ``forward_only`` for ``forward``), ``optim_step``, ``save_weights``,
``save_weights_for_sampler``, ``load_weights`` (into a model, or a new model from a checkpoint),
``create_sampling_session``, ``samplers/{id}``, ``asample``, ``retrieve_future``, ``telemetry``,
``sessions/{id}/finish``.

Every training and sampling call answers a future id at once and runs in the background (training calls in
arrival order per model: the SDK submits them one turn at a time, so arrival order is its ``seq_id``
order); ``retrieve_future`` long-polls it and answers 408 ``try_again`` while it runs, the result when done
(protobuf for forward passes and samples when the SDK accepts it), or ``{"error", "category"}``. Requests
are deduplicated by ``(model_id, seq_id)``: a re-sent training call gets the first call's future.

Reduction: Tinker's documented sum over tokens and datums (no normalisation).

How each request body is decoded and each answer encoded (protobuf and JSON): ``retool.serve.tinker_codec``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import AdamParams, Datum
from retool.jsonl import JsonObject
from retool.serve.common import (
    as_json,
    prompt_request,
    read_json_object,
    sampling_params,
    score_prompt,
)
from retool.serve.losses import check_loss, loss_config
from retool.serve.state import ServeError, ServeState, StabilityRecord, TrainingRun
from retool.serve.storage import LoraRequest, StorageError, check_name, new_id
from retool.serve.tinker_codec import (
    PROTO,
    Sampled,
    decode_datum,
    forward_output,
    json_number,
    json_tokens,
    provenance_span,
    sample_response,
    target_cells,
    wire_loss_config,
)

SCHEME = "tinker"
_FUTURE_CACHE = 10_000


class TinkerApi:
    """Routes and per-server bookkeeping (sessions, models, futures, sampling sessions)."""

    def __init__(self, state: ServeState) -> None:
        self.state = state
        self.futures: collections.OrderedDict[str, tuple[str, asyncio.Future[object]]] = (
            collections.OrderedDict()
        )
        self.by_seq: dict[str, str] = {}  # "<model_id>:<seq_id>" -> future id
        # sampling session id -> (checkpoint path, base model, sampler when held in memory)
        self.sampling_sessions: dict[str, tuple[str | None, str, SamplingClient | None]] = {}
        # sampling session id -> the Tinker session that made it (stability records are session-scoped)
        self.sampler_sessions: dict[str, str | None] = {}
        self.router = APIRouter(prefix="/api/v1")
        self._routes()

    def _routes(self) -> None:
        r = self.router
        for path, handler in (
            ("/healthz", self.healthz),
            ("/client/config", self.client_config),
            ("/client/dynamic_config", self.empty),
            ("/telemetry", self.empty),
            ("/create_session", self.create_session),
            ("/session_heartbeat", self.heartbeat),
            ("/sessions/{sid}/finish", self.finish),
            ("/get_server_capabilities", self.capabilities),
            ("/create_model", self.create_model),
            ("/get_info", self.get_info),
            ("/weights_info", self.weights_info),
            ("/forward_backward", self.forward_backward),
            ("/optim_step", self.optim_step),
            ("/save_weights", self.save_weights),
            ("/save_weights_for_sampler", self.save_weights_for_sampler),
            ("/load_weights", self.load_weights),
            ("/create_sampling_session", self.create_sampling_session),
            ("/samplers/{sampler_id}", self.get_sampler),
            ("/asample", self.asample),
            ("/retrieve_future", self.retrieve_future),
        ):
            r.add_api_route(path, handler, methods=["GET", "POST"])

    # -- plumbing --------------------------------------------------------------------------------
    def _future(
        self, kind: str, call: Awaitable[object], model_id: str | None = None, **extra: object
    ) -> Response:
        future = asyncio.ensure_future(call)
        rid = new_id("req")
        self.futures[rid] = (kind, future)
        while len(self.futures) > _FUTURE_CACHE:
            self.futures.popitem(last=False)
        return as_json({"request_id": rid, "model_id": model_id, **extra})

    def _ordered(
        self, run: TrainingRun, seq_id: object, kind: str, call: Callable[[], Awaitable[object]]
    ) -> Response:
        """Queue a training call on its run, once per ``(model_id, seq_id)``."""
        key = f"{run.run_id}:{seq_id}"
        if seq_id is not None and key in self.by_seq and self.by_seq[key] in self.futures:
            return as_json({"request_id": self.by_seq[key], "model_id": run.run_id})
        answer = self._future(kind, run.submit(call), run.run_id)
        if seq_id is not None:
            self.by_seq[key] = json.loads(bytes(answer.body))["request_id"]
        return answer

    @staticmethod
    def _field(
        data: Mapping[str, object], name: str, kind: type | tuple[type, ...], default: object = ...
    ) -> Any:
        value = data.get(name, default)
        if value is ...:
            raise ServeError(400, "invalid_request", f"field {name!r} is required")
        if value is not None and (
            not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
        ):
            raise ServeError(400, "invalid_request", f"field {name!r} has the wrong type")
        return value

    # -- session and model info ------------------------------------------------------------------
    async def healthz(self) -> Response:
        return as_json({"status": "ok"})

    async def client_config(self) -> Response:
        return as_json(
            {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "use_pyqwest_transport": False}
        )

    async def empty(self) -> Response:
        return as_json({})

    async def finish(self, sid: str) -> Response:
        self.state.end_session(sid)
        return as_json({})

    async def create_session(self) -> Response:
        sid = new_id("sess")
        self.state.sessions.add(sid)
        return as_json({"type": "create_session", "session_id": sid})

    async def heartbeat(self, request: Request) -> Response:
        sid = self._field(await read_json_object(request), "session_id", str)
        if sid not in self.state.sessions:
            raise ServeError(404, "unknown_session", f"no session {sid!r} on this server")
        return as_json({"type": "session_heartbeat"})

    async def capabilities(self) -> Response:
        models = [
            {
                "model_name": m.name,
                "max_context_length": min(m.max_context, self.state.config.model.max_context),
                "trainable": True,
                "sampleable": True,
            }
            for m in self.state.models.values()
        ]
        return as_json({"supported_models": models})

    async def create_model(self, request: Request) -> Response:
        data = await read_json_object(request)
        sid = self._field(data, "session_id", str)
        if sid not in self.state.sessions:
            raise ServeError(404, "unknown_session", f"no session {sid!r} on this server")
        cfg = self._field(data, "lora_config", dict, None)
        if cfg is None:
            raise ServeError(400, "invalid_lora", "retool serve trains LoRA adapters only: give lora_config")
        lora = LoraRequest(
            rank=self._field(cfg, "rank", int),
            seed=self._field(cfg, "seed", int, None),
            train_mlp=self._field(cfg, "train_mlp", bool, True),
            train_attn=self._field(cfg, "train_attn", bool, True),
            train_unembed=self._field(cfg, "train_unembed", bool, True),
        )
        run = self.state.create_run(self._field(data, "base_model", str), lora, session=sid)
        model_id = self.state.alias(f"{sid}:train:{self._field(data, 'model_seq_id', int)}", run)

        async def build() -> JsonObject:
            await self.state.client(run)
            return {"model_id": model_id, "type": "create_model"}

        return self._future("create_model", run.submit(build), model_id)

    async def get_info(self, request: Request) -> Response:
        model_id = self._field(await read_json_object(request), "model_id", str)
        run = self.state.run(model_id)
        return as_json(
            {
                "type": "get_info",
                "model_id": model_id,
                "model_data": {
                    "arch": "causal_lm",
                    "model_name": run.model.path,
                    "tokenizer_id": run.model.path,
                },
                "is_lora": True,
                "lora_rank": run.lora.rank,
                "model_name": run.model.path,
            }
        )

    async def weights_info(self, request: Request) -> Response:
        data = await read_json_object(request)
        meta = self.state.checkpoint_meta(
            self._field(data, "tinker_path", str, None) or self._field(data, "path", str)
        )
        return as_json(
            {
                "base_model": meta.base_model,
                "is_lora": True,
                "lora_rank": meta.lora.rank,
                "train_unembed": meta.lora.train_unembed,
                "train_mlp": meta.lora.train_mlp,
                "train_attn": meta.lora.train_attn,
            }
        )

    # -- training --------------------------------------------------------------------------------
    async def forward_backward(self, request: Request) -> Response:
        # deferred: protobuf and the tinker SDK's protocol module are optional (the serve extra)
        from google.protobuf.message import DecodeError
        from tinker.proto import tinker_public_pb2 as pb

        if request.headers.get("content-encoding", "identity") != "identity":
            raise ServeError(
                415, "unsupported_encoding", "compressed bodies are not accepted; client/config says so"
            )
        try:
            msg = pb.ForwardBackwardRequest.FromString(await request.body())
        except DecodeError:
            raise ServeError(
                400, "invalid_request", "the body is not a ForwardBackwardRequest protobuf"
            ) from None
        run = self.state.run(msg.model_id)
        loss_fn = check_loss(msg.loss_fn)
        cfg = loss_config(loss_fn, wire_loss_config(msg))
        datums = []
        for k, d in enumerate(msg.data):
            datum = decode_datum(pb, k, d, loss_fn)
            if loss_fn == "stable_reinforce":
                datum = self._with_stability_info(k, d, datum, run.session)
            datums.append(datum)
        self.state.check_datums(run.model, datums)
        backward = not msg.forward_only

        async def call() -> bytes:
            result = await self.state.forward(run, datums, loss_fn, cfg, backward)
            return forward_output(pb, result.loss, result.token_logprobs or [])

        return self._ordered(run, msg.seq_id, "forward", call)

    def _with_stability_info(self, k: int, wire: Any, datum: Datum, session: str | None) -> Datum:
        """The datum with its sampled positions' logprobs replaced by the recorded ones and every other
        position's weight set to 0, after checking that its provenance tiles it and names recorded
        tokens (see ``retool.serve.state``)."""
        if not len(wire.loss_fn_input_spans):
            raise ServeError(
                400,
                "missing_provenance",
                f"datum {k}: stable_reinforce needs provenance (Datum.with_provenance naming the sampled "
                "sequence_ids) on every datum",
            )
        n = len(datum)
        for field_name, length in (("model_input_spans", n), ("loss_fn_input_spans", n)):
            total = sum(provenance_span(s)[3] for s in getattr(wire, field_name))
            if total != length:
                raise ServeError(
                    400,
                    "invalid_provenance",
                    f"datum {k}: {field_name} cover {total} positions, not {length}",
                )
        logprobs = [0.0] * n
        weights = [0.0] * n
        pos = 0
        for span in wire.loss_fn_input_spans:
            kind, seq_id, offset, length = provenance_span(span)
            record = self.state.stability.get(seq_id, session)
            source = record.tokens if kind == "sampled_tokens" else record.prompt
            if offset + length > len(source):
                raise ServeError(
                    400,
                    "invalid_provenance",
                    f"datum {k}: span [{offset}, {offset + length}) of {seq_id}'s {kind} runs past its "
                    f"{len(source)} tokens",
                )
            if source[offset : offset + length].tolist() != datum.target_tokens[pos : pos + length]:
                raise ServeError(
                    400,
                    "invalid_provenance",
                    f"datum {k}: target tokens {pos}..{pos + length - 1} are not {seq_id}'s recorded {kind}",
                )
            if kind == "sampled_tokens":  # only sampled tokens have stability info; prompt ones are context
                logprobs[pos : pos + length] = record.logprobs[offset : offset + length].tolist()
                weights[pos : pos + length] = datum.weights[pos : pos + length]
            pos += length
        return Datum(
            datum.input_tokens,
            datum.target_tokens,
            logprobs=logprobs,
            advantages=datum.advantages,
            weights=weights,
        )

    async def optim_step(self, request: Request) -> Response:
        data = await read_json_object(request)
        run = self.state.run(self._field(data, "model_id", str))
        p = data.get("adam_params") or data.get("optim_params") or {}
        if not isinstance(p, dict) or p.get("type", "adam") not in ("adam", "adamw"):
            raise ServeError(400, "invalid_request", "only Adam optimizer params are supported")
        try:
            adam = AdamParams(
                json_number(p.get("learning_rate", 1e-4)),
                json_number(p.get("beta1", 0.9)),
                json_number(p.get("beta2", 0.95)),
                json_number(p.get("eps", 1e-12)),
                json_number(p.get("weight_decay", 0.0)),
                json_number(p.get("grad_clip_norm", 0.0)),
            )
        except (TypeError, ValueError):
            raise ServeError(400, "invalid_request", "adam_params must be numbers") from None
        if adam.lr < 0 or not 0 <= adam.beta1 < 1 or not 0 <= adam.beta2 < 1 or adam.eps <= 0:
            raise ServeError(400, "invalid_request", "adam_params: lr >= 0, beta1/beta2 in [0, 1), eps > 0")

        async def call() -> JsonObject:
            result = await self.state.optim_step(run, adam)
            return {"metrics": {"grad_norm:mean": result.grad_norm, "learning_rate:mean": result.lr}}

        return self._ordered(run, data.get("seq_id"), "optim_step", call)

    def _name(self, name: str) -> str:
        try:
            return check_name(name, "checkpoint name")
        except StorageError as exc:
            raise ServeError(400, "invalid_name", str(exc)) from None

    async def save_weights(self, request: Request) -> Response:
        data = await read_json_object(request)
        run = self.state.run(self._field(data, "model_id", str))
        name = self._name(self._field(data, "path", str, None) or new_id("ckpt"))
        overwrite = bool(self._field(data, "overwrite", bool, False))

        async def call() -> JsonObject:
            path = await self.state.save(run, "state", name, SCHEME, overwrite=overwrite)
            return {"path": path, "type": "save_weights"}

        return self._ordered(run, data.get("seq_id"), "save_weights", call)

    async def save_weights_for_sampler(self, request: Request) -> Response:
        data = await read_json_object(request)
        run = self.state.run(self._field(data, "model_id", str))
        name = self._field(data, "path", str, None)
        if name is not None:
            name = self._name(name)

            async def save() -> JsonObject:
                path = await self.state.save(run, "sampler_weights", name, SCHEME)
                return {"path": path, "type": "save_weights_for_sampler"}

            return self._ordered(run, data.get("seq_id"), "save_weights_for_sampler", save)

        async def snapshot() -> JsonObject:  # save_weights_and_get_sampling_client: in memory only
            sid = new_id("samp")
            self.sampling_sessions[sid] = (None, run.model.name, await self.state.frozen_sampler(run))
            self.sampler_sessions[sid] = run.session
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}

        return self._ordered(run, data.get("seq_id"), "save_weights_for_sampler", snapshot)

    async def load_weights(self, request: Request) -> Response:
        data = await read_json_object(request)
        path = self._field(data, "path", str)
        with_optimizer = bool(self._field(data, "optimizer", bool, False))
        meta, _ = self.state.read_checkpoint(path)
        model_id = self._field(data, "model_id", str, None)
        if model_id is not None:
            run = self.state.run(model_id)
        else:  # create_training_client_from_state: a new model whose LoRA settings come from the checkpoint
            sid = self._field(data, "session_id", str)
            if sid not in self.state.sessions:
                raise ServeError(404, "unknown_session", f"no session {sid!r} on this server")
            run = self.state.create_run(meta.base_model, meta.lora, session=sid)
            model_id = self.state.alias(f"{sid}:train:{self._field(data, 'model_seq_id', int)}", run)

        async def call() -> JsonObject:
            await self.state.load_into(run, path, with_optimizer)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return self._ordered(run, data.get("seq_id"), "load_weights", call)

    # -- sampling --------------------------------------------------------------------------------
    async def create_sampling_session(self, request: Request) -> Response:
        data = await read_json_object(request)
        path = self._field(data, "model_path", str, None)
        if path:
            base = self.state.checkpoint_meta(path).base_model
        else:
            base = self.state.model(self._field(data, "base_model", str)).name
        sid = new_id("samp")
        self.sampling_sessions[sid] = (path, base, None)
        self.sampler_sessions[sid] = self._field(data, "session_id", str, None)
        return as_json({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, sampler_id: str) -> Response:
        known = self.sampling_sessions.get(sampler_id)
        if known is None:
            raise ServeError(404, "unknown_sampler", f"no sampling session {sampler_id!r}")
        return as_json(
            {"sampler_id": sampler_id, "base_model": self.state.model(known[1]).path, "model_path": known[0]}
        )

    async def asample(self, request: Request) -> Response:
        t0 = time.perf_counter()
        data = await read_json_object(request)
        if data.get("topk_sample_logprobs") or data.get("prompt_alt_tokens_k"):
            raise ServeError(
                400,
                "unsupported",
                "topk_sample_logprobs and prompt_alt_tokens_k are not supported by retool serve (prompt "
                "logprobs, top-k prompt logprobs and target_prompt_logprobs are)",
            )
        sid = self._field(data, "sampling_session_id", str, None)
        if sid is not None:
            if sid not in self.sampling_sessions:
                raise ServeError(404, "unknown_sampler", f"no sampling session {sid!r}")
            path, base, sampler = self.sampling_sessions[sid]
        else:
            path, base, sampler = (
                self._field(data, "model_path", str, None),
                self._field(data, "base_model", str, None),
                None,
            )
        prompt = json_tokens(data.get("prompt"))
        raw_params = self._field(data, "sampling_params", dict)
        params = sampling_params(raw_params)
        n = self._field(data, "num_samples", int, 1)
        if sampler is None:
            sampler, served = await self.state.sampler(path, base)
        else:
            served = self.state.model(base)
        self.state.check_sample(served, prompt, n, params)
        target = target_cells(data.get("target_prompt_logprobs"), len(prompt))
        asked = prompt_request(
            len(prompt),
            data.get("prompt_logprobs"),
            data.get("topk_prompt_logprobs", 0),
            data.get("prompt_logprobs_last_n"),
            None if target is None else target[0],
            None if target is None else target[1],
            served.vocab_size,
        )

        ids = [new_id("seq") for _ in range(n)]
        record = bool(data.get("record_stability_info"))
        session = self.sampler_sessions.get(sid) if sid is not None else None

        async def call() -> Sampled:
            samples = await self.state.sample(sampler, prompt, n, params)
            if record:
                shared_prompt = np.asarray(prompt, dtype=np.int32)
                for seq_id, s in zip(ids, samples, strict=True):
                    tokens = np.asarray(s.tokens, dtype=np.int32)
                    lps = np.asarray(s.logprobs, dtype=np.float32)
                    self.state.stability.add(seq_id, StabilityRecord(session, shared_prompt, tokens, lps))
            scored = None
            if asked.wanted:
                scored = score_prompt(await self.state.prompt_scores(sampler, prompt), prompt, asked)
            return Sampled(samples, scored, None if target is None else target[2])

        answer = self._future("sample", call(), None, sample_sequence_ids=ids)
        self.state.timers.add("validate", time.perf_counter() - t0)
        return answer

    async def retrieve_future(self, request: Request) -> Response:
        rid = self._field(await read_json_object(request), "request_id", str)
        known = self.futures.get(rid)
        if known is None:
            raise ServeError(404, "unknown_future", f"no future {rid!r} on this server")
        kind, future = known
        if not future.done():
            await asyncio.wait([future], timeout=self.state.limits.max_wait_seconds)
        if not future.done():
            body = {"type": "try_again", "request_id": rid, "queue_state": "active"}
            return Response(json.dumps(body).encode(), status_code=408, media_type="application/json")
        exc = future.exception()
        if exc is not None:
            user = isinstance(exc, ServeError) and exc.status < 500
            message = exc.message if isinstance(exc, ServeError) else f"{type(exc).__name__}: {exc}"
            return as_json({"error": message, "category": "user" if user else "server"})
        result = future.result()
        if kind == "sample" and isinstance(result, Sampled):
            t0 = time.perf_counter()
            response = sample_response(result, PROTO in request.headers.get("accept", ""))
            self.state.timers.add("serialize", time.perf_counter() - t0)
            return response
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return as_json(result)
