"""The training and sampling state ``retool serve`` holds, independent of which API a request came in by.

- ``ServedModel``: a base model clients may name (``--model NAME=PATH``), with its local path, which is
  also what the server reports as the model's id, so an SDK's ``get_tokenizer()`` loads it offline.
- ``TrainingRun``: one LoRA adapter being trained: its own ``LocalTrainingClient`` (its own adapter and
  optimizer; two runs never share trainable tensors), and a FIFO of calls applied strictly in the order they
  arrived (both SDKs pipeline requests and rely on that order).
- One base, many adapters (``share_base``, the default): each base model's weights are loaded once, frozen,
  and every client on it (training runs, samplers of saved paths, the base sampler) is a module tree over
  those same tensors plus its own LoRA tensors (``retool.backends.local.loading.share_module``), so N clients cost
  the base plus N adapters and optimizer states. Their samplers (a run's saved or temporary weights, saved
  paths, the base) all run on one engine per base model (``retool.backends.samplers.multi_lora``): requests for
  different adapters and the base decode in one batch, each row through its own adapter (no merged copy
  of the adapted weights); ``--base-per-client`` restores a full copy per client, each sampling alone.
- Samplers: a sampler per saved path, built on first use from the files (so paths still load after a
  restart), or, for weights a live run just saved, a frozen copy of that run's adapter that shares the base
  weights. Concurrent ``sample`` calls on one sampler are batched by the local backend's sampler.
- ``ServeState``: the registry of the above, plus ``Storage`` (``retool.serve.storage``) and the limits
  every request is checked against.

Which losses a request may name, and their configs: ``retool.serve.losses``.

Stability info (``stable_reinforce``): a Tinker sample request with ``record_stability_info`` records, per
returned ``sequence_id``, its prompt, sampled tokens and the sampler's logprobs (``StabilityRecords``:
session-scoped, kept a day after last use, bounded in tokens). A training datum names them through its
provenance spans; the server checks each span's tokens against the record and trains the sampled positions
against the *recorded* logprobs.

Long because ``ServeState`` is the one registry both wire APIs read and change (runs, samplers, shared
bases, stability records, limits) under one set of locks and one call order; what it does not hold (the
loss checks, each API's wire format) lives in ``losses``, ``common`` and the API modules.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    Sample,
    SamplingParams,
)
from retool.config import Config
from retool.serve.storage import CheckpointMeta, LoraRequest, Storage, StorageError, new_id

if TYPE_CHECKING:  # deferred: backends.local imports torch; only its types are named here
    import torch

    from retool.backends.local.client import LocalTrainingClient
    from retool.backends.local.loading import LocalLoraSpec
    from retool.backends.samplers.multi_lora import MultiLoraEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ServeError(Exception):
    """A request the server refuses; ``status`` is the HTTP status, ``code`` a short machine-readable name."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask for (the HTTP body size is bounded in ``retool.serve.app``)."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_num_samples: int = 128
    max_datums: int = 4096
    max_tokens_per_call: int = 1 << 21
    max_wait_seconds: float = 30.0  # longest a poll (Tinker futures, PyTRIO events) is held open
    # How long a sampler waits for concurrent requests to join a batch. Requests over HTTP arrive more
    # spread out than coroutines in one process, so the server waits longer than the local backend (5 ms);
    # on the 2-core VM, 8 raw-HTTP clients sampled ~1.5x more tokens/s at 10 ms than at 5 ms.
    gather_ms: float = 10.0


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: str
    max_context: int
    vocab_size: int


