"""Optional llama.cpp sampler for the local backend on CPU (``backend.engine = "llamacpp"``), GGUF models only.

The trainer keeps the weights (transformers + PEFT, the GGUF dequantised to float); llama.cpp (through the
``xllamacpp`` wheel, which embeds llama.cpp's server) samples from the *original* GGUF file plus a LoRA
adapter GGUF written from the trainer's current LoRA weights. ``refresh()`` runs on the trainer's worker
thread whenever the weights changed since the last export (after ``optim_step`` / ``load_state``): it
writes ``<checkpoint_dir>/llamacpp_adapters/v<N>.gguf`` in llama.cpp's adapter format and starts a fresh
in-process server with it (llama.cpp reads adapter files only when a model is loaded; reloading the
135M-parameter Q4_1 SmolLM2 takes well under a second). Like the built-in sampler it is a live view: a batch
always runs on the weights of the moment it starts. Full fine-tuning is not supported (the trainer's full
weights would have to be re-quantised into a new GGUF every step; use the built-in sampler).

Adapter format (llama.cpp's ``convert_lora_to_gguf.py``): ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, the base model's ``general.architecture``, and per adapted
linear ``blk.N.attn_q.weight.lora_a`` (PEFT's ``lora_A``, shape ``[r, in]``) and ``.lora_b`` (``lora_B``,
``[out, r]``) in float32. llama.cpp scales the product by ``alpha / r`` as PEFT does. Llama-architecture GGUF
files store q/k projections with their rows permuted for llama.cpp's RoPE layout (transformers undoes this
when it loads the file), so ``lora_B`` of ``q_proj`` / ``k_proj`` gets the same row permutation.

Sampling: each sequence is one streamed ``/v1/completions`` request with token-id prompts, its own seed,
``n_probs = 1`` (llama.cpp then reports the *raw* softmax logprob of each chosen token, before temperature
and top-p) and neutral settings for llama.cpp's extra samplers (top-k 0 unless asked, min-p 0, no
penalties). Requests of one gathered batch run concurrently in the server's parallel slots (continuous
batching). Stops follow the built-in sampler exactly: the streamed tokens are cut at the first stop id or
at the first token after which the decoded tail holds a stop string (that token kept); stop strings are also
passed to llama.cpp so it stops on its own. llama.cpp streams no chunk for a token that ends inside a UTF-8
character; when the count of streamed tokens falls short of what llama.cpp generated, that request is redone
unstreamed (every token and logprob, no stop strings) and cut the same way. llama.cpp also ends a sequence on its
end-of-generation tokens (the template's end-of-turn), which the built-in sampler has in ``eos_ids`` too.
Seeded requests are reproducible, but not token-identical to the built-in sampler (another RNG), and
batched CPU kernels may vary in the last bits with what shares the batch.

Numbers (``bench/real_model.py``, README): on 2 shared cores about 2x the built-in sampler's batched tokens/s
for SmolLM2; llama.cpp's logprobs differ from the trainer's fp32 recomputation by ~1e-2 nats on average
(quantised activations in the Q4_1 matmuls, f16 KV cache), so the PPO ratio is ~1 but not exactly 1.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from retool.backends.engine.generation import GenRequest
from retool.backends.interface.types import Sample
from retool.backends.local.sampling_client import LocalSamplingClient
from retool.jsonl import JsonValue

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from retool.backends.local.client import LocalTrainingClient

logger = logging.getLogger(__name__)

INSTALL_HINT = "backend.engine=llamacpp needs the xllamacpp wheel: pip install xllamacpp gguf"

# HF module name -> llama.cpp tensor name, as gguf-py maps Llama-family checkpoints.
_PERMUTED = ("q_proj", "k_proj")  # rows permuted in llama-architecture GGUF files
_PERMUTING_ARCHS = ("llama",)
_NEUTRAL_SAMPLERS: dict[str, float] = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "mirostat": 0,
    "top_n_sigma": -1.0,
}


def _import_xllamacpp() -> Any:
    try:
        import xllamacpp  # deferred: xllamacpp is optional (the llamacpp extra)
    except ImportError as exc:
        raise RuntimeError(INSTALL_HINT) from exc
    return xllamacpp


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file (``llama``, ``qwen2`` ...)."""
    import gguf  # deferred: gguf is optional (the llamacpp extra)

    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    return str(field.contents())


