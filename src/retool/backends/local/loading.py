"""Where a local client's weights come from: the LoRA settings (``LocalLoraSpec``), the device, dtype and
model path a client is asked for, and the models it loads: its own (``load_model``: from disk, or a
module tree over a shared base, wrapped in a PEFT LoRA adapter when one is configured) and a base shared
by many clients (``load_base_model`` / ``share_module``, as ``retool serve`` runs them).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from retool.backends.local.precision import (
    Precision,
    cast_parameters,
    hidden_size,
    load_dtype,
    resolve_precision,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalLoraSpec:
    """LoRA settings of the local backend (``None`` in place of a spec means full fine-tuning)."""

    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


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


def forget_gguf_quantization(model: Any) -> None:
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


def lora_spec(lora: object) -> LocalLoraSpec | None:
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
        forget_gguf_quantization(model)
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


def load_model(
    model_path: str,
    load_kwargs: dict[str, str],
    *,
    device: torch.device,
    dtype_setting: str,
    lora: LocalLoraSpec | None,
    seed: int,
    shared_base: torch.nn.Module | None,
) -> tuple[Any, Precision]:
    """A client's weights on ``device``, wrapped in a LoRA adapter when ``lora`` is set, and the precision
    they compute in. With ``shared_base``, a copy of its module tree whose every parameter and buffer *is*
    the base's (no weight is copied), so many clients cost one base plus their adapters.

    The model is ``Any``: transformers / PEFT model classes vary by architecture and wrapping.
    """
    torch.manual_seed(seed)
    model: Any
    if shared_base is not None:
        model = share_module(shared_base)
        base_dtype = next(shared_base.parameters()).dtype
        precision = Precision(base_dtype, "the shared base's dtype")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=load_dtype(dtype_setting, device), **load_kwargs
        )
        if "gguf_file" in load_kwargs:  # read from a GGUF file: drop its quantisation marks
            forget_gguf_quantization(model)
        precision = resolve_precision(dtype_setting, device, hidden_size(model.config))
        if precision.mixed and lora is not None:
            cast_parameters(model, precision.compute)  # the frozen base: its own compute copy
        model.to(device)
    if lora is None:
        return model, precision
    from peft import LoraConfig, get_peft_model  # deferred: needed with LoRA only, slow to import

    torch.manual_seed(seed)  # LoRA A matrices are random: make them a function of the seed
    peft_cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg), precision