@dataclass
class TrainingRun:
    """One LoRA adapter on one base model, trained by one client (see the module docstring)."""

    run_id: str
    model: ServedModel
    lora: LoraRequest
    client: LocalTrainingClient | None = None  # built on first use (loading a model takes seconds)
    queue: asyncio.Queue[Callable[[], Awaitable[None]]] = field(default_factory=asyncio.Queue)
    worker: asyncio.Task[None] | None = None
    restore: tuple[str, bool] | None = None  # (checkpoint URI, with optimizer) applied when built
    session: str | None = None  # the session that created it: ending the session frees the run

    def submit(self, call: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """Queue ``call`` behind every call submitted before it; the future resolves with its result."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        async def job() -> None:
            try:
                result = await call()
            except Exception as exc:  # delivered to the caller's future; the run goes on serving
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

        self.queue.put_nowait(job)
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._work(), name=f"run-{self.run_id}")
        return future

    async def _work(self) -> None:
        while not self.queue.empty():
            await self.queue.get_nowait()()


@dataclass(frozen=True)
class StabilityRecord:
    """What one sampled sequence's provenance refers to (see the module docstring); the prompt array is
    shared by every sequence of one request."""

    session: str | None
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32

    @property
    def size(self) -> int:
        return int(self.prompt.size + self.tokens.size)


class StabilityRecords:
    """Recorded sequences by ``sequence_id``, for a day after their last use and at most ``max_tokens``
    prompt + sampled tokens in all (the least recently used go first; a datum naming a forgotten one gets a
    400 that says so). The default bounds the records to ~130 MB even when every prompt is counted anew."""

    def __init__(self, max_tokens: int = 1 << 24, ttl_seconds: float = 86_400.0) -> None:
        self.max_tokens, self.ttl = max_tokens, ttl_seconds
        self.tokens = 0
        self._items: collections.OrderedDict[str, tuple[float, StabilityRecord]] = collections.OrderedDict()

    def add(self, sequence_id: str, record: StabilityRecord) -> None:
        self._drop(sequence_id)
        self._items[sequence_id] = (time.monotonic(), record)
        self.tokens += record.size
        while self.tokens > self.max_tokens and len(self._items) > 1:
            self._drop(next(iter(self._items)))

    def _drop(self, sequence_id: str) -> None:
        gone = self._items.pop(sequence_id, None)
        if gone is not None:
            self.tokens -= gone[1].size

    def get(self, sequence_id: str, session: str | None) -> StabilityRecord:
        known = self._items.get(sequence_id)
        now = time.monotonic()
        if known is None or now - known[0] > self.ttl:
            self._drop(sequence_id)
            raise ServeError(
                400,
                "unknown_sequence",
                f"sequence_id {sequence_id!r} has no recorded stability info on this server (sample with "
                "record_stability_info=True; records last a day after their last use)",
            )
        record = known[1]
        if record.session != session:
            raise ServeError(
                400, "unknown_sequence", f"sequence_id {sequence_id!r} was sampled in another session"
            )
        self._items[sequence_id] = (now, record)  # each use restarts its day
        self._items.move_to_end(sequence_id)
        return record

    def __len__(self) -> int:
        return len(self._items)


class RequestTimers:
    """Where a sample request's time goes on the server, summed per phase since the last reset (served at
    ``GET /retool/timers``; ``bench/serve.py`` reports them per request): ``http <route>`` (the whole
    request, in the ASGI app), ``validate`` (parsing, checks, finding the sampler), ``sample`` (the
    sampler's gathering wait, the engine's queue and the generation), ``serialize`` (the answer's body);
    the engines' inbox waits (``queue``, per row) come from ``ServeState.timings``."""

    def __init__(self) -> None:
        self._phases: dict[str, list[float]] = {}

    def add(self, phase: str, seconds: float) -> None:
        entry = self._phases.setdefault(phase, [0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def report(self, reset: bool = False) -> dict[str, dict[str, float]]:
        out = {k: {"count": v[0], "seconds": v[1]} for k, v in self._phases.items()}
        if reset:
            self._phases.clear()
        return out


class ServeState:
    """Models, runs, samplers and storage of one server (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        models: dict[str, str],
        root: str | Path,
        limits: Limits | None = None,
        share_base: bool = True,
    ) -> None:
        self.config = config
        self.storage = Storage(root)
        self.limits = limits or Limits()
        self.models: dict[str, ServedModel] = {}
        for name, path in models.items():
            self.models[name] = self._describe(name, path)
        self.runs: dict[str, TrainingRun] = {}
        self.aliases: dict[str, TrainingRun] = {}
        self.sessions: set[str] = set()
        self._samplers: collections.OrderedDict[str, tuple[SamplingClient, ServedModel]] = (
            collections.OrderedDict()
        )
        self._sampler_owners: dict[str, LocalTrainingClient] = {}
        self._sampler_locks: dict[str, asyncio.Lock] = {}
        # Temporary sampler weights (PyTRIO's save_weights_and_get_sampling_client): kept in memory only.
        self._ephemeral: collections.OrderedDict[str, tuple[CheckpointMeta, SamplingClient, ServedModel]] = (
            collections.OrderedDict()
        )
        self.ephemeral_size = 16
        self._build_lock = threading.Lock()
        self.sampler_cache_size = 8
        self.stability = StabilityRecords()
        self.timers = RequestTimers()
        self._queue_base: tuple[float, float] = (0, 0.0)  # the engines' queue counters at the last reset
        # One frozen copy of each base model's weights, shared by every client built on it (``share_base``)
        self.share_base = share_base
        self._bases: dict[str, torch.nn.Module] = {}
        # The samplers of each shared base batch together on one engine (``retool.backends.samplers.multi_lora``)
        self._engines: dict[str, MultiLoraEngine] = {}

    # -- models ----------------------------------------------------------------------------------
    @staticmethod
    def _describe(name: str, path: str) -> ServedModel:
        from transformers import AutoConfig, AutoTokenizer  # deferred: transformers is heavy

        folder = Path(path).expanduser().resolve()
        if not folder.exists():
            raise FileNotFoundError(f"model {name}: {folder} does not exist")
        text = str(folder)
        tokenizer = AutoTokenizer.from_pretrained(text)
        config = AutoConfig.from_pretrained(text)
        context = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        vocab = max(int(getattr(config, "vocab_size", 0) or 0), len(tokenizer))
        return ServedModel(name=name, path=text, max_context=context, vocab_size=vocab)

    def model(self, name: str) -> ServedModel:
        """A served model by its name or by its path (clients get the path back as the model id)."""
        for served in self.models.values():
            if name in (served.name, served.path):
                return served
        known = ", ".join(sorted(self.models))
        raise ServeError(404, "unknown_model", f"model {name!r} is not served here; served: {known}")

    # -- runs ------------------------------------------------------------------------------------
    def create_run(self, base_model: str, lora: LoraRequest, session: str | None = None) -> TrainingRun:
        served = self.model(base_model)
        if not 1 <= lora.rank <= 256:
            raise ServeError(400, "invalid_lora", f"LoRA rank must be in [1, 256], got {lora.rank}")
        try:
            lora.target_modules()
        except StorageError as exc:
            raise ServeError(400, "invalid_lora", str(exc)) from None
        run = TrainingRun(new_id("run"), served, lora, session=session)
        self.runs[run.run_id] = run
        return run

    def end_session(self, session: str) -> int:
        """Free the runs a session created (each holds an adapter, or a model copy): new calls to them get 404, calls
        already queued finish first, and their in-memory samplers go; what they saved stays on disk."""
        self.sessions.discard(session)
        ended = [run for run in self.runs.values() if run.session == session]
        for run in ended:
            del self.runs[run.run_id]
            for name in [n for n, r in self.aliases.items() if r is run]:
                del self.aliases[name]
            for cache in (self._samplers, self._ephemeral):
                for key in [k for k in cache if k.startswith(f"{run.run_id}/")]:
                    del cache[key]
            if run.client is not None:
                run.submit(_closer(run.client))
        return len(ended)

    def alias(self, name: str, run: TrainingRun) -> str:
        """Let ``name`` also mean ``run`` (Tinker's SDK computes model ids as ``<session>:train:<n>``)."""
        self.aliases[name] = run
        return name

    def run(self, run_id: str) -> TrainingRun:
        run = (self.runs.get(run_id) or self.aliases.get(run_id)) if isinstance(run_id, str) else None
        if run is None:
            raise ServeError(404, "unknown_run", f"no training run {run_id!r} on this server")
        return run

    def _new_client(self, model: ServedModel, lora: LoraRequest | None) -> LocalTrainingClient:
        """A ``LocalTrainingClient`` on ``model`` (LoRA as asked; ``None``: plain weights, for sampling)."""
        from retool.backends.local.loading import LocalLoraSpec  # deferred: imports torch

        cfg = self.config
        spec = None
        if lora is not None:
            spec = LocalLoraSpec(
                rank=lora.rank,
                alpha=cfg.lora.alpha,
                dropout=cfg.lora.dropout,
                target_modules=lora.target_modules(),
            )
        with self._build_lock:  # transformers' loading patches torch globally: one model load at a time
            return self._build(model, spec, lora)

    def _build(
        self, model: ServedModel, spec: LocalLoraSpec | None, lora: LoraRequest | None
    ) -> LocalTrainingClient:
        from retool.backends.local.client import LocalTrainingClient  # deferred: imports torch
        from retool.backends.local.loading import load_base_model

        cfg = self.config
        base = None
        if self.share_base:
            base = self._bases.get(model.path)
            if base is None:
                base = self._bases[model.path] = load_base_model(
                    model.path, cfg.backend.device, cfg.backend.dtype
                )
        return LocalTrainingClient(
            model.path,
            shared_base=base,
            # The merged sampling view would copy every adapted linear: with a shared base each client
            # samples through its adapter instead, so memory stays base + adapters.
            merge_lora_for_sampling=base is None,
            lora=spec,
            device=cfg.backend.device,
            dtype=cfg.backend.dtype,
            seed=(lora.seed if lora and lora.seed is not None else cfg.train.seed),
            micro_batch_tokens=cfg.backend.micro_batch_tokens,
            sample_batch_size=cfg.backend.sample_batch_size,
            checkpoint_dir=self.storage.root / "checkpoints",
            max_context=cfg.model.max_context,
            num_threads=cfg.backend.cpu_threads or None,
            gather_ms=self.limits.gather_ms,
        )

    async def client(self, run: TrainingRun) -> LocalTrainingClient:
        """The run's local client, built (and restored from its checkpoint, if asked) on first use."""
        if run.client is None:
            run.client = await asyncio.to_thread(self._new_client, run.model, run.lora)
            if run.restore is not None:
                uri, with_optimizer = run.restore
                await self.load_into(run, uri, with_optimizer)
        return run.client

    async def load_into(self, run: TrainingRun, uri: str, with_optimizer: bool) -> None:
        if self._key(uri) in self._ephemeral:
            raise ServeError(
                400, "temporary_weights", f"{uri} holds temporary sampler weights; load a save_state path"
            )
        meta, folder = self.read_checkpoint(uri)
        if meta.base_model != run.model.name or meta.lora.target_modules() != run.lora.target_modules():
            raise ServeError(
                400,
                "checkpoint_mismatch",
                f"{uri} holds a LoRA for {meta.base_model} with {meta.lora}; this run is {run.model.name} "
                f"with {run.lora}",
            )
        if meta.lora.rank != run.lora.rank:
            raise ServeError(
                400, "checkpoint_mismatch", f"{uri} has rank {meta.lora.rank}, run {run.lora.rank}"
            )
        client = await self.client(run)
        await client.load_state_async(str(folder))
        if not with_optimizer:
            client.optimizer = None  # a fresh Adam state, as both SDKs' load_state (without optimizer) say

    def checkpoint_meta(self, uri: str) -> CheckpointMeta:
        """What a checkpoint URI holds (temporary sampler weights included); unknown: 404, malformed: 400."""
        known = self._ephemeral.get(self._key(uri)) if isinstance(uri, str) else None
        return known[0] if known is not None else self.read_checkpoint(uri)[0]

    async def snapshot(self, run: TrainingRun, name: str, scheme: str) -> str:
        """Temporary sampler weights: a frozen copy of the adapter in memory, nothing on disk (a step's
        sampler with a large tied ``lm_head`` would otherwise write the embedding matrix every step)."""
        frozen = await self.frozen_sampler(run)
        uri = self.storage.uri(scheme, run.run_id, "sampler_weights", name)
        meta = CheckpointMeta(run.run_id, "sampler_weights", name, run.model.name, run.lora)
        self._ephemeral[self._key(uri)] = (meta, frozen, run.model)
        while len(self._ephemeral) > self.ephemeral_size:
            self._ephemeral.popitem(last=False)
        return uri

    def read_checkpoint(self, uri: str) -> tuple[CheckpointMeta, Path]:
        try:
            return self.storage.read_meta(uri)
        except StorageError as exc:
            raise ServeError(400, "invalid_path", str(exc)) from None
        except KeyError:
            raise ServeError(404, "unknown_checkpoint", f"no checkpoint {uri!r} on this server") from None

    # -- training calls (run them through ``run.submit`` to keep the client's order) ------------------
    async def forward(
        self, run: TrainingRun, datums: list[Datum], loss_fn: LossName, cfg: dict[str, float], backward: bool
    ) -> ForwardBackwardResult:
        client = await self.client(run)
        if backward:
            result: ForwardBackwardResult = await client.forward_backward_async(datums, loss_fn, cfg)
        else:
            result = await client.forward_async(datums, loss_fn, cfg)
        return result

    async def optim_step(self, run: TrainingRun, adam: AdamParams) -> OptimStepResult:
        client = await self.client(run)
        result: OptimStepResult = await client.optim_step_async(adam)
        return result

    async def save(self, run: TrainingRun, kind: str, name: str, scheme: str, overwrite: bool = True) -> str:
        """Save the run's state under ``kind/name``; return its URI. Sampler weights also get a sampler."""
        folder = self.storage.folder(run.run_id, kind, name)
        if folder.exists() and not overwrite:
            raise ServeError(409, "checkpoint_exists", f"checkpoint {name!r} exists; pass overwrite")
        client = await self.client(run)
        await client.save_state_async(str(folder))
        self.storage.write_meta(CheckpointMeta(run.run_id, kind, name, run.model.name, run.lora))
        uri = self.storage.uri(scheme, run.run_id, kind, name)
        self._samplers.pop(self._key(uri), None)  # an overwritten path must never serve the old weights
        if kind == "sampler_weights":  # the next call is nearly always a sampler on it: skip the reload
            self._remember_sampler(self._key(uri), (await self.frozen_sampler(run), run.model))
        return uri

    # -- sampling --------------------------------------------------------------------------------
    @staticmethod
    def _key(uri: str) -> str:
        """One cache key per checkpoint folder, whichever scheme (and Tinker's ``weights`` alias) named it."""
        parts = uri.split("://", 1)[-1].split("/")
        if len(parts) == 3 and parts[1] == "weights":
            parts[1] = "state"
        return "/".join(parts)

    def _remember_sampler(
        self, key: str, sampler: tuple[SamplingClient, ServedModel], owner: LocalTrainingClient | None = None
    ) -> None:
        self._samplers[key] = sampler
        self._samplers.move_to_end(key)
        if owner is not None:
            self._sampler_owners[key] = owner
        while len(self._samplers) > self.sampler_cache_size:
            old, _ = self._samplers.popitem(last=False)
            evicted = self._sampler_owners.pop(old, None)
            if evicted is not None:  # its worker thread ends once its last batch has run
                threading.Thread(target=evicted.close, name="retool-serve-evict", daemon=True).start()

    async def sampler(
        self, model_path: str | None, base_model: str | None
    ) -> tuple[SamplingClient, ServedModel]:
        """The sampler for saved weights (``model_path``) or for a base model's plain weights."""
        if not model_path and not base_model:
            raise ServeError(400, "invalid_request", "give a model_path or a base_model to sample from")
        key = self._key(model_path) if model_path else f"base:{base_model}"
        temporary = self._ephemeral.get(key)
        if temporary is not None:
            return temporary[1], temporary[2]
        cached = self._samplers.get(key)  # the hot path: no file access per request
        if cached is not None:
            self._samplers.move_to_end(key)
            return cached
        async with self._sampler_locks.setdefault(key, asyncio.Lock()):  # concurrent first uses: one load
            cached = self._samplers.get(key)
            if cached is None:
                sampler, served, owner = await self._load_sampler(model_path, base_model)
                cached = (sampler, served)
                self._remember_sampler(key, cached, owner=owner)
        return cached

    async def _load_sampler(
        self, model_path: str | None, base_model: str | None
    ) -> tuple[SamplingClient, ServedModel, LocalTrainingClient]:
        if model_path:
            meta, folder = self.read_checkpoint(model_path)
            served, lora = self.model(meta.base_model), meta.lora
        else:
            served, lora, folder = self.model(str(base_model)), None, None
        client = await asyncio.to_thread(self._new_client, served, lora)
        if folder is not None:
            await client.load_state_async(str(folder))
        shared = await self._on_engine(served, client, client.model)  # a client that never trains
        return shared or await client.sampling_client_async(), served, client

    async def frozen_sampler(self, run: TrainingRun) -> SamplingClient:
        """A sampler of the run's current weights (a frozen copy of its adapter), on its base's engine."""
        client = await self.client(run)
        frozen = await client.frozen_sampling_client_async()
        model = getattr(frozen, "model", None)
        shared = await self._on_engine(run.model, client, model) if model is not None else None
        return shared or frozen

    async def _on_engine(
        self, served: ServedModel, owner: LocalTrainingClient, model: object
    ) -> SamplingClient | None:
        """A sampler of ``model`` on the shared base's engine (built on first use), or ``None``: no
        shared base, or an adapter the engine cannot run (it then samples alone)."""
        base = self._bases.get(served.path) if self.share_base else None
        if base is None:
            return None
        engine = self._engines.get(served.path)
        if engine is None:
            from retool.backends.samplers.multi_lora import MultiLoraEngine  # deferred: imports torch

            made = await asyncio.to_thread(MultiLoraEngine, base, owner)
            engine = self._engines.setdefault(served.path, made)
        return engine.sampler_for(owner, model)

    def check_sample(
        self, served: ServedModel, prompt: list[int], num_samples: int, params: SamplingParams
    ) -> None:
        """Refuse what the sampler would choke on, with a message the client can act on."""
        lim = self.limits
        if not prompt:
            raise ServeError(400, "invalid_request", "prompt is empty")
        if not 1 <= num_samples <= lim.max_num_samples:
            raise ServeError(400, "invalid_request", f"num_samples must be in [1, {lim.max_num_samples}]")
        context = min(served.max_context, self.config.model.max_context)
        if not 1 <= params.max_tokens <= context:
            raise ServeError(
                400, "invalid_request", f"max_tokens must be in [1, {context}], got {params.max_tokens}"
            )
        if len(prompt) + params.max_tokens > context:
            raise ServeError(
                400,
                "invalid_request",
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > context {context}",
            )
        check_token_ids(prompt, served.vocab_size, "prompt")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ServeError(400, "invalid_request", "temperature must be >= 0 and top_p in (0, 1]")
        stop_ids = [s for s in params.stop if isinstance(s, int)]
        check_token_ids(stop_ids, served.vocab_size, "stop token ids")

    async def prompt_scores(self, sampler: SamplingClient, prompt: list[int]) -> torch.Tensor:
        """The sampler's next-token log-softmax after each prompt prefix (``retool.serve.common``)."""
        score = getattr(sampler, "prompt_logprobs_async", None)
        if score is None:
            raise ServeError(400, "unsupported", "this model's sampler cannot score prompts")
        try:
            scores: torch.Tensor = await score(prompt)
        except ValueError as exc:
            raise ServeError(400, "invalid_request", str(exc)) from None
        return scores

    async def sample(
        self, sampler: SamplingClient, prompt: list[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        t0 = time.perf_counter()
        try:
            return await sampler.sample_async(prompt, num_samples, params)
        except ValueError as exc:
            raise ServeError(400, "invalid_request", str(exc)) from None
        finally:
            self.timers.add("sample", time.perf_counter() - t0)

    def timings(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """``timers``' phases plus the shared engines' inbox waits (``queue``: count = rows admitted)."""
        out = self.timers.report(reset)
        rows = sum(e.engine.admitted_rows for e in self._engines.values())
        seconds = sum(e.engine.queue_seconds for e in self._engines.values())
        base = self._queue_base
        out["queue"] = {"count": rows - base[0], "seconds": seconds - base[1]}
        if reset:
            self._queue_base = (rows, seconds)
        return out

    def check_datums(self, served: ServedModel, datums: list[Datum]) -> None:
        lim = self.limits
        if not 1 <= len(datums) <= lim.max_datums:
            raise ServeError(
                400, "invalid_request", f"a call needs 1 to {lim.max_datums} datums, got {len(datums)}"
            )
        total = sum(len(d) for d in datums)
        if total > lim.max_tokens_per_call:
            raise ServeError(
                413, "too_large", f"{total} tokens in one call; at most {lim.max_tokens_per_call}"
            )
        context = min(served.max_context, self.config.model.max_context)
        for k, d in enumerate(datums):
            if not 1 <= len(d) <= context:
                raise ServeError(
                    400, "invalid_request", f"datum {k} has {len(d)} tokens; context is {context}"
                )
            check_token_ids(d.input_tokens, served.vocab_size, f"datum {k} input tokens")
            check_token_ids(d.target_tokens, served.vocab_size, f"datum {k} target tokens")

    async def close(self) -> None:
        for run in self.runs.values():
            if run.client is not None:
                await run.client.close_async()
        for engine in self._engines.values():
            engine.close()


def _closer(client: LocalTrainingClient) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        await asyncio.to_thread(client.close)

    return close


def check_token_ids(tokens: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ServeError(
            400, "invalid_token", f"{what} hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
