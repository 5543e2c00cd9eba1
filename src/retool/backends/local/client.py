"""The default backend: a transformers causal LM trained in this process (CPU or one GPU).

``LocalTrainingClient`` owns the model (optionally wrapped in a PEFT LoRA adapter), the AdamW optimizer
and a single worker thread that runs every forward, backward and generation, so training and sampling
never touch the weights at the same time and the event loop stays free.

``LocalSamplingClient`` is a *live view* of the trainer's current weights, not a snapshot: the sampler
returned by ``sampling_client_async()`` always samples from whatever the weights are when its batch runs
(generation uses eval mode and ``no_grad``). The RL loop refreshes the sampler at the start of each step
and does not optimise while sampling, so this is on-policy; with LoRA dropout 0 the trainer's recomputed
logprobs match the sampler's to float precision (ratio 1).

Concurrent ``sample_async`` calls are gathered for a few milliseconds and handed together to the
continuous-batching engine of ``retool.backends.engine.generation``: up to ``sample_batch_size`` sequences
decode together, new ones join at step boundaries and finished ones leave at once. Its prefix cache
(``retool.backends.engine.prefix_cache``, ``prefix_cache_mb``, LRU) lets a request that extends a sequence
already run (a trajectory's next turn, a group's shared prompt) prefill only its new tokens. The cache is
emptied whenever the weights change (``optim_step``, ``load_state``, ``mark_weights_changed``) or the
sampling module does (the merged LoRA view switched on or off): KV computed with old weights never
serves a request.

Off-policy pipelining (``train.max_steps_off_policy``) samples from a ``FrozenSamplingClient``: a copy of
the weights of one version that generates on a thread of its own while the worker thread trains.

Sampling with LoRA (``merge_lora_for_sampling``, default on): generation runs on a plain copy of the base
model whose adapted linears hold ``W + scale * B @ A`` (every other tensor is shared with the trainer, so
the copy costs only the adapted weights), rebuilt lazily after each ``optim_step`` or ``load_state``.
Through the PEFT wrapper every adapted linear costs three extra small matmuls and Python dispatch per
decoded token. Merged and unmerged forwards agree to float rounding (ratio 1 within ~1e-5, not bitwise).

Precision (``dtype``: ``backend.dtype``, resolved once by ``retool.backends.local.precision``): fp32 as
above; in bf16 the trainable tensors and the optimizer state stay fp32 masters, a LoRA run's frozen base is
stored in bf16, training forwards run under ``torch.autocast(bfloat16)`` and the sampler computes in bf16
(the merged view; in full fine-tuning a bf16 copy of the weights, ``_CastSampler``), so sampled and
trained logprobs differ by bf16 rounding on the same weights (``precision_mismatch``: TIS on by default).

``stats`` counts what the worker thread did: sampled sequences and tokens, prompt tokens (all of them, and
those actually prefilled, i.e. not served by a cache) and seconds spent generating; trained tokens (padded
and real) and seconds spent in forward/backward.

Seeds: sample ``i`` of a request with ``seed=s`` uses its own generator seeded from ``(s, i)``, so the
result does not depend on what else shares the batch; unseeded requests draw seeds from the client's RNG
(seeded by ``seed`` and saved with the state).

Reduction follows Tinker: per-token losses times datum weights are SUMMED over tokens and datums; the
training loop puts its normalisation into the weights. Datums are packed into micro-batches by padded
area (``micro_batch_tokens``), padded on the right with an attention mask; gradients accumulate until
``optim_step`` (AdamW; the grad-norm clip applies to the accumulated gradient). Training forwards run in
train mode, so LoRA dropout > 0 makes the ratio differ from 1 even on-policy.

``save_state(name)`` writes a folder (``checkpoint_dir/name``, or ``name`` itself when it is a path):
``adapter_model.safetensors`` + ``adapter_config.json`` (LoRA, PEFT format) or ``model.safetensors``
(full fine-tuning), ``optimizer.pt``, ``rng.pt`` (torch, CUDA, Python, NumPy and sampler-seed RNGs) and
``trainer_state.json`` (step, model, LoRA settings). ``load_state`` restores all of it into a client built
with the same model and LoRA settings, so the next step's loss is bitwise identical.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import logging
import random
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from retool.backends.engine.generation import ContinuousGenerator, GenRequest
from retool.backends.engine.prefix_cache import PrefixCache
from retool.backends.interface.clients import SamplingClient, TrainingClient, run_sync
from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    Sample,
    SamplingParams,
)
from retool.backends.local.precision import (
    Precision,
    cast_parameters,
    cpu_bf16_native,
    hidden_size,
    load_dtype,
    resolve_precision,
)
from retool.backends.local.shared_prefix import shared_input_prefix, target_logprobs
from retool.backends.training.losses import LOSS_NAMES, LossTally, token_loss
from retool.backends.training.packing import pack_micro_batches, padding_efficiency

logger = logging.getLogger(__name__)

# Default memory cap of the sampler's prefix cache (``backend.prefix_cache_mb``). SmolLM2-135M holds
# ~46 KB of KV per token in fp32, so 1 GiB keeps ~23,000 tokens: a demo step's trajectories.
DEFAULT_PREFIX_CACHE_MB = 1024.0

# The metadata of a saved state. Its name (kept so states saved earlier still load) is also the trainer
# checkpoint's; ``retool.train.checkpoint`` tells the two apart by their contents.
BACKEND_META_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
FULL_WEIGHTS_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@dataclass(frozen=True)
class LocalLoraSpec:
    """LoRA settings of the local backend (``None`` in place of a spec means full fine-tuning)."""

    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``setting`` asks training forwards to autocast to: ``off`` None, ``bfloat16``, or
    ``auto``: bfloat16 where the hardware computes it natively (a CUDA device that supports it; a CPU with
    AVX512-BF16 or AMX, where its matmuls run ~2x fp32's: 1.66x on a SmolLM2 LoRA step), else None."""
    if setting == "off":
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    if setting != "auto":
        raise ValueError(f"autocast must be off, bfloat16 or auto, not {setting!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and cpu_bf16_native()[0] else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def split_model_path(model_path: str | Path, gguf_file: str | None) -> tuple[str, str | None]:
    """A ``.gguf`` path becomes (its folder, its file name), as transformers' ``gguf_file=`` expects."""
    text = str(model_path)
    if gguf_file is None and text.endswith(".gguf"):
        path = Path(text)
        return str(path.parent), path.name
    return text, gguf_file


def _forget_gguf_quantization(model: Any) -> None:
    """A model read from a GGUF file holds ordinary dequantised tensors (``dtype``), but transformers
    still marks it as GGUF-quantised, which makes ``save_pretrained`` refuse it and a saved folder point
    back at a GGUF file. Drop the marks so that merged LoRA weights and checkpoints save as usual."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    quant = getattr(model.config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if quant is not None and str(getattr(method, "value", method)) == "gguf":
        del model.config.quantization_config
    if getattr(model, "quantization_method", None) is not None:
        model.quantization_method = None


def _prefix_cache_bytes(megabytes: float) -> int:
    if megabytes < 0:
        raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the cache off), got {megabytes}")
    return int(megabytes * 2**20)


def _lora_spec(lora: object) -> LocalLoraSpec | None:
    """Accept a ``LocalLoraSpec``, a ``retool.config.LoraConfig``, a dict, or ``None`` (full fine-tuning)."""
    if lora is None or isinstance(lora, LocalLoraSpec):
        return lora
    if isinstance(lora, dict):
        data = dict(lora)
    else:
        data = lora.model_dump() if hasattr(lora, "model_dump") else vars(lora)
    if not data.pop("enabled", True):
        return None
    if "target_modules" in data:
        data["target_modules"] = tuple(data["target_modules"])
    return LocalLoraSpec(**data)


@dataclass
class BackendStats:
    """Work done by a local client's worker thread since it started (see the module docstring)."""

    sample_seconds: float = 0.0
    prefill_seconds: float = 0.0  # part of sample_seconds: the prompts' forward passes
    sampled_sequences: int = 0
    sampled_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (not served by a cache)
    prompt_tokens: int = 0  # prompt tokens of the sampled sequences, cached or not
    train_seconds: float = 0.0
    trained_tokens: int = 0
    trained_padded_tokens: int = 0
    forward_seconds: float = 0.0  # forward-only passes (no gradient)

    def add_sampling(
        self, requests: Sequence[GenRequest], samples: Sequence[Sample], seconds: float, prefill: float = 0.0
    ) -> None:
        """A batch generated by an external engine (llama.cpp), which prefills every prompt in full."""
        self.sample_seconds += seconds
        self.prefill_seconds += prefill
        self.sampled_sequences += len(samples)
        self.sampled_tokens += sum(len(s.tokens) for s in samples)
        self.prefill_tokens += sum(len(r.prompt) for r in requests)
        self.prompt_tokens += sum(len(r.prompt) for r in requests)

    # The local engine's reports (``retool.backends.engine.generation.SamplingStats``).
    def add_prefill(self, computed: int, seconds: float) -> None:
        self.prefill_tokens += computed
        self.prefill_seconds += seconds

    def add_sequence(self, prompt_tokens: int, sampled_tokens: int) -> None:
        self.sampled_sequences += 1
        self.sampled_tokens += sampled_tokens
        self.prompt_tokens += prompt_tokens

    def add_sample_seconds(self, seconds: float) -> None:
        self.sample_seconds += seconds

    def add_training(self, tokens: int, padded: int, seconds: float, backward: bool) -> None:
        if not backward:
            self.forward_seconds += seconds
            return
        self.train_seconds += seconds
        self.trained_tokens += tokens
        self.trained_padded_tokens += padded

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {k: round(v, 3) if isinstance(v, float) else v for k, v in vars(self).items()}
        out["sample_tokens_per_s"] = (
            round(self.sampled_tokens / self.sample_seconds, 1) if self.sample_seconds else 0.0
        )
        out["train_tokens_per_s"] = (
            round(self.trained_tokens / self.train_seconds, 1) if self.train_seconds else 0.0
        )
        out["prefill_per_sampled_token"] = (
            round(self.prefill_tokens / self.sampled_tokens, 3) if self.sampled_tokens else 0.0
        )
        return out


class _PackedLinear(torch.nn.Linear):
    """A linear layer that runs on a copy of its weight laid out ahead of time for oneDNN's kernel
    ("prepacked"), as torch's own compiler does for frozen CPU inference: at decode batch sizes the
    plain kernel re-lays the weight out on every call (measured with SmolLM2-135M on 2 cores: 1.3-2.7x
    faster, the 49k-row output layer 2x, results within 1e-6 relative: another summation order). Same
    parameters and state dict as ``nn.Linear``; ``pack`` must follow every change of the weight."""

    _packed: torch.Tensor | None = None

    @classmethod
    def sharing(cls, linear: torch.nn.Linear) -> _PackedLinear:
        packed = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        packed.weight, packed.bias = linear.weight, linear.bias  # the same tensors, not copies
        return packed

    @torch.no_grad()
    def pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None or torch.is_grad_enabled():
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _can_pack(model: torch.nn.Module) -> bool:
    """Whether prepacked oneDNN linears (``_PackedLinear``) can run this model: fp32 or bf16 on CPU, torch
    with oneDNN (bf16 packed: as fast as plain bf16 or faster at decode sizes, the output layer 2-2.7x;
    the same results, measured)."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _pack_linears(model: torch.nn.Module) -> list[_PackedLinear]:
    """Replace every plain ``nn.Linear`` of ``model`` by a ``_PackedLinear`` over the same tensors."""
    packed: list[_PackedLinear] = []
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            replacement = _PackedLinear.sharing(module)
            setattr(parent, child, replacement)
            packed.append(replacement)
    return packed


class _MergedSampler:
    """A LoRA-free copy of a PEFT model for generation: adapted linears hold merged weights, every other
    parameter and buffer is the trainer's own tensor (shared, not copied)."""

    def __init__(self, model: torch.nn.Module, pairs: list[tuple[Any, torch.nn.Linear]]) -> None:
        self.model = model
        self._pairs = pairs  # (live LoRA layer, its merged plain linear in the copy)
        self._version = -1
        # Every linear of the copy prepacked (merged and shared ones: a weight load may change either).
        self._packed = _pack_linears(model) if _can_pack(model) else []

    @classmethod
    def build(cls, peft_model: Any) -> _MergedSampler | None:
        from peft.tuners.lora import Linear as LoraLinear  # deferred: peft is needed with LoRA only

        base = peft_model.get_base_model()
        live = {name: mod for name, mod in base.named_modules() if isinstance(mod, LoraLinear)}
        if not live or any(len(m.active_adapters) != 1 for m in live.values()):
            return None
        # Deep-copy the module tree but let the copy reference the trainer's parameters and buffers.
        memo: dict[int, torch.Tensor] = {id(t): t for t in base.parameters()}
        memo.update({id(t): t for t in base.buffers()})
        plain = copy.deepcopy(base, memo)
        pairs: list[tuple[Any, torch.nn.Linear]] = []
        for name, layer in live.items():
            inner = layer.base_layer
            if not isinstance(inner, torch.nn.Linear):  # a LoRA layout this view does not know
                return None
            merged = torch.nn.Linear(
                inner.in_features, inner.out_features, bias=inner.bias is not None, device="meta"
            )
            merged.weight = torch.nn.Parameter(inner.weight.detach().clone(), requires_grad=False)
            merged.bias = inner.bias  # shared
            parent_name, _, child = name.rpartition(".")
            parent = plain.get_submodule(parent_name) if parent_name else plain
            setattr(parent, child, merged)
            pairs.append((layer, merged))
        plain.requires_grad_(False)
        return cls(plain, pairs)

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        if version == self._version:
            return
        for layer, merged in self._pairs:
            (adapter,) = layer.active_adapters
            delta = layer.get_delta_weight(adapter) if adapter in layer.lora_A else None
            merged.weight.copy_(layer.base_layer.weight)
            if delta is not None:
                merged.weight.add_(delta.to(merged.weight.dtype))
        for linear in self._packed:
            linear.pack()
        self._version = version


class _CastSampler:
    """Full fine-tuning in mixed precision: a copy of the fp32 model whose parameters are ``dtype`` copies
    of the trainer's (buffers shared), for generation; refreshed from the masters when the weights change."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        memo: dict[int, torch.Tensor] = {id(b): b for b in model.buffers()}
        with torch.no_grad():
            self.model = copy.deepcopy(model, memo)
        cast_parameters(self.model, dtype)
        self.model.requires_grad_(False)
        self.model.eval()
        self._pairs = list(zip(model.parameters(), self.model.parameters(), strict=True))
        self._version = -1
        self._packed = _pack_linears(self.model) if _can_pack(self.model) else []

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        if version == self._version:
            return
        for master, copied in self._pairs:
            copied.copy_(master)
        for linear in self._packed:
            linear.pack()
        self._version = version


@dataclass
class _Pending:
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    seeds: list[int]
    future: asyncio.Future[list[Sample]]


@dataclass
class _LoopQueue:
    pending: collections.deque[_Pending] = field(default_factory=collections.deque)
    task: asyncio.Task[None] | None = None
    deliveries: set[asyncio.Task[None]] = field(default_factory=set)  # strong references while running


def load_base_model(model_path: str, device: str = "auto", dtype: str = "auto") -> torch.nn.Module:
    """A model's weights loaded once, frozen (no gradients) and in eval mode, to be shared by many
    ``LocalTrainingClient(shared_base=...)``: each adds its own LoRA adapter on top (``share_module``).
    ``dtype`` as ``backend.dtype`` (``retool.backends.local.precision``): in bf16 the base is stored in
    bf16 and the clients' adapters stay fp32."""
    dev = resolve_device(device)
    path, gguf = split_model_path(model_path, None)
    kwargs: dict[str, str] = {"gguf_file": gguf} if gguf else {}
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype(dtype, dev), **kwargs)
    if gguf:
        _forget_gguf_quantization(model)
    precision = resolve_precision(dtype, dev, hidden_size(model.config))
    logger.info("shared base %s %s", model_path, precision.describe())
    if precision.mixed:
        cast_parameters(model, precision.compute)
    model.to(dev)
    model.requires_grad_(False)
    model.eval()
    return model


