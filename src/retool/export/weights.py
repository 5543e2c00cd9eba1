"""The trained model in memory, and the two Hugging Face formats: a merged model folder (``hf``) and the
LoRA adapter alone (``peft``).

Owns the merge: the base is read in float32 (a GGUF base dequantised), a full fine-tuning's weights are
loaded over it or a LoRA adapter is merged into it with PEFT (``merge_and_unload``: ``W + B A * alpha / r``,
what the trainer's forward computes), and only the written copy is cast to the dtype asked for, so the
weights are rounded once. The GGUF writer reads the same float32 model.

An ``hf`` folder is what ``AutoModelForCausalLM.from_pretrained`` and vLLM load: ``model.safetensors``,
``config.json`` (its dtype), the tokenizer with its chat template, and ``generation_config.json`` whose end
ids include the template's end of turn (``<|im_end|>``), so a plain ``generate`` stops where the trainer's
sampler stops. A ``peft`` folder is the adapter as the trainer saved it (float32) with
``base_model_name_or_path`` naming the base it was trained on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, cast

from retool.backends import check_model_available
from retool.errors import ModelLoadError
from retool.export.errors import ExportError
from retool.export.source import ADAPTER_FILE, Weights

if TYPE_CHECKING:  # the names only: transformers is imported where an export runs
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("bf16", "fp32", "f16")
_TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "f16": "float16"}
ADAPTER_CONFIG = "adapter_config.json"


def load_trained(weights: Weights) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)``: the trained model, merged, in float32 on the CPU, in eval mode."""
    import torch  # deferred: torch, transformers, peft (~4 s), for exports only
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.backends.local.loading import forget_gguf_quantization  # deferred: imports torch

    try:
        check_model_available(weights.base, weights.gguf_file)
    except ModelLoadError as exc:
        raise ExportError(f"the base model the weights were trained on: {exc}") from None
    kwargs = {"gguf_file": weights.gguf_file} if weights.gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(weights.base, **kwargs)
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            weights.base, dtype=torch.float32, **kwargs
        )
    except OSError as exc:  # a Hub id neither cached nor downloadable
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ExportError(f"base model {weights.base!r} cannot be loaded ({first})") from None
    if weights.gguf_file:
        forget_gguf_quantization(model)
    if weights.full is not None:
        load_model(model, str(weights.full))
    if weights.adapter is not None:
        from peft import PeftModel  # deferred: LoRA runs only, slow to import

        model = cast(
            "PreTrainedModel", PeftModel.from_pretrained(model, str(weights.adapter)).merge_and_unload()
        )
    model.eval()
    return model, tokenizer


def end_of_turn_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a reply, as the local backend's sampler has them (``LocalTrainingClient._eos_ids``):
    the model's, its generation config's and the tokenizer's EOS, plus ChatML's ``<|im_end|>``."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, list | tuple) else [value]))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)


def write_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, dtype: str) -> None:
    """The merged model as an HF folder in ``dtype`` (bf16, fp32, f16). Casts ``model`` in place: write
    every float32 format before this one."""
    import torch  # deferred: torch, for exports only

    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    model.to(getattr(torch, _TORCH_DTYPES[dtype]))
    ends = end_of_turn_ids(model, tokenizer)
    if model.generation_config is not None and ends:
        model.generation_config.eos_token_id = ends if len(ends) > 1 else ends[0]
        if tokenizer.pad_token_id is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def base_model_name(weights: Weights) -> str:
    """How an adapter names its base: an absolute path for a local folder (a GGUF base: its folder), else
    the Hub id."""
    path = Path(weights.base).expanduser()
    return str(path.resolve()) if path.exists() else weights.base


def write_peft(adapter: Weights, folder: Path) -> None:
    """The LoRA adapter alone, in PEFT's format, naming its base model."""
    if adapter.adapter is None:
        raise ExportError("no LoRA adapter to write")
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter.adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_model_name(adapter)
    config["inference_mode"] = True
    (folder / ADAPTER_CONFIG).write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    shutil.copyfile(adapter.adapter / ADAPTER_FILE, folder / ADAPTER_FILE)
