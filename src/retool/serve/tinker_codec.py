"""The Tinker wire codec: the ``tinker`` 0.38 SDK's request bodies decoded into retool's types, and its
answers encoded in the SDK's own formats (JSON, or protobuf where the SDK accepts it).

Decoding: a forward pass's datums (``ForwardBackwardRequest`` protobuf: encoded-text chunks and dense
``loss_fn_inputs`` tensors; ``decode_datum``) and loss config (``wire_loss_config``), a sample request's
JSON prompt chunks (``json_tokens``) and ``target_prompt_logprobs`` tensor, dense or CSR (``target_cells``),
provenance spans (``provenance_span``). Encoding: a forward pass's ``ForwardBackwardOutput``
(``forward_output``) and a sample's answer (``sample_response``: sequences and the prompt logprobs asked
for). What is refused (images, sparse loss inputs, other dtypes) is a 400 naming it. No state: the routes,
sessions and futures are ``retool.serve.tinker_api``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np
from fastapi import Response

from retool.backends.interface.types import Datum, LossName, Sample
from retool.jsonl import JsonValue
from retool.serve.common import PromptScores, as_json, build_datum
from retool.serve.state import ServeError

PROTO = "application/x-protobuf"
# The loss_fn_inputs a datum may carry besides its target tokens.
_LOSS_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")


class WireTensor(Protocol):
    """The fields of a ``TensorData`` protobuf read here."""

    dtype: int
    dense: bytes

    def WhichOneof(self, group: str) -> str | None: ...


class EncodedText(Protocol):
    tokens: bytes


class WireChunk(Protocol):
    """The fields of a ``ModelInputChunk`` protobuf read here."""

    encoded_text: EncodedText

    def WhichOneof(self, group: str) -> str | None: ...


def tensor_values(pb: ModuleType, t: WireTensor) -> list[float]:
    if t.WhichOneof("encoding") != "dense":
        raise ServeError(400, "invalid_request", "only dense loss_fn_inputs tensors are supported")
    kinds = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if t.dtype not in kinds:
        raise ServeError(400, "invalid_request", f"tensor dtype {t.dtype} is not supported")
    try:
        return np.frombuffer(t.dense, dtype=kinds[t.dtype]).tolist()
    except ValueError as exc:
        raise ServeError(400, "invalid_request", f"bad tensor bytes: {exc}") from None


def chunk_tokens(chunks: Iterable[WireChunk]) -> list[int]:
    tokens: list[int] = []
    for c in chunks:
        if c.WhichOneof("chunk") != "encoded_text":
            raise ServeError(400, "invalid_request", "only encoded_text chunks are supported (no images)")
        if len(c.encoded_text.tokens) % 4:
            raise ServeError(400, "invalid_request", "encoded_text tokens are not int32 bytes")
        tokens += np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist()
    return tokens


def json_tokens(prompt: object) -> list[int]:
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


def decode_datum(pb: ModuleType, k: int, wire: Any, loss_fn: LossName) -> Datum:
    """Datum ``k`` of a ``ForwardBackwardRequest`` (its chunks and ``loss_fn_inputs``) as a local ``Datum``."""
    inputs: dict[str, list[float]] = {name: tensor_values(pb, t) for name, t in wire.loss_fn_inputs.items()}
    unknown = set(inputs) - {"target_tokens", *_LOSS_INPUTS}
    if unknown or "target_tokens" not in inputs:
        raise ServeError(
            400,
            "invalid_request",
            f"datum {k}: loss_fn_inputs {sorted(inputs)}; need target_tokens, and only weights, "
            "logprobs, advantages and sequence_ratio_mask besides",
        )
    targets = [int(t) for t in inputs.pop("target_tokens")]
    return build_datum(k, chunk_tokens(wire.model_input), targets, inputs, loss_fn, 1.0)


def wire_loss_config(msg: Any) -> dict[str, object]:
    """A ``ForwardBackwardRequest``'s loss config: ``loss_fn_config_v2`` (numbers only), else the old map."""
    raw: dict[str, object] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise ServeError(400, "invalid_loss_config", f"loss config {key} must be a number")
        raw[key] = value.number
    return raw or dict(msg.loss_fn_config.items())


def json_number(value: JsonValue) -> float:
    """``float(value)`` for a JSON number (or numeric string); anything else: ``TypeError``."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"not a number: {value!r}")


def provenance_span(span: Any) -> tuple[str, str, int, int]:
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


def forward_output(pb: ModuleType, loss: float, logprobs: list[list[float]]) -> bytes:
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
class Sampled:
    """A finished sample request: its samples and what it asked about its prompt."""

    samples: list[Sample]
    prompt: PromptScores | None
    target_layout: TargetLayout | None


@dataclass(frozen=True)
class TargetLayout:
    """How ``target_prompt_logprobs`` was laid out, so the answer comes back the same way."""

    shape: list[int]
    crow: list[int] | None = None
    col: list[int] | None = None


def target_cells(raw: object, n_prompt: int) -> tuple[list[int], list[int], TargetLayout] | None:
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
        return list(data), [j // k for j in range(len(data))] if k else [], TargetLayout([rows_n, k])
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
    return list(data), rows, TargetLayout([rows_n, k], list(crow), list(col))


def sample_response(result: Sampled, proto: bool) -> Response:
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