def share_module(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base``'s module tree that holds the very same parameter and buffer tensors: modules are
    new (PEFT can wrap them without touching ``base``), no weight is copied."""
    memo: dict[int, object] = {id(t): t for t in (*base.parameters(), *base.buffers())}
    with torch.no_grad():
        return copy.deepcopy(base, memo)


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of ``model`` in eval mode that owns a copy of every trainable tensor and shares the rest;
    with ``dtype``, its copies are in that dtype (full fine-tuning in mixed precision samples in bf16)."""
    memo: dict[int, torch.Tensor] = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    with torch.no_grad():
        frozen = copy.deepcopy(model, memo)
        if dtype is not None:
            for p, q in zip(model.parameters(), frozen.parameters(), strict=True):
                if p.requires_grad and q.is_floating_point():
                    q.data = q.data.to(dtype)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


class LocalSamplingClient(SamplingClient):
    """Batched sampler over the owning trainer's current weights (a live view; see the module docstring).

    Concurrent requests are gathered for ``gather_ms`` and handed to ``engine`` (continuous batching,
    ``retool.backends.engine.generation``) together; samplers without an engine (external engines: vLLM,
    llama.cpp) override ``_run_batch``, which runs each gathered batch on the worker thread.
    """

    adapter: Hashable = (
        None  # the adapter its rows name on a shared engine (``retool.backends.samplers.multi_lora``)
    )

    def __init__(
        self, owner: LocalTrainingClient, gather_ms: float = 5.0, engine: ContinuousGenerator | None = None
    ) -> None:
        self._owner = owner
        self.batch_limit = owner.sample_batch_size
        self._gather_s = gather_ms / 1000.0
        self._engine = engine
        self._worker: Executor = owner._executor  # the thread external engines' batches run on
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopQueue] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def tokenizer(self) -> Any:
        return self._owner.tokenizer

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        prompt = [int(t) for t in prompt_tokens]
        self._owner._check_sample_request(prompt, num_samples, params)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Sample]] = loop.create_future()
        seeds = self._owner._sequence_seeds(params.seed, num_samples)
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _LoopQueue()
        queue.pending.append(_Pending(prompt, num_samples, params, seeds, fut))
        if queue.task is None or queue.task.done():
            queue.task = loop.create_task(self._dispatch(queue))
        return await fut

    async def _dispatch(self, queue: _LoopQueue) -> None:
        limit = self.batch_limit
        while queue.pending:
            await asyncio.sleep(self._gather_s)  # let concurrent callers join this batch
            batch: list[_Pending] = []
            count = 0
            while queue.pending and (not batch or count + queue.pending[0].num_samples <= limit):
                item = queue.pending.popleft()
                if item.future.cancelled():
                    continue
                batch.append(item)
                count += item.num_samples
            if not batch:
                continue
            flat = [GenRequest(p.prompt, p.params, s, self.adapter) for p in batch for s in p.seeds]
            try:
                running = self._start_batch(flat)
            except Exception as exc:  # every waiter learns why; the queue keeps serving later requests
                logger.exception("local sampling batch failed")
                _fail_all(batch, exc)
                continue
            task = asyncio.get_running_loop().create_task(_deliver(batch, running))
            queue.deliveries.add(task)
            task.add_done_callback(queue.deliveries.discard)

    def _scoring_model(self) -> Any:
        """The module this sampler's weights live in (a frozen copy, or the trainer's current weights)."""
        return self._owner.sampling_model()

    async def prompt_logprobs_async(self, prompt_tokens: Sequence[int]) -> torch.Tensor:
        """The log-softmax of the next-token distribution after every prefix ``prompt[:i+1]``, ``i < n-1``:
        a float32 ``[len(prompt) - 1, vocab]`` tensor on the CPU (row ``i`` scores prompt position ``i+1``).
        It runs on the thread this sampler generates on, so it sees the weights its samples do."""
        prompt = [int(t) for t in prompt_tokens]
        if len(prompt) < 2:
            return torch.zeros((0, 0))
        self._owner._check_tokens(prompt, "prompt")

        def score() -> torch.Tensor:
            model = self._scoring_model()
            model.eval()  # as generation runs it (training sets train() again before each pass)
            ids = torch.tensor([prompt[:-1]], device=self._owner.device)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            return torch.log_softmax(logits, dim=-1).cpu()

        return await asyncio.get_running_loop().run_in_executor(self._worker, score)

    def _start_batch(self, requests: list[GenRequest]) -> Awaitable[list[Sample]]:
        """Start generating one gathered batch; its samples, in order, when awaited."""
        if self._engine is not None:
            return asyncio.wrap_future(self._engine.submit(requests))
        return asyncio.get_running_loop().run_in_executor(self._worker, self._run_batch, requests)

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        """Worker-thread body of one gathered batch, for samplers without an engine (vLLM, llama.cpp)."""
        raise NotImplementedError(f"{type(self).__name__} has neither an engine nor a _run_batch")