def permute_rows(
    weight: npt.NDArray[np.float32], n_head: int, n_head_kv: int | None = None
) -> npt.NDArray[np.float32]:
    """llama.cpp's q/k row permutation (``LlamaModel.permute`` of ``convert_hf_to_gguf.py``), on rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = weight.shape
    return weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def lora_tensors(peft_model: Any, arch: str) -> dict[str, npt.NDArray[np.float32]]:
    """``{gguf tensor name: float32 numpy array}`` of the active LoRA adapter of a PEFT causal LM."""
    import gguf  # deferred: gguf is optional (the llamacpp extra)
    import torch  # deferred: torch (~2 s), once an adapter is exported

    config = peft_model.get_base_model().config
    n_layers = int(config.num_hidden_layers)
    n_head = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", n_head))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, n_layers)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name, module in peft_model.get_base_model().named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not lora_a:
            continue
        (adapter,) = module.active_adapters
        target = name_map.get_name(name)
        if target is None:
            raise ValueError(f"no llama.cpp tensor for the LoRA-adapted module {name}")
        a = module.lora_A[adapter].weight.detach().float().cpu().numpy()
        b = module.lora_B[adapter].weight.detach().float().cpu().numpy()
        short = name.rsplit(".", 1)[-1]
        if arch in _PERMUTING_ARCHS and short in _PERMUTED:
            b = permute_rows(b, n_head, n_head if short == "q_proj" else n_kv)
        out[f"{target}.weight.lora_a"] = a.copy()
        out[f"{target}.weight.lora_b"] = b.copy()
    if not out:
        raise ValueError("the model has no LoRA layers to export")
    return out


def export_lora_gguf(peft_model: Any, out_file: str | Path, *, arch: str, alpha: float) -> Path:
    """Write the active LoRA adapter of ``peft_model`` as a llama.cpp adapter GGUF (see the module docstring)."""
    import gguf  # deferred: gguf is optional (the llamacpp extra)

    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = lora_tensors(peft_model, arch)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


class _Stream:
    """Collects one streamed completion token by token and cuts it where the built-in sampler would."""

    def __init__(self, req: GenRequest, budget: int, stop_ids: set[int], decode: Callable[[list[int]], str]):
        self.received: list[tuple[int, float]] = []  # (token id, raw logprob) as streamed
        self.finish: str | None = None
        self.generated = -1  # tokens llama.cpp says it generated
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.reason: str | None = None
        self.error: str | None = None
        self._budget = budget
        self._ids = stop_ids | {int(s) for s in req.params.stop if not isinstance(s, str)}
        self._strings = [s for s in req.params.stop if isinstance(s, str) and s]
        self._window = max((len(s) for s in self._strings), default=0) + 4
        self._decode = decode

    def __call__(self, chunk: CompletionChunk) -> bool:
        """One server chunk; True stops reading (only on errors: llama.cpp ends the stream itself)."""
        if "choices" not in chunk:
            self.error = str(chunk.get("error", chunk))
            return True
        choice = chunk["choices"][0]
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            self.received.append((int(entry["id"]), float(entry["logprob"])))
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
            self.generated = int((chunk.get("usage") or {}).get("completion_tokens", len(self.received)))
        return False

    def cut(self, received: list[tuple[int, float]]) -> None:
        """Keep the tokens up to the first stop (kept) or the budget, as the built-in sampler does."""
        for tok, logprob in received:
            if self._add(tok, logprob):
                return
        self.reason = "length" if self.finish == "length" else "stop"

    def _add(self, tok: int, logprob: float) -> bool:
        self.tokens.append(tok)
        self.logprobs.append(logprob)
        if tok in self._ids or self._hit_stop_string():
            self.reason = "stop"
        elif len(self.tokens) >= self._budget:
            self.reason = "length"
        return self.reason is not None

    def _hit_stop_string(self) -> bool:
        if not self._strings:
            return False
        tail = self._decode(self.tokens[-self._window :])
        return any(s in tail for s in self._strings)


class TokenLogprob(TypedDict):
    id: int
    logprob: float


class ChoiceLogprobs(TypedDict, total=False):
    content: list[TokenLogprob] | None


class Choice(TypedDict, total=False):
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class CompletionUsage(TypedDict, total=False):
    completion_tokens: int


class CompletionChunk(TypedDict, total=False):
    """One answer (or streamed chunk) of llama.cpp's completions handler: the fields read here."""

    choices: list[Choice]
    usage: CompletionUsage | None
    error: JsonValue


class LlamaCppOptions(TypedDict, total=False):
    """``LlamaCppSamplingClient``'s keyword options (``attach_llamacpp_sampler`` passes them on)."""

    threads: int
    parallel: int | None
    gather_ms: float
    keep_adapters: int


