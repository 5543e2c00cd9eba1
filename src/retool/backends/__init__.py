"""retool.backends: one Tinker/PyTRIO-shaped training and sampling interface, with three implementations.

- ``local`` (default): transformers + PEFT in this process (``retool.backends.local.client``).
- ``pytrio`` / ``tinker``: thin adapters over the managed services' SDKs (optional installs).

``make_training_client(config)`` picks one from ``config.backend.kind``. Heavy modules (torch,
transformers, the SDKs) are imported only when a client is built. It also owns what the model name
``"tiny"`` means (see ``resolve_model_name``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import constants, try_to_load_from_cache

from retool.backends.interface.clients import SamplingClient, TrainingClient
from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    OptimStepResult,
    Sample,
    SamplingParams,
)
from retool.backends.local.heap import cap_mmap_threshold
from retool.backends.local.tinymodel import build_tiny_model
from retool.errors import ModelLoadError

if TYPE_CHECKING:
    from retool.config import Config

logger = logging.getLogger(__name__)

__all__ = [
    "AdamParams",
    "Datum",
    "ForwardBackwardResult",
    "LocalSamplingClient",
    "LocalTrainingClient",
    "OptimStepResult",
    "PytrioTrainingClient",
    "Sample",
    "SamplingClient",
    "SamplingParams",
    "TinkerTrainingClient",
    "TrainingClient",
    "adam_params_from_config",
    "make_training_client",
    "pack_micro_batches",
]

# Loaded on first use: each of these imports torch (the local backend also transformers and PEFT; the
# remote adapters torch through the loss math), which the rest of the package does not need.
_LAZY = {
    "LocalTrainingClient": "retool.backends.local.client",
    "LocalSamplingClient": "retool.backends.local.sampling_client",
    "PytrioTrainingClient": "retool.backends.remote.pytrio",
    "TinkerTrainingClient": "retool.backends.remote.tinker",
    "pack_micro_batches": "retool.backends.training.packing",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retool.backends' has no attribute {name!r}")


def adam_params_from_config(config: Config) -> AdamParams:
    o = config.optimizer
    return AdamParams(
        lr=o.lr,
        beta1=o.beta1,
        beta2=o.beta2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip_norm=o.grad_clip_norm,
    )


TINY_MODEL = "tiny"
TINY_MODEL_FOLDER = "tiny_model"


def resolve_model_name(config: Config) -> str:
    """The model the local backend loads for ``config.model.name``.

    ``"tiny"`` (the ``tiny`` preset's model) means one thing everywhere: the tiny local model
    (``retool.backends.local.tinymodel``, size ``demo``, seed 0), built on first use into
    ``<train.run_dir>/tiny_model`` and loaded from there afterwards, so ``retool train`` and ``retool eval``
    with the same run folder use the same model. A folder literally named ``tiny`` in the working directory
    wins. Any other name is returned unchanged.
    """
    name = config.model.name
    if name != TINY_MODEL or Path(TINY_MODEL).exists():
        return name
    folder = Path(config.train.run_dir) / TINY_MODEL_FOLDER
    if not (folder / "config.json").is_file():
        logger.info("building the tiny model into %s", folder)
        build_tiny_model(folder, size="demo", seed=0)
    return str(folder)


def _looks_like_path(name: str) -> bool:
    """A name meant as a file or folder rather than a Hub id (``owner/name``)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or name.endswith(".gguf")


def check_model_available(name: str, gguf_file: str | None = None) -> None:
    """Fail in one line, before anything loads, when ``name`` can be neither a local model nor a cached or
    downloadable Hub model: ``ModelLoadError`` (no such path; not in the Hugging Face cache while offline).
    A Hub id counts as cached when its ``config.json`` is (or ``gguf_file``, for a GGUF-only repository)."""
    if Path(name).expanduser().exists():
        return
    if _looks_like_path(name):
        raise ModelLoadError(f"model.name = {name!r}: no such file or folder")

    try:
        cached = try_to_load_from_cache(name, gguf_file or "config.json")
    except ValueError as exc:  # HFValidationError: not a Hub id at all
        raise ModelLoadError(f"model.name = {name!r}: not a local path, nor a Hub id ({exc})") from None
    if not isinstance(cached, str) and constants.HF_HUB_OFFLINE:
        raise ModelLoadError(
            f"model.name = {name!r} is neither a local path nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: download it where the Hub is "
            "reachable (huggingface-cli download NAME), or name a local model folder"
        )


def make_training_client(config: Config) -> TrainingClient:
    """Build the training client that ``config.backend.kind`` names (local / pytrio / tinker)."""
    kind = config.backend.kind
    if kind == "local":
        return _local_client(config)
    if kind == "pytrio":
        from retool.backends.remote.pytrio import PytrioTrainingClient  # deferred: torch (see _LAZY)

        return PytrioTrainingClient.from_config(config)
    if kind == "tinker":
        from retool.backends.remote.tinker import TinkerTrainingClient  # deferred: torch (see _LAZY)

        return TinkerTrainingClient.from_config(config)
    raise ValueError(f"unknown backend kind {kind!r}; use local, pytrio or tinker")


def _local_client(config: Config) -> TrainingClient:
    # deferred: torch, transformers (see _LAZY)
    from retool.backends.local.client import LocalTrainingClient
    from retool.backends.local.data_parallel import DataParallelTrainingClient, resolve_processes

    name = resolve_model_name(config)
    check_model_available(name, config.model.gguf_file)
    cap_mmap_threshold(config.backend.mmap_threshold_mb)  # before the model's first allocations
    processes = resolve_processes(config.backend.processes, config.backend.device)
    # More than one process: the data-parallel client (same keywords; backends.local.data_parallel).
    build: Callable[..., LocalTrainingClient] = LocalTrainingClient
    if processes > 1:
        mmap_mb = config.backend.mmap_threshold_mb  # the replicas cap theirs too
        build = partial(
            DataParallelTrainingClient,
            processes=processes,
            mmap_threshold_mb=mmap_mb,
            sample_on_replicas=config.backend.sample_on_replicas,
        )
    try:
        client = build(
            name,
            lora=config.lora if config.lora.enabled else None,
            device=config.backend.device,
            dtype=config.backend.dtype,
            seed=config.train.seed,
            gguf_file=config.model.gguf_file,
            micro_batch_tokens=config.backend.micro_batch_tokens,
            micro_batch_overhead=config.backend.micro_batch_overhead,
            sample_batch_size=config.backend.sample_batch_size,
            checkpoint_dir=Path(config.train.run_dir) / "checkpoints",
            max_context=config.model.max_context,
            num_threads=config.backend.cpu_threads or None,
            prefix_cache_mb=config.backend.prefix_cache_mb,
            share_train_prefix=config.backend.share_train_prefix,
        )
    except OSError as exc:
        if Path(name).expanduser().exists():  # a local model that fails to load: not a "where is it" error
            raise
        # transformers' OSError for a Hub id it could neither find in the cache nor download.
        raise ModelLoadError(
            f"model.name = {name!r} is neither a local path nor in the Hugging Face cache, and the Hub could "
            f"not provide it ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from exc
    if config.backend.engine == "vllm":
        from retool.backends.samplers.vllm import attach_vllm_sampler  # deferred: vllm is optional

        attach_vllm_sampler(
            client,
            dtype=config.backend.vllm_dtype,
            kv_cache_gib=config.backend.vllm_kv_cache_gib,
            gpu_memory_utilization=config.backend.vllm_gpu_memory_utilization,
        )
    elif config.backend.engine == "llamacpp":
        from retool.backends.samplers.llamacpp import (
            attach_llamacpp_sampler,  # deferred: xllamacpp is optional
        )

        attach_llamacpp_sampler(client, threads=config.backend.llamacpp_threads)
    return client
