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

One thing: the Tinker wire protocol, route by route (each decodes the SDK's request and encodes its
answer in the SDK's own formats), over the session, future and dedupe tables of one ``TinkerApi``; so
it stays in one file past 700 lines.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np
from fastapi import APIRouter, Request, Response

from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import AdamParams, Datum, Sample
from retool.jsonl import JsonObject, JsonValue
from retool.serve.common import (
    PromptScores,
    build_datum,
    prompt_request,
    read_json_object,
    sampling_params,
    score_prompt,
)
from retool.serve.losses import check_loss, loss_config
from retool.serve.pytrio_api import as_json
from retool.serve.state import ServeError, ServeState, StabilityRecord, TrainingRun
from retool.serve.storage import LoraRequest, StorageError, check_name, new_id

SCHEME = "tinker"
_FUTURE_CACHE = 10_000
PROTO = "application/x-protobuf"


class _WireTensor(Protocol):
    """The fields of a ``TensorData`` protobuf read here."""

    dtype: int
    dense: bytes

    def WhichOneof(self, group: str) -> str | None: ...


class _EncodedText(Protocol):
    tokens: bytes


class _WireChunk(Protocol):
    """The fields of a ``ModelInputChunk`` protobuf read here."""

    encoded_text: _EncodedText

    def WhichOneof(self, group: str) -> str | None: ...


def _tensor(pb: ModuleType, t: _WireTensor) -> list[float]:
    if t.WhichOneof("encoding") != "dense":
        raise ServeError(400, "invalid_request", "only dense loss_fn_inputs tensors are supported")
    kinds = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if t.dtype not in kinds:
        raise ServeError(400, "invalid_request", f"tensor dtype {t.dtype} is not supported")
    try:
        return np.frombuffer(t.dense, dtype=kinds[t.dtype]).tolist()
    except ValueError as exc:
        raise ServeError(400, "invalid_request", f"bad tensor bytes: {exc}") from None


def _number(value: JsonValue) -> float:
    """``float(value)`` for a JSON number (or numeric string); anything else: ``TypeError``."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"not a number: {value!r}")


def _chunk_tokens(chunks: Iterable[_WireChunk]) -> list[int]:
    tokens: list[int] = []
    for c in chunks:
        if c.WhichOneof("chunk") != "encoded_text":
            raise ServeError(400, "invalid_request", "only encoded_text chunks are supported (no images)")
        if len(c.encoded_text.tokens) % 4:
            raise ServeError(400, "invalid_request", "encoded_text tokens are not int32 bytes")
        tokens += np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist()
    return tokens


def _json_tokens(prompt: object) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise ServeError(400, "invalid_request", "prompt must be {'chunks': [...]}")
    tokens: list[int] = []
    for c in prompt["chunks"]:
        if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
            raise ServeError(400, "invalid_request", "only encoded_text prompt chunks are supported")
        toks = c.get("tokens")
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise ServeError(400, "invalid_request", "prompt chunk tokens must be a list of integers")
        tokens += toks
    return tokens


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
        raw_cfg: dict[str, object] = {}
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise ServeError(400, "invalid_loss_config", f"loss config {key} must be a number")
            raw_cfg[key] = value.number
        cfg = loss_config(loss_fn, raw_cfg or dict(msg.loss_fn_config.items()))
        run_session = run.session
        datums = []
        for k, d in enumerate(msg.data):
            inputs: dict[str, list[float]] = {name: _tensor(pb, t) for name, t in d.loss_fn_inputs.items()}
            unknown = set(inputs) - {
                "target_tokens",
                "weights",
                "logprobs",
                "advantages",
                "sequence_ratio_mask",
            }
            if unknown or "target_tokens" not in inputs:
                raise ServeError(
                    400,
                    "invalid_request",
                    f"datum {k}: loss_fn_inputs {sorted(inputs)}; need target_tokens, and only weights, "
                    "logprobs, advantages and sequence_ratio_mask besides",
                )
            targets = [int(t) for t in inputs.pop("target_tokens")]
            tokens = _chunk_tokens(d.model_input)
            datum = build_datum(k, tokens, targets, inputs, loss_fn, 1.0)
            if loss_fn == "stable_reinforce":
                datum = self._with_stability_info(k, d, datum, run_session)
            datums.append(datum)
        self.state.check_datums(run.model, datums)
        backward = not msg.forward_only

        async def call() -> bytes:
            result = await self.state.forward(run, datums, loss_fn, cfg, backward)
            return _forward_output(pb, result.loss, result.token_logprobs or [])

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
            total = sum(_span(s)[3] for s in getattr(wire, field_name))
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
            kind, seq_id, offset, length = _span(span)
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
                _number(p.get("learning_rate", 1e-4)),
                _number(p.get("beta1", 0.9)),
                _number(p.get("beta2", 0.95)),
                _number(p.get("eps", 1e-12)),
                _number(p.get("weight_decay", 0.0)),
                _number(p.get("grad_clip_norm", 0.0)),
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
        prompt = _json_tokens(data.get("prompt"))
        raw_params = self._field(data, "sampling_params", dict)
        params = sampling_params(raw_params)
        n = self._field(data, "num_samples", int, 1)
        if sampler is None:
            sampler, served = await self.state.sampler(path, base)
        else:
            served = self.state.model(base)
        self.state.check_sample(served, prompt, n, params)
        target = _target_cells(data.get("target_prompt_logprobs"), len(prompt))
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

        async def call() -> _Sampled:
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
            return _Sampled(samples, scored, None if target is None else target[2])

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
        if kind == "sample" and isinstance(result, _Sampled):
            t0 = time.perf_counter()
            response = _sample_response(result, PROTO in request.headers.get("accept", ""))
            self.state.timers.add("serialize", time.perf_counter() - t0)
            return response
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return as_json(result)


def _span(span: Any) -> tuple[str, str, int, int]:
    """``(kind, sequence_id, offset, length)`` of a ``ProvenanceSpan`` protobuf."""
    kind = span.WhichOneof("span")
    if kind not in ("prompt_tokens", "sampled_tokens"):
        raise ServeError(400, "invalid_provenance", "a provenance span is neither prompt nor sampled tokens")
    body = getattr(span, kind)
    if body.offset < 0 or body.length < 0 or not body.sequence_id:
        raise ServeError(
            400, "invalid_provenance", "provenance spans need a sequence_id, offset >= 0, length >= 0"
        )
    return kind, str(body.sequence_id), int(body.offset), int(body.length)


def _forward_output(pb: ModuleType, loss: float, logprobs: list[list[float]]) -> bytes:
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics["loss:sum"] = loss
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field = record.fields["logprobs"]
    field.data = np.asarray([x for lps in logprobs for x in lps], dtype=np.float32).tobytes()
    field.offsets = np.cumsum([0] + [4 * len(lps) for lps in logprobs]).astype(np.int64).tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    return bytes(out.SerializeToString())


@dataclass
class _Sampled:
    """A finished sample request: its samples and what it asked about its prompt."""

    samples: list[Sample]
    prompt: PromptScores | None
    target_layout: _TargetLayout | None


@dataclass(frozen=True)
class _TargetLayout:
    """How ``target_prompt_logprobs`` was laid out, so the answer comes back the same way."""

    shape: list[int]
    crow: list[int] | None = None
    col: list[int] | None = None


def _target_cells(raw: object, n_prompt: int) -> tuple[list[int], list[int], _TargetLayout] | None:
    """``target_prompt_logprobs`` (an int64 ``[len(prompt) - 1, K]`` tensor, dense or CSR) as flat ids, the
    prompt row each one is scored at, and its layout; ``None`` when not asked."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("dtype") != "int64":
        raise ServeError(400, "invalid_request", "target_prompt_logprobs must be an int64 tensor")
    shape, data = raw.get("shape"), raw.get("data")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or shape[0] != n_prompt - 1
        or not isinstance(data, list)
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in [*shape, *data])
    ):
        raise ServeError(
            400,
            "invalid_request",
            f"target_prompt_logprobs must have shape [len(prompt) - 1 = {n_prompt - 1}, K]",
        )
    rows_n, k = int(shape[0]), int(shape[1])
    crow, col = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if crow is None and col is None:
        if len(data) != rows_n * k:
            raise ServeError(
                400, "invalid_request", f"target_prompt_logprobs has {len(data)} values, not {rows_n * k}"
            )
        return list(data), [j // k for j in range(len(data))] if k else [], _TargetLayout([rows_n, k])
    ok = (
        isinstance(crow, list)
        and isinstance(col, list)
        and len(crow) == rows_n + 1
        and len(col) == len(data)
        and crow[0] == 0
        and crow[-1] == len(data)
        and all(a <= b for a, b in itertools.pairwise(crow))
        and all(isinstance(c, int) and 0 <= c < k for c in col)
    )
    if not ok or not isinstance(crow, list) or not isinstance(col, list):
        raise ServeError(400, "invalid_request", "target_prompt_logprobs: malformed sparse CSR indices")
    rows = [r for r in range(rows_n) for _ in range(crow[r + 1] - crow[r])]
    return list(data), rows, _TargetLayout([rows_n, k], list(crow), list(col))


def _sample_response(result: _Sampled, proto: bool) -> Response:
    samples, scored, layout = result.samples, result.prompt, result.target_layout
    if not proto:
        seqs = [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason} for s in samples]
        body: dict[str, object] = {"type": "sample", "sequences": seqs}
        if scored is not None:
            if scored.logprobs is not None:
                body["prompt_logprobs"] = scored.logprobs
            if scored.topk is not None:
                body["topk_prompt_logprobs"] = [
                    None if r is None else [list(c) for c in r] for r in scored.topk
                ]
            if scored.target is not None and layout is not None:
                tensor: dict[str, object] = {"data": scored.target, "dtype": "float32", "shape": layout.shape}
                if layout.crow is not None:
                    tensor.update(sparse_crow_indices=layout.crow, sparse_col_indices=layout.col)
                body["target_prompt_logprobs"] = tensor
        return as_json(body)
    from tinker.proto import tinker_public_pb2 as pb  # deferred: the tinker SDK is optional (serve extra)

    out = pb.SampleResponse()
    for s in samples:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if scored is not None:
        if scored.logprobs is not None:  # NaN where not scored, as the SDK reads it
            values = [math.nan if v is None else v for v in scored.logprobs]
            out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
        if scored.topk is not None:
            k = max((len(r) for r in scored.topk if r is not None), default=0)
            ids = np.zeros((len(scored.topk), k), dtype=np.int32)
            lps = np.full((len(scored.topk), k), -99999.0, dtype=np.float32)  # the SDK's "empty" sentinel
            for i, row in enumerate(scored.topk):
                for j, (tok, lp) in enumerate(row or []):
                    ids[i, j], lps[i, j] = tok, lp
            out.topk_prompt_logprobs.token_ids = ids.tobytes()
            out.topk_prompt_logprobs.logprobs = lps.tobytes()
            out.topk_prompt_logprobs.k = k
            out.topk_prompt_logprobs.length = len(scored.topk)
        if scored.target is not None and layout is not None:
            t = out.target_prompt_logprobs
            t.dtype = pb.DTYPE_FLOAT32
            t.shape.extend(layout.shape)
            values_bytes = np.asarray(scored.target, dtype=np.float32).tobytes()
            if layout.crow is None:
                t.dense = values_bytes
            else:
                t.sparse_csr.values = values_bytes
                t.sparse_csr.crow_indices = np.asarray(layout.crow, dtype=np.int64).tobytes()
                t.sparse_csr.col_indices = np.asarray(layout.col, dtype=np.int64).tobytes()
    return Response(out.SerializeToString(), media_type=PROTO)