class LlamaCppSamplingClient(LocalSamplingClient):
    """Samples with llama.cpp (xllamacpp) from the base GGUF plus the trainer's current LoRA adapter."""

    _owner: LocalTrainingClient  # it reads more of its trainer than the base class's SamplerOwner names

    def __init__(
        self,
        owner: LocalTrainingClient,
        *,
        threads: int = 2,
        parallel: int | None = None,
        gather_ms: float = 5.0,
        keep_adapters: int = 2,
    ) -> None:
        self._xl = _import_xllamacpp()
        if owner.lora is None:
            raise ValueError(
                "the llama.cpp sampler hands LoRA adapters over; full fine-tuning needs backend.engine=hf"
            )
        if not owner.gguf_file:
            raise ValueError(
                "the llama.cpp sampler needs the model as a GGUF file (model.name = path/to/x.gguf)"
            )
        super().__init__(owner, gather_ms=gather_ms)
        self.gguf_path = Path(owner.model_path) / owner.gguf_file
        self.arch = gguf_architecture(self.gguf_path)
        self.threads = max(1, int(threads))
        # Parallel slots (one KV cache of max_context tokens each); a bigger batch queues in the server.
        self.parallel = max(1, int(parallel or min(self.batch_limit, 32)))
        self._pool = ThreadPoolExecutor(max_workers=self.batch_limit, thread_name_prefix="retool-llamacpp")
        self._adapter_dir = Path(owner.checkpoint_dir) / "llamacpp_adapters"
        self._keep = keep_adapters
        self._server: Any = None
        self._server_version = -1  # the trainer's weights version the running server was built from
        self._exports = 0
        self.reload_seconds = 0.0
        self.ignore_eos = False  # benchmarks only: every sequence runs to max_tokens
        self.resampled = 0  # requests redone unstreamed (see ``_complete``)

    def _params(self) -> Any:
        params = self._xl.CommonParams()
        params.model.path = str(self.gguf_path)
        params.n_parallel = self.parallel
        params.n_ctx = self.parallel * self._owner.max_context
        params.cpuparams.n_threads = self.threads
        params.cpuparams_batch.n_threads = self.threads
        # No busy-waiting between ops: on a shared CPU spinning threads steal the time they wait for.
        params.cpuparams.poll = 0
        params.cpuparams_batch.poll = 0
        params.port = 0  # the embedded HTTP server takes any free port (nothing calls it)
        params.verbosity = -1
        params.warmup = False
        return params

    def refresh(self) -> None:
        """Export the trainer's current adapter and restart the server with it, if the weights changed."""
        version = self._owner._weights_version
        if self._server is not None and version == self._server_version:
            return
        t0 = time.perf_counter()
        self._exports += 1
        path = self._adapter_dir / f"v{self._exports}.gguf"
        lora = self._owner.lora
        assert lora is not None
        export_lora_gguf(self._owner.model, path, arch=self.arch, alpha=float(lora.alpha))
        params = self._params()
        params.lora_adapters = [self._xl.CommonAdapterLoraInfo(str(path), 1.0)]
        self._server = None  # free the old model and KV caches before loading the new ones
        self._server = self._xl.Server(params)
        self._server_version = version
        old = self._adapter_dir / f"v{self._exports - self._keep}.gguf"
        if self._exports > self._keep and old.is_file():
            old.unlink()
        self.reload_seconds += time.perf_counter() - t0
        logger.debug("llama.cpp sampler at adapter v%d (weights version %d)", self._exports, version)

    def _request(self, req: GenRequest, budget: int) -> dict[str, object]:
        p = req.params
        return {
            "prompt": list(req.prompt),
            "max_tokens": budget,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else 0,
            **_NEUTRAL_SAMPLERS,
            "seed": req.seed % (2**32 - 1),  # 0xFFFFFFFF would mean "random"
            "stop": [s for s in p.stop if isinstance(s, str) and s],
            "n_probs": 1,
            "logprobs": 1,
            "stream": True,
            "cache_prompt": True,
            "ignore_eos": self.ignore_eos,
        }

    def _complete(self, req: GenRequest) -> Sample:
        budget = max(0, min(req.params.max_tokens, self._owner.max_context - len(req.prompt)))
        if budget == 0:
            return Sample([], [], "length")
        tokenizer = self._owner.tokenizer
        stop_ids = set() if self.ignore_eos else set(self._owner.eos_ids)
        stream = _Stream(req, budget, stop_ids, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        request = self._request(req, budget)
        self._server.handle_completions(request, stream)
        if stream.error is None and stream.generated != len(stream.received):
            # llama.cpp streams no chunk for a token that ends inside a UTF-8 character, so its id and
            # logprob are missing. Rare (non-ASCII text): redo the request unstreamed, which returns
            # every token (without stop strings, which would make it drop the stop's tokens).
            self.resampled += 1
            whole = self._server.handle_completions({**request, "stream": False, "stop": []})
            if "choices" not in whole:
                stream.error = str(whole.get("error", whole))
            else:
                choice = whole["choices"][0]
                stream.finish = str(choice.get("finish_reason") or "length")
                entries = (choice.get("logprobs") or {}).get("content") or []
                stream.received = [(int(e["id"]), float(e["logprob"])) for e in entries]
        if stream.error is not None:
            raise RuntimeError(f"llama.cpp completion failed: {stream.error}")
        stream.cut(stream.received)
        return Sample(stream.tokens, stream.logprobs, stream.reason or "length")  # type: ignore[arg-type]

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        """Worker-thread body: bring the server up to date, then run every request in a parallel slot."""
        self.refresh()
        t0 = time.perf_counter()
        samples = list(self._pool.map(self._complete, requests))
        self._owner.stats.add_sampling(requests, samples, time.perf_counter() - t0)
        return samples

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._server = None


def attach_llamacpp_sampler(
    client: LocalTrainingClient, **kwargs: Unpack[LlamaCppOptions]
) -> LlamaCppSamplingClient:
    """Make ``client.sampling_client()`` return a llama.cpp sampler refreshed from the trainer's weights."""
    sampler = LlamaCppSamplingClient(client, **kwargs)
    client.set_sampler(sampler)
    return sampler