def _fail_all(batch: list[_Pending], exc: BaseException) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(exc)


async def _deliver(batch: list[_Pending], running: Awaitable[list[Sample]]) -> None:
    """Hand each request of a gathered batch its samples (or the batch's error)."""
    try:
        samples = await running
    except Exception as exc:
        logger.exception("local sampling batch failed")
        _fail_all(batch, exc)
        return
    start = 0
    for p in batch:
        if not p.future.done():
            p.future.set_result(samples[start : start + p.num_samples])
        start += p.num_samples


class FrozenSamplingClient(LocalSamplingClient):
    """Sampler of ``owner`` over one frozen copy of its weights (``frozen_copy``), for off-policy
    pipelining: version v samples while version v+1 trains.

    The copy is taken on the trainer's worker thread, queued behind every training call made before it,
    so it holds exactly the weights after the last ``optim_step``. Its engine generates on ``worker`` (one
    thread per training client, shared by its frozen samplers), so a batch generates while the worker
    thread trains: on CPU the two run on two cores (torch releases the GIL inside its kernels). Its
    prefix cache is its own (its weights never change). ``policy_step``: the owner's optimizer steps
    when the copy was taken (which version it samples).
    """

    def __init__(
        self, owner: LocalTrainingClient, model: torch.nn.Module, worker: Executor, gather_ms: float
    ) -> None:
        step = owner.step
        engine = owner.make_engine(lambda: model, lambda: ("frozen", step), worker)
        super().__init__(owner, gather_ms=gather_ms, engine=engine)
        self._worker = worker
        self.model = model
        self.policy_step = step

    def _scoring_model(self) -> Any:
        return self.model


