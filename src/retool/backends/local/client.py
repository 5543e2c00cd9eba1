"""The default backend: a transformers causal LM trained in this process (CPU or one GPU).

This module owns the training client's API, ``LocalTrainingClient``: the model (optionally wrapped in a
PEFT LoRA adapter), the AdamW optimizer and a single worker thread that runs every forward, backward and
generation, so training and sampling never touch the weights at the same time and the event loop stays
free; how its samplers are wired to the weights; forward/backward and the optimizer step. Its parts
live beside it:

- ``loading``: the LoRA settings (``LocalLoraSpec``), device / dtype / model path, the models it loads;
- ``precision``: the compute dtype (``backend.dtype``) and training autocast (``autocast_dtype``);
- ``sampling_client``: ``LocalSamplingClient`` (a live view of the weights) and ``FrozenSamplingClient``
  (a frozen copy, for off-policy pipelining), and the queue that batches their requests;
- ``sampling_views``: the merged-LoRA and cast copies generation runs on, and the frozen copy;
- ``packed_linear``: prepacked oneDNN linears for CPU generation;
- ``datums_pass``: a pass's micro-batch tensors and what it measured (``DatumsPass``);
- ``checkpoint_io``: the saved state's folder, written and read back;
- ``stats``: what the worker thread did (``BackendStats``).

The sampler's prefix cache (``retool.backends.engine.prefix_cache``, ``prefix_cache_mb``, LRU) lets a
request that extends a sequence already run (a trajectory's next turn, a group's shared prompt) prefill
only its new tokens. The cache is emptied whenever the weights change (``optim_step``, ``load_state``,
``mark_weights_changed``) or the sampling module does (the merged LoRA view switched on or off): KV
computed with old weights never serves a request.

Sampling with LoRA (``merge_lora_for_sampling``, default on) runs on a merged copy of the weights
(``sampling_views.MergedLoraView``), rebuilt lazily after each ``optim_step`` or ``load_state``.

Precision (``dtype``: ``backend.dtype``, resolved once by ``retool.backends.local.precision``): fp32 as
above; in bf16 the trainable tensors and the optimizer state stay fp32 masters, a LoRA run's frozen base is
stored in bf16, training forwards run under ``torch.autocast(bfloat16)`` and the sampler computes in bf16
(the merged view; in full fine-tuning a bf16 copy of the weights, ``sampling_views.CastView``), so sampled
and trained logprobs differ by bf16 rounding on the same weights (``precision_mismatch``: TIS on by
default).

Seeds: unseeded sample requests draw seeds from the client's RNG (seeded by ``seed`` and saved with the
state); see ``sampling_client`` for seeded ones.

Reduction follows Tinker: per-token losses times datum weights are SUMMED over tokens and datums; the
training loop puts its normalisation into the weights. Datums are packed into micro-batches by padded
area (``micro_batch_tokens``), padded on the right with an attention mask; gradients accumulate until
``optim_step`` (AdamW; the grad-norm clip applies to the accumulated gradient). Training forwards run in
train mode, so LoRA dropout > 0 makes the ratio differ from 1 even on-policy.

``save_state`` / ``load_state``: see ``checkpoint_io`` (the next step's loss after a load is bitwise
identical).

Long because ``LocalTrainingClient`` is one class: each public call (the ``TrainingClient`` interface) and
the worker-thread method behind it share the model, the optimizer, the prefix cache and the sampling
views; the parts that stand alone already live in the modules listed above.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import torch
from transformers import AutoTokenizer

from retool.backends.engine.generation import ContinuousGenerator
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
from retool.backends.local.checkpoint_io import load_state_folder, save_state_folder, state_folder
from retool.backends.local.datums_pass import DatumsPass, micro_batch_tensors
from retool.backends.local.loading import (
    LocalLoraSpec,
    load_base_model,
    load_model,
    lora_spec,
    resolve_device,
    resolve_dtype,
    share_module,
    split_model_path,
)
from retool.backends.local.precision import autocast_dtype
from retool.backends.local.sampling_client import FrozenSamplingClient, LocalSamplingClient
from retool.backends.local.sampling_views import CastView, MergedLoraView, frozen_copy
from retool.backends.local.shared_prefix import logprobs_and_entropy, shared_input_prefix, target_logprobs
from retool.backends.local.stats import BackendStats
from retool.backends.training.losses import LOSS_NAMES, LossTally, token_loss, wants_reference
from retool.backends.training.packing import pack_micro_batches, padding_efficiency

# The client, and what tests, benches and docs import from here by its old path (moved to the modules
# above; code in src imports them from where they live).
__all__ = [
    "DEFAULT_PREFIX_CACHE_MB",
    "LocalLoraSpec",
    "LocalTrainingClient",
    "autocast_dtype",
    "load_base_model",
    "resolve_dtype",
    "share_module",
    "split_model_path",
]

logger = logging.getLogger(__name__)

# Default memory cap of the sampler's prefix cache (``backend.prefix_cache_mb``). SmolLM2-135M holds
# ~46 KB of KV per token in fp32, so 1 GiB keeps ~23,000 tokens: a demo step's trajectories.
DEFAULT_PREFIX_CACHE_MB = 1024.0

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def _prefix_cache_bytes(megabytes: float) -> int:
    if megabytes < 0:
        raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the cache off), got {megabytes}")
    return int(megabytes * 2**20)


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
        self.lora = lora_spec(lora)
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
        self.model, self.precision = load_model(
            self.model_path,
            load_kwargs,
            device=self.device,
            dtype_setting=self.dtype_setting,
            lora=self.lora,
            seed=seed,
            shared_base=shared_base,
        )
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
        self._merged: MergedLoraView | None = None
        self._cast_view: CastView | None = None  # full fine-tuning in mixed precision
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

    @property
    def reference_kl_unavailable(self) -> str | None:
        """The reference policy is the LoRA adapter switched off (``disable_adapter``): the run's starting
        policy whenever the adapter starts at zero (PEFT's initialisation) on the model training started
        from. Full fine-tuning keeps no copy of the starting weights, so it has none."""
        if self.lora is None:
            return "full fine-tuning (lora.enabled = false) keeps no copy of the starting weights"
        return None

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
                self._cast_view = CastView(self.model, self.dtype)
            self._cast_view.refresh(self._weights_version)
            return self._cast_view.model
        if self.lora is None or not self.merge_lora_for_sampling:
            return self.model
        if self._merged is None:
            self._merged = MergedLoraView.build(self.model)
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
                "version while training goes on; use backend.engine = 'hf' or train.max_steps_off_policy = 0"
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
        reference = wants_reference(loss_fn, loss_config)
        if reference and self.reference_kl_unavailable is not None:
            raise ValueError(
                f"the loss config asks for the reference policy: {self.reference_kl_unavailable}"
            )
        for rows in run.batches:
            t = micro_batch_tensors(datums, rows, self.pad_id, self.device)
            shared = shared_input_prefix(datums, rows) if self.share_train_prefix else 0
            cast = self.train_autocast or (self.dtype if self.precision.mixed else None)
            autocast = torch.autocast(self.device.type, dtype=cast or self.dtype, enabled=cast is not None)
            with autocast:
                # before the policy's forward, so its activations are freed before the graph is built
                ref_lp = self._reference_logprobs(t, shared) if reference else None
            with torch.set_grad_enabled(backward), autocast:
                lp, entropy = logprobs_and_entropy(
                    self.model, t["ids"], t["mask"], t["tgt"], shared, t["w"] != 0
                )
                tl = token_loss(
                    loss_fn, lp, t["w"], t["old"], t["adv"], loss_config, t.get("ratio_mask"), ref_lp
                )
                if backward:
                    tl.loss.sum().backward()
            sel = run.tally.add(tl)
            assert entropy is not None  # asked for above
            run.tally.add_entropy(entropy, sel)
            run.lp_sum += float(lp.detach()[sel].sum())
            rows_lp = lp.detach().float().cpu()
            for r, i in enumerate(rows):
                run.token_logprobs[i] = rows_lp[r, : lengths[i]].tolist()
        run.seconds = time.thread_time() - start
        return run

    def _reference_logprobs(self, t: dict[str, torch.Tensor], shared: int) -> torch.Tensor:
        """The reference policy's logprob of each target token of a micro-batch: the same forward with the
        LoRA adapter switched off (``reference_kl_unavailable``), without gradient. Its cost is one
        forward of the micro-batch beside the training call's forward and backward: measured on the tiny
        demo model (CPU, one thread, LoRA r8, 64 datums of a few hundred tokens) it made the training call
        about 1.4x as long, so less of a whole step, which sampling adds to. ``train.ref_kl_every`` spaces
        it out; the policy's entropy, from the training forward's own logits, added about 1% there."""
        with torch.no_grad(), self.model.disable_adapter():
            return target_logprobs(self.model, t["ids"], t["mask"], t["tgt"], shared)

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
    def _save_state(self, name: str) -> str:
        folder = state_folder(name, self.checkpoint_dir)
        meta = {"step": self.step, "model_path": self.model_path, "gguf_file": self.gguf_file}
        save_state_folder(
            folder,
            model=self.model,
            lora=self.lora,
            optimizer=self.optimizer,
            seed_rng=self._seed_rng,
            meta=meta,
        )
        logger.info("saved state (step %d) to %s", self.step, folder)
        return str(folder)

    def _load_state(self, path: str) -> None:
        folder = Path(path)
        # A state saved before any optimizer step has no optimizer: loading it must leave none either (a
        # fresh one at the next step), not the moments of the steps taken since.
        self.optimizer = None
        self.step = load_state_folder(
            folder,
            model=self.model,
            lora=self.lora,
            device=self.device,
            make_optimizer=lambda: self._ensure_optimizer(AdamParams()),
            seed_rng=self._seed_rng,
        )
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