@dataclass
class DatumsPass:
    """A forward(-backward) pass over some datums, before it becomes a ``ForwardBackwardResult``: the loss
    tally, the sum of the trained tokens' logprobs, each datum's token logprobs and the micro-batches (as
    indices of the datums). Passes over disjoint shares of a call merge into the pass over the call."""

    tally: LossTally
    lp_sum: float
    token_logprobs: list[list[float]]
    batches: list[list[int]]
    seconds: float = 0.0  # CPU seconds the pass took in its process (the slowest share's, once merged)

    @classmethod
    def merge(cls, parts: Sequence[tuple[list[int], DatumsPass]], size: int) -> DatumsPass:
        """The pass over ``size`` datums from passes over shares of them: (the share's indices, its pass)."""
        whole = cls(LossTally(), 0.0, [[] for _ in range(size)], [])
        for rows, part in parts:
            whole.tally.merge(part.tally)
            whole.lp_sum += part.lp_sum
            for local, i in enumerate(rows):
                whole.token_logprobs[i] = part.token_logprobs[local]
            whole.batches += [[rows[k] for k in batch] for batch in part.batches]
            whole.seconds = max(whole.seconds, part.seconds)
        return whole


class LocalTrainingClient(TrainingClient):
    """A transformers model + optional PEFT LoRA + AdamW in this process. See the module docstring."""

    # Training forwards under torch.autocast to this dtype (None: the model's own dtype). Sampling never
    # autocasts, so only a loss without a sampler ratio should set it (``autocast_dtype``: SFT).
    train_autocast: torch.dtype | None = None

    def __init__(
        self,
        model_path: str | Path,
        *,
        lora: object = LocalLoraSpec(),  # a LocalLoraSpec, a retool.config.LoraConfig, a dict or None
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        gguf_file: str | None = None,
        micro_batch_tokens: int = 8192,
        micro_batch_overhead: int = 0,
        sample_batch_size: int = 32,
        checkpoint_dir: str | Path = "checkpoints",
        max_context: int | None = None,
        gather_ms: float = 5.0,
        attn_implementation: str | None = None,
        num_threads: int | None = None,
        merge_lora_for_sampling: bool = True,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        shared_base: torch.nn.Module | None = None,
        share_train_prefix: bool = True,
    ) -> None:
        if num_threads:
            # On a busy CPU one thread is often several times faster for tiny models.
            torch.set_num_threads(int(num_threads))
        # The worker threads below run every forward; each keeps the count it starts with (torch applies
        # set_num_threads to the calling thread and to threads created later, not to running ones).
        self.num_threads = torch.get_num_threads()
        self.prefix_cache_bytes = _prefix_cache_bytes(prefix_cache_mb)

        self.device = resolve_device(device)
        self.dtype_setting = dtype  # backend.dtype; the compute dtype it resolves to: self.precision
        self.seed = seed
        self.model_path, self.gguf_file = split_model_path(model_path, gguf_file)
        self.lora = _lora_spec(lora)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.micro_batch_overhead = int(micro_batch_overhead)  # packing's batch_cost (0: fewest batches)
        self.share_train_prefix = bool(share_train_prefix)  # shared prefixes run once (local.shared_prefix)
        self.sample_batch_size = int(sample_batch_size)
        self.checkpoint_dir = Path(checkpoint_dir)
        if self.micro_batch_tokens <= 0 or self.sample_batch_size <= 0:
            raise ValueError("micro_batch_tokens and sample_batch_size must be positive")

        load_kwargs = self._load_tokenizer(attn_implementation)
        # A shared base (``load_base_model``) is read-only here: only LoRA tensors of this client train.
        self.shares_base = shared_base is not None
        if self.shares_base and self.lora is None:
            logger.info("local backend: a client without LoRA on a shared base only samples")
        self.model = self._load_model(load_kwargs, seed, shared_base)
        self.dtype = self.precision.compute  # what matmuls run in (retool.backends.local.precision)
        self.model.train()
        config = self._base_config()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        model_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.max_context = min(int(max_context), model_context) if max_context else model_context
        self.pad_id = self._pad_id()
        self.eos_ids = self._eos_ids()
        self.merge_lora_for_sampling = bool(merge_lora_for_sampling)
        self._start_runtime(seed, gather_ms)
        torch.manual_seed(seed)
        logger.info(
            "local backend: %s on %s/%s, %s, %d trainable parameters; %s",
            self.model_path,
            self.device,
            self.dtype,
            f"LoRA r={self.lora.rank}" if self.lora else "full fine-tuning",
            self.num_trainable_parameters(),
            self.precision.describe(),
        )

    def _start_runtime(self, seed: int, gather_ms: float) -> None:
        """What a loaded client trains and samples with: step and optimizer slots, the RNG of sampling
        seeds, the worker thread every forward runs on, the generation engine and the sampling client."""
        self.step = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self._seed_rng = random.Random(seed)
        self._executor = self._worker_thread("retool-local")
        self._waiting_lock = threading.Lock()
        self._waiting_jobs = 0  # calls queued for the worker thread (the sampler yields to them)
        self._gather_ms = gather_ms
        self._frozen_thread: ThreadPoolExecutor | None = None  # generation of frozen samplers
        self._pending_grads = False
        self._weights_version = 0  # bumped whenever the trainable weights change
        self._merged: _MergedSampler | None = None
        self._cast_view: _CastSampler | None = None  # full fine-tuning in mixed precision
        self.stats = BackendStats()
        self.engine = self.make_engine(
            self.sampling_model, lambda: self._weights_version, self._executor, lambda: self._waiting_jobs > 0
        )
        self._sampler = LocalSamplingClient(self, gather_ms=gather_ms, engine=self.engine)

    def _load_tokenizer(self, attn_implementation: str | None) -> dict[str, str]:
        """Load ``self.tokenizer`` from the model path; the keyword arguments that load the model too."""
        looks_local = self.model_path.startswith(("/", ".", "~")) or bool(self.gguf_file)
        if looks_local and not Path(self.model_path).expanduser().exists():
            raise FileNotFoundError(f"model path {self.model_path} does not exist")
        load_kwargs: dict[str, str] = {"gguf_file": self.gguf_file} if self.gguf_file else {}
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, **load_kwargs)
        if attn_implementation:
            load_kwargs["attn_implementation"] = attn_implementation
        return load_kwargs

    def _load_model(self, load_kwargs: dict[str, str], seed: int, shared_base: torch.nn.Module | None) -> Any:
        """The weights on ``self.device``, wrapped in a LoRA adapter when one is configured. With
        ``shared_base``, a copy of its module tree whose every parameter and buffer *is* the base's (no
        weight is copied), so many clients cost one base plus their adapters.

        Returns ``Any``: transformers / PEFT model classes vary by architecture and wrapping.
        """
        torch.manual_seed(seed)
        model: Any
        if shared_base is not None:
            model = share_module(shared_base)
            base_dtype = next(shared_base.parameters()).dtype
            self.precision = Precision(base_dtype, "the shared base's dtype")
        else:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=load_dtype(self.dtype_setting, self.device), **load_kwargs
            )
            if self.gguf_file:
                _forget_gguf_quantization(model)
            self.precision = resolve_precision(self.dtype_setting, self.device, hidden_size(model.config))
            if self.precision.mixed and self.lora is not None:
                cast_parameters(model, self.precision.compute)  # the frozen base: its own compute copy
            model.to(self.device)
        if self.lora is None:
            return model
        from peft import LoraConfig, get_peft_model  # deferred: needed with LoRA only, slow to import

        torch.manual_seed(seed)  # LoRA A matrices are random: make them a function of the seed
        peft_cfg = LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, peft_cfg)

    def _worker_thread(self, name: str) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=name,
            initializer=torch.set_num_threads,
            initargs=(self.num_threads,),
        )

    def set_num_threads(self, threads: int) -> None:
        """Run this client's forwards (sampling and training) on ``threads`` torch threads from now on."""
        self.num_threads = int(threads)
        torch.set_num_threads(self.num_threads)
        workers = [w for w in (self._executor, self._frozen_thread) if w is not None]
        for worker in workers:
            worker.submit(torch.set_num_threads, self.num_threads).result()

    def make_engine(
        self,
        model_fn: Callable[[], torch.nn.Module],
        tag_fn: Callable[[], Hashable],
        executor: Executor,
        should_yield: Callable[[], bool] = lambda: False,
        stats: BackendStats | None = None,
        select_adapters: Callable[[list[Hashable]], None] | None = None,
    ) -> ContinuousGenerator:
        """A generation engine of this client's tokenizer and limits with a prefix cache of its own
        (counting into ``stats``, default this client's; ``select_adapters``: see ``ContinuousGenerator``)."""
        return ContinuousGenerator(
            model_fn=model_fn,
            tag_fn=tag_fn,
            tokenizer=self.tokenizer,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            max_context=self.max_context,
            device=self.device,
            batch_limit=self.sample_batch_size,
            cache=PrefixCache(self.prefix_cache_bytes),
            executor=executor,
            stats=self.stats if stats is None else stats,
            should_yield=should_yield,
            select_adapters=select_adapters,
        )

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a sequence (benches clear them to sample fixed lengths)."""
        return self._eos_id_set

    @eos_ids.setter
    def eos_ids(self, value: set[int]) -> None:
        self._eos_id_set = set(value)
        if getattr(self, "engine", None) is not None:
            self.engine.eos_ids = self._eos_id_set

    @property
    def prefix_cache(self) -> PrefixCache:
        """The live sampler's prefix cache (``retool.backends.engine.prefix_cache``)."""
        return self.engine.cache

    @property
    def share_prompt_prefix(self) -> bool:
        """Whether the common prefix of sequences admitted together is run once (off only to compare)."""
        return self.engine.share_prefix

    @share_prompt_prefix.setter
    def share_prompt_prefix(self, value: bool) -> None:
        self.engine.share_prefix = bool(value)

    def mark_weights_changed(self) -> None:
        """Declare that the weights were changed from outside the client's own calls (a test or a bench
        writing parameters): the merged sampling view is rebuilt and the prefix cache emptied."""
        self._weights_version += 1

    def _on_new_weights(self) -> None:
        """Worker thread, after an optimizer step or a state load: a new weights version, and the live
        sampler's cache freed at once (its entries can never serve again; no job runs meanwhile)."""
        self._weights_version += 1
        self.engine.cache.clear()

    async def _on_worker(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run ``fn(*args)`` on the worker thread; the sampler admits no new sequences while it waits
        (until it starts, or until the call is cancelled before starting)."""
        waiting = [True]

        def release() -> None:
            with self._waiting_lock:
                if waiting[0]:
                    waiting[0] = False
                    self._waiting_jobs -= 1

        def run() -> T:
            release()
            return fn(*args)

        with self._waiting_lock:
            self._waiting_jobs += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, run)
        future.add_done_callback(lambda _: release())
        return await future

    # -- helpers -------------------------------------------------------------------------------
    def _base_config(self) -> Any:
        return self.model.config

    def _pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update(int(v) for v in (value if isinstance(value, list | tuple) else [value]))
        im_end = (
            self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            if hasattr(self.tokenizer, "convert_tokens_to_ids")
            else None
        )
        if isinstance(im_end, int) and im_end != getattr(self.tokenizer, "unk_token_id", None):
            ids.add(im_end)
        return ids

    @property
    def precision_mismatch(self) -> str | None:
        """Mixed precision (``retool.backends.local.precision``): the sampler computes in bf16, the
        trainer under autocast over fp32 masters, so their logprobs differ on the same weights."""
        if not self.precision.mixed:
            return None
        return f"the sampler computes in bf16, the trainer under bf16 autocast over fp32 masters ({self.precision.reason})"

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())

    def _sequence_seeds(self, seed: int | None, num_samples: int) -> list[int]:
        if seed is None:
            return [self._seed_rng.getrandbits(63) for _ in range(num_samples)]
        # Distinct, reproducible streams for sample i of a seeded request.
        return [(int(seed) * 1_000_003 + i) % (2**63) for i in range(num_samples)]

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(
                f"{what} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )

    def _check_sample_request(self, prompt: list[int], num_samples: int, params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt_tokens is empty")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if params.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {params.max_tokens}")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"bad sampling params: temperature {params.temperature}, top_p {params.top_p}")
        self._check_tokens(prompt, "prompt_tokens")
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in a {self.max_context}-token context"
            )

    # -- sampling ------------------------------------------------------------------------------
    def sampling_model(self) -> Any:  # a transformers / PEFT model (class varies; callers save it too)
        """The module generation runs on: the trainer's model, or its merged LoRA-free view (see the
        module docstring), brought up to date with the current weights."""
        if self.lora is None and self.precision.mixed:
            if self._cast_view is None:
                self._cast_view = _CastSampler(self.model, self.dtype)
            self._cast_view.refresh(self._weights_version)
            return self._cast_view.model
        if self.lora is None or not self.merge_lora_for_sampling:
            return self.model
        if self._merged is None:
            self._merged = _MergedSampler.build(self.model)
            if self._merged is None:  # adapter layout it cannot merge: sample through the wrapper
                logger.warning("LoRA layers of this model cannot be merged for sampling; using the wrapper")
                self.merge_lora_for_sampling = False
                return self.model
        self._merged.refresh(self._weights_version)
        return self._merged.model

    async def sampling_client_async(self) -> SamplingClient:
        refresh = getattr(self._sampler, "refresh", None)
        if refresh is not None:  # an external engine (vLLM) needs the current weights handed over
            await self._on_worker(refresh)
        return self._sampler

    async def frozen_sampling_client_async(self) -> SamplingClient:
        """A sampler over a frozen copy of the current weights that generates on a thread of its own, so
        training goes on meanwhile (off-policy pipelining; ``FrozenSamplingClient``)."""
        if getattr(self._sampler, "refresh", None) is not None:
            raise NotImplementedError(
                "an external sampling engine (vLLM, llama.cpp) holds one set of weights and cannot sample from a frozen "
                "version while training goes on; use backend.sampler = 'hf' or train.max_steps_off_policy = 0"
            )
        model = await self._on_worker(frozen_copy, self.model, self.dtype if self.precision.mixed else None)
        if self._frozen_thread is None:
            self._frozen_thread = self._worker_thread("retool-frozen")
        return FrozenSamplingClient(self, model, self._frozen_thread, self._gather_ms)

    def set_sampler(self, sampler: LocalSamplingClient) -> None:
        """Replace the built-in sampler (e.g. by ``VllmSamplingClient``); it may define ``refresh()`` and
        ``close()``."""
        self._sampler = sampler

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        """Convenience: sample from the current weights (same as ``sampling_client().sample_async``)."""
        return await self._sampler.sample_async(prompt_tokens, num_samples, params)

    def sample(self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams) -> list[Sample]:
        return self._sampler.sample(prompt_tokens, num_samples, params)

    # -- training ------------------------------------------------------------------------------
    def _validate_datums(self, datums: Sequence[Datum], loss_fn: str) -> None:
        if loss_fn not in LOSS_NAMES:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; known: {', '.join(LOSS_NAMES)}")
        for k, d in enumerate(datums):
            if len(d) == 0:
                raise ValueError(f"datum {k} is empty")
            if loss_fn != "cross_entropy" and (len(d.logprobs) != len(d) or len(d.advantages) != len(d)):
                raise ValueError(
                    f"datum {k}: loss {loss_fn!r} needs logprobs and advantages for every position"
                )
            self._check_tokens(d.input_tokens, f"datum {k} input_tokens")
            self._check_tokens(d.target_tokens, f"datum {k} target_tokens")

    def _micro_batch_tensors(self, datums: Sequence[Datum], rows: list[int]) -> dict[str, torch.Tensor]:
        width = max(len(datums[i]) for i in rows)
        shape = (len(rows), width)
        ids = torch.full(shape, self.pad_id, dtype=torch.long)
        tgt = torch.zeros(shape, dtype=torch.long)
        mask = torch.zeros(shape, dtype=torch.long)
        w = torch.zeros(shape, dtype=torch.float32)
        old = torch.zeros(shape, dtype=torch.float32)
        adv = torch.zeros(shape, dtype=torch.float32)
        ratio_mask: torch.Tensor | None = None
        if any(datums[i].ratio_mask for i in rows):
            # A row without a mask of its own averages over its trained positions (the loss's default).
            ratio_mask = torch.zeros(shape, dtype=torch.float32)
        for r, i in enumerate(rows):
            d = datums[i]
            n = len(d)
            ids[r, :n] = torch.tensor(d.input_tokens, dtype=torch.long)
            tgt[r, :n] = torch.tensor(d.target_tokens, dtype=torch.long)
            mask[r, :n] = 1
            w[r, :n] = torch.tensor(d.weights, dtype=torch.float32) if d.weights else 1.0
            if d.logprobs:
                old[r, :n] = torch.tensor(d.logprobs, dtype=torch.float32)
            if d.advantages:
                adv[r, :n] = torch.tensor(d.advantages, dtype=torch.float32)
            if ratio_mask is not None:
                ratio_mask[r, :n] = (
                    torch.tensor(d.ratio_mask, dtype=torch.float32) if d.ratio_mask else w[r, :n]
                )
        out = {"ids": ids, "tgt": tgt, "mask": mask, "w": w, "old": old, "adv": adv}
        if ratio_mask is not None:
            out["ratio_mask"] = ratio_mask
        return {k: v.to(self.device) for k, v in out.items()}

    def target_logprobs(
        self, ids: torch.Tensor, mask: torch.Tensor, tgt: torch.Tensor, shared: int = 0
    ) -> torch.Tensor:
        """Float32 logprob of each target token under the current weights (with grad if enabled); the
        first ``shared`` input positions, the same in every row, run once (``local.shared_prefix``)."""
        return target_logprobs(self.model, ids, mask, tgt, shared)

    def _forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None, backward: bool
    ) -> ForwardBackwardResult:
        t0 = time.perf_counter()
        if backward and self.shares_base and self.lora is None:
            raise ValueError(
                "this client shares its base weights with others and has no LoRA: it cannot train"
            )
        self._validate_datums(datums, loss_fn)
        self.model.train()
        run = self._run_datums(datums, loss_fn, loss_config, backward)
        if backward:
            self._pending_grads = True
        lengths = [len(d) for d in datums]
        padded = sum(len(rows) * max(lengths[i] for i in rows) for rows in run.batches)
        self.stats.add_training(sum(lengths), padded, time.perf_counter() - t0, backward)
        tally = run.tally
        result = tally.result(
            {
                "micro_batches": float(len(run.batches)),
                "padding_efficiency": padding_efficiency(lengths, run.batches),
                "logprob_mean": run.lp_sum / tally.trained if tally.trained else 0.0,
            }
        )
        result.token_logprobs = run.token_logprobs
        return result

    def _run_datums(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None, backward: bool
    ) -> DatumsPass:
        """Forward (and backward, accumulating gradients) over ``datums`` in micro-batches; what it
        measured. ``retool.backends.local.data_parallel`` splits a call's datums between processes here."""
        lengths = [len(d) for d in datums]
        start = time.thread_time()
        run = DatumsPass(
            LossTally(),
            0.0,
            [[] for _ in datums],
            pack_micro_batches(lengths, self.micro_batch_tokens, self.micro_batch_overhead or None),
        )
        for rows in run.batches:
            t = self._micro_batch_tensors(datums, rows)
            shared = shared_input_prefix(datums, rows) if self.share_train_prefix else 0
            cast = self.train_autocast or (self.dtype if self.precision.mixed else None)
            autocast = torch.autocast(self.device.type, dtype=cast or self.dtype, enabled=cast is not None)
            with torch.set_grad_enabled(backward), autocast:
                lp = self.target_logprobs(t["ids"], t["mask"], t["tgt"], shared)
                tl = token_loss(loss_fn, lp, t["w"], t["old"], t["adv"], loss_config, t.get("ratio_mask"))
                if backward:
                    tl.loss.sum().backward()
            sel = run.tally.add(tl)
            run.lp_sum += float(lp.detach()[sel].sum())
            rows_lp = lp.detach().float().cpu()
            for r, i in enumerate(rows):
                run.token_logprobs[i] = rows_lp[r, : lengths[i]].tolist()
        run.seconds = time.thread_time() - start
        return run

    async def forward_backward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        result: ForwardBackwardResult = await self._on_worker(
            self._forward_backward, list(datums), loss_fn, loss_config, True
        )
        return result

    async def forward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        """Loss and metrics without accumulating gradients (evaluation, resume checks)."""
        result: ForwardBackwardResult = await self._on_worker(
            self._forward_backward, list(datums), loss_fn, loss_config, False
        )
        return result

    def forward(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        return run_sync(self.forward_async(datums, loss_fn, loss_config))

    def _ensure_optimizer(self, adam: AdamParams) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.trainable_parameters(),
                lr=adam.lr,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
                # One kernel for all parameters on CPU: 3x faster than torch's per-parameter loop there
                # (0.45M parameters: 2.4 -> 0.8 ms a step with the clip); elsewhere torch's default.
                fused=True if self.device.type == "cpu" else None,
            )
        return self.optimizer

    def _optim_step(self, adam: AdamParams) -> OptimStepResult:
        opt = self._ensure_optimizer(adam)
        for group in opt.param_groups:  # the loop may change hyperparameters (lr schedules) every step
            group["lr"] = adam.lr
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
        params = self.trainable_parameters()
        if not self._pending_grads:
            logger.warning("optim_step without a forward_backward since the last step: no update")
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        grads = [p for p in params if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._pending_grads = False
        self._on_new_weights()
        self.step += 1
        return OptimStepResult(grad_norm=grad_norm, lr=adam.lr)

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        result: OptimStepResult = await self._on_worker(self._optim_step, adam)
        return result

    def _zero_grad(self) -> None:
        for p in self.trainable_parameters():
            p.grad = None
        self._pending_grads = False

    async def zero_grad_async(self) -> None:
        """Discard the gradient accumulated since the last ``optim_step`` (the guard of
        ``retool.backends.remote.guarded`` replays a step's ``forward_backward`` calls after it). Queued on the
        worker thread, so it runs after any call still in flight there."""
        await self._on_worker(self._zero_grad)

    # -- checkpoints ---------------------------------------------------------------------------
    def _state_path(self, name: str) -> Path:
        path = Path(name)
        if path.is_absolute() or len(path.parts) > 1:
            return path
        return self.checkpoint_dir / name

    def _save_state(self, name: str) -> str:
        folder = self._state_path(name)
        folder.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            # PEFT's own format (adapter_config.json + adapter_model.safetensors): vLLM can load it as is.
            self.model.save_pretrained(folder)
        else:
            save_model(self.model, str(folder / FULL_WEIGHTS_FILE))
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        rng: dict[str, object] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "sampler_seeds": self._seed_rng.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, folder / RNG_FILE)
        meta = {
            "step": self.step,
            "model_path": self.model_path,
            "gguf_file": self.gguf_file,
            "lora": None
            if self.lora is None
            else {**vars(self.lora), "target_modules": list(self.lora.target_modules)},
            "has_optimizer": self.optimizer is not None,
        }
        (folder / BACKEND_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        logger.info("saved state (step %d) to %s", self.step, folder)
        return str(folder)

    def _load_state(self, path: str) -> None:
        folder = Path(path)
        meta_path = folder / BACKEND_META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{folder} is not a saved state (no {BACKEND_META_FILE})")
        meta = json.loads(meta_path.read_text())
        mine = (
            None
            if self.lora is None
            else {**vars(self.lora), "target_modules": list(self.lora.target_modules)}
        )
        if meta.get("lora") != mine:
            raise ValueError(
                f"state {folder} was saved with lora={meta.get('lora')}, this client has lora={mine}"
            )
        if self.lora is not None:
            from peft import set_peft_model_state_dict  # deferred: LoRA only

            weights = load_file(str(folder / ADAPTER_WEIGHTS_FILE), device=str(self.device))
            result = set_peft_model_state_dict(self.model, weights)
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"adapter in {folder} has unexpected keys: {unexpected[:5]}")
        else:
            load_model(self.model, str(folder / FULL_WEIGHTS_FILE), device=str(self.device))
        if meta.get("has_optimizer"):
            state = torch.load(folder / OPTIMIZER_FILE, map_location=self.device, weights_only=False)
            opt = self._ensure_optimizer(AdamParams())
            opt.load_state_dict(state)
        rng = torch.load(folder / RNG_FILE, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        self._seed_rng.setstate(rng["sampler_seeds"])
        if "numpy" in rng:
            np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step = int(meta["step"])
        self._on_new_weights()
        if self.model.training is False:
            self.model.train()
        for p in self.trainable_parameters():
            p.grad = None
        self._pending_grads = False
        logger.info("loaded state (step %d) from %s", self.step, folder)

    async def save_state_async(self, name: str) -> str:
        folder: str = await self._on_worker(self._save_state, name)
        return folder

    async def load_state_async(self, path: str) -> None:
        await self._on_worker(self._load_state, path)

    async def close_async(self) -> None:
        self._executor.shutdown(wait=True)
        if self._frozen_thread is not None:
            self._frozen_thread.shutdown(wait=True)
        close = getattr(self._sampler, "close", None)
        if close is not None:  # an external engine (llama.cpp) holds threads and a loaded model
            close()
