"""GGUF files for llama.cpp (and so Ollama) from a Hugging Face causal LM: the Llama family (SmolLM2 is one)
and Qwen2, in f32, f16 or q8_0, with the byte-level BPE tokenizer and the chat template as metadata.

Owns the layout, after llama.cpp's ``convert_hf_to_gguf.py``, which is what llama.cpp loads and what
transformers' GGUF loader (``load_gguf_checkpoint``) maps back:

- tensors renamed through gguf-py's ``get_tensor_name_map`` (``token_embd``, ``blk.N.attn_q`` ...);
  ``output.weight`` left out when the embeddings are tied; the Llama architecture's q/k projection rows
  permuted for llama.cpp's RoPE layout (``permute_rows``, the llama.cpp sampler's), Qwen2's not;
- 1-D tensors (norms, biases) always f32; the others in the type asked for; a q8_0 tensor whose rows are
  not whole 32-value blocks falls back to f16, as the converter does;
- the tokenizer: ``tokenizer.ggml.model = gpt2`` (byte-level BPE), the tokens in id order (added tokens as
  their raw text: CONTROL when special, USER_DEFINED otherwise, so llama.cpp keeps them whole), the merges,
  the special ids, whether a BOS is added, the chat template, and ``tokenizer.ggml.pre``: the name of
  llama.cpp's pre-tokenizer regex, read off the tokenizer's own pre-tokenizer (``pre_tokenizer_name``). A
  wrong one would split text into other pieces than the model was trained on, so one not known here is
  refused rather than guessed.

SentencePiece tokenizers (Llama 2, TinyLlama) and other architectures are refused with an ``ExportError``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from retool.export.errors import ExportError

if TYPE_CHECKING:  # the names only: gguf and transformers are imported where an export runs
    from collections.abc import Iterator

    from gguf import GGUFWriter
    from transformers import (
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType): the loader adds CONTROL tokens as special tokens and
# USER_DEFINED ones as plain added tokens, matching how the HF tokenizer treats them; UNUSED pads.
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5

GGUF_TYPES = ("f16", "q8_0", "f32")


@dataclass(frozen=True)
class _Arch:
    name: str  # gguf.MODEL_ARCH_NAMES' spelling: general.architecture
    permute_qk: bool  # llama.cpp's Llama loader expects q/k rows in its RoPE order


ARCHITECTURES = {"llama": _Arch("llama", True), "qwen2": _Arch("qwen2", False)}

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# HF pre-tokenizer regex -> llama.cpp's pre-tokenizer name (llama-vocab.cpp's ``tokenizer_pre``).
_SPLIT_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}


def gguf_architecture(config: PretrainedConfig) -> str:
    """The GGUF architecture of an HF config (``llama``, ``qwen2``); an ``ExportError`` for any other."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ExportError(
            f"GGUF export writes the {known} architectures (SmolLM2 is llama), not {model_type!r}; "
            "export hf instead and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    return ARCHITECTURES[model_type].name


def pre_tokenizer_name(pre_tokenizer: object) -> str:
    """llama.cpp's name for the regex a byte-level tokenizer splits text with, from the ``pre_tokenizer``
    of its ``tokenizer.json``: GPT-2's (``gpt-2``), GPT-2's after single digits (``smollm``: SmolLM2's, and
    the tiny model's), Qwen2's or Llama 3's ``Split``. An ``ExportError`` for any other."""
    parts = _pre_tokenizer_parts(pre_tokenizer)
    kinds = [p.get("type") for p in parts]
    byte_level_regex = bool(parts) and parts[-1].get("use_regex", True) is not False
    if kinds == ["ByteLevel"] and byte_level_regex:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and byte_level_regex:
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not byte_level_regex:
        pattern = parts[0].get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if isinstance(regex, str) and regex in _SPLIT_REGEXES:
            return _SPLIT_REGEXES[regex]
    raise ExportError(
        f"GGUF export: the tokenizer's pre-tokenizer ({json.dumps(pre_tokenizer)[:200]}) is not one this "
        "exporter maps to llama.cpp's (GPT-2, SmolLM2, Qwen2, Llama 3): export hf and convert it with "
        "llama.cpp's convert_hf_to_gguf.py"
    )


def _pre_tokenizer_parts(pre_tokenizer: object) -> list[dict[str, object]]:
    """The steps of a ``tokenizer.json`` pre-tokenizer (a ``Sequence``'s members, or itself)."""
    if not isinstance(pre_tokenizer, dict):
        return []
    if pre_tokenizer.get("type") != "Sequence":
        return [pre_tokenizer]
    members = pre_tokenizer.get("pretokenizers")
    return [p for p in members if isinstance(p, dict)] if isinstance(members, list) else []


def _byte_alphabet() -> list[str]:
    # deferred: transformers (~3 s), for exports only
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


@dataclass(frozen=True)
class Vocabulary:
    """What the GGUF's ``tokenizer.ggml.*`` keys hold."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str


def tokenizer_metadata(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> Vocabulary:
    """Tokens in id order (padded to the model's ``vocab_size`` rows), their types, the BPE merges and the
    pre-tokenizer name of a byte-level BPE fast tokenizer."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(
            f"GGUF export writes byte-level BPE tokenizers (Qwen2, SmolLM2, Llama 3), not this "
            f"{model.get('type')} one (byte_fallback={model.get('byte_fallback')}): export hf instead"
        )
    size = len(tokenizer)
    if size > vocab_size:
        raise ExportError(f"the tokenizer has {size} tokens but the model's embedding only {vocab_size} rows")
    tokens: list[str | None] = [None] * size
    types = [_NORMAL] * size
    for token, index in model["vocab"].items():
        tokens[index] = token
    for added in state.get("added_tokens", []):
        index = int(added["id"])
        tokens[index] = added["content"]
        types[index] = _CONTROL if added.get("special") else _USER_DEFINED
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise ExportError(f"the tokenizer has no token for ids {missing[:10]} (its vocabulary has gaps)")
    # Embedding rows beyond the tokenizer (Qwen2.5 rounds its vocabulary up): named pad tokens, as the
    # converter writes them, so ids and rows stay aligned.
    names = [str(t) for t in tokens] + [f"[PAD{i}]" for i in range(size, vocab_size)]
    types += [_UNUSED] * (vocab_size - size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    _warn_lost_added_tokens(names, types)
    return Vocabulary(names, types, merges, pre_tokenizer_name(state.get("pre_tokenizer")))


def _warn_lost_added_tokens(tokens: list[str], types: list[int]) -> None:
    """llama.cpp stores added tokens as raw text. transformers' GGUF tokenizer builder re-adds a
    user-defined one only when its text is spelled in the byte-level alphabet, so one with a space (the
    demo's phrase tokens) comes back from transformers as ordinary BPE pieces: the model then sees other
    ids. (llama.cpp itself keeps them whole.)"""
    alphabet = set(_byte_alphabet())
    lost = [
        tokens[i]
        for i, kind in enumerate(types)
        if kind == _USER_DEFINED and not set(str(tokens[i])) <= alphabet
    ]
    if lost:
        logger.warning(
            "%d added tokens will not stay whole when transformers loads this GGUF (e.g. %r); "
            "text containing them tokenizes differently there than in the HF folder",
            len(lost),
            lost[0],
        )


def write_gguf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_file: str | Path,
    gguf_type: str = "f16",
    *,
    name: str | None = None,
    license_id: str | None = None,
) -> Path:
    """Write ``model`` (an HF Llama or Qwen2 causal LM, any float dtype) and its byte-level BPE
    ``tokenizer`` to ``out_file`` (``.gguf``) as ``gguf_type`` (f16, q8_0 or f32).

    A GGUF file is one writer filled in order, the format's own checklist: architecture keys, tokenizer
    and chat template, tensors.
    """
    import gguf  # deferred: gguf is optional (the gguf extra)
    from transformers import PreTrainedTokenizerFast  # deferred: transformers (~3 s), for exports only

    out = Path(out_file)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ExportError(
            f"GGUF export reads a fast (tokenizers) tokenizer, not a {type(tokenizer).__name__}"
        )
    if out.suffix != ".gguf":
        raise ExportError(f"a GGUF file's name ends in .gguf, not {out.name!r}")
    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"unknown GGUF type {gguf_type!r}; choose one of {', '.join(GGUF_TYPES)}")
    config = model.config
    arch = gguf_architecture(config)
    meta = tokenizer_metadata(tokenizer, int(config.vocab_size))
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}[gguf_type]
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or out.stem)
    if license_id:
        writer.add_license(license_id)
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    if gguf_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_architecture(writer, config)
    _add_tokenizer(writer, tokenizer, meta)
    for tensor_name, data in _tensors(model, arch):
        _add_tensor(writer, tensor_name, data, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("wrote %s (%s, %s, %d tokens)", out, arch, gguf_type, len(meta.tokens))
    return out


def write_gguf_from_folder(model_dir: str | Path, out_file: str | Path, gguf_type: str = "f32") -> Path:
    """``write_gguf`` of an HF folder (read in float32): the tests' way to a GGUF of the tiny model."""
    import torch  # deferred: torch and transformers (~3 s), for exports only
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if Path(out_file).suffix != ".gguf":
        raise ExportError(f"a GGUF file's name ends in .gguf, not {Path(out_file).name!r}")
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir} is not a model folder (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return write_gguf(model, tokenizer, out_file, gguf_type, name=model_dir.name)


def _rope_theta(config: PretrainedConfig) -> float:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise ExportError(f"GGUF export writes models without RoPE scaling; this one has {kind!r} scaling")
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _add_architecture(writer: GGUFWriter, config: PretrainedConfig) -> None:
    """The hyper-parameters llama.cpp's Llama and Qwen2 loaders read."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:  # llama.cpp assumes hidden / heads unless told
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config.vocab_size))


def _add_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerFast, meta: Vocabulary) -> None:
    """The byte-level BPE tokenizer, its special ids, whether a BOS is added, and the chat template."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta.pre)
    writer.add_token_list(meta.tokens)
    writer.add_token_types(meta.types)
    writer.add_token_merges(meta.merges)
    for add, token_id in (
        (writer.add_bos_token_id, tokenizer.bos_token_id),
        (writer.add_eos_token_id, tokenizer.eos_token_id),
        (writer.add_pad_token_id, tokenizer.pad_token_id),
    ):
        if token_id is not None:
            add(int(token_id))
    # Left unset, llama.cpp adds a BOS to every BPE prompt: say what the HF tokenizer does.
    bos = tokenizer.bos_token_id
    writer.add_add_bos_token(bos is not None and tokenizer("a")["input_ids"][:1] == [bos])
    writer.add_add_eos_token(False)
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if template:
        writer.add_chat_template(template)


def _tensors(model: PreTrainedModel, arch: str) -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
    """``(gguf name, float32 array)`` of every tensor the GGUF holds, q/k rows permuted for Llama."""
    import gguf  # deferred: gguf is optional (the gguf extra)
    import torch  # deferred: torch, for exports only

    from retool.backends.samplers.llamacpp import permute_rows  # deferred: its module imports torch

    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, int(config.num_hidden_layers))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # an absent output.weight tells the loader the embeddings are tied
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise ExportError(f"GGUF export: no llama.cpp name for the tensor {hf_name}")
        data = tensor.detach().to(torch.float32).cpu().numpy()
        short = base.rsplit(".", 1)[-1]
        if ARCHITECTURES[arch].permute_qk and short in ("q_proj", "k_proj"):
            data = permute_rows(data, heads, heads if short == "q_proj" else kv_heads)
        yield f"{gguf_name}.{suffix}", np.ascontiguousarray(data)


def _add_tensor(writer: GGUFWriter, name: str, data: npt.NDArray[np.float32], gguf_type: str) -> None:
    """One tensor in the type asked for: norms and biases (1-D) stay f32, as in llama.cpp's converter."""
    import gguf  # deferred: gguf is optional (the gguf extra)

    if data.ndim <= 1 or gguf_type == "f32":
        writer.add_tensor(name, data.astype(np.float32))
        return
    if gguf_type == "q8_0":
        try:
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        except gguf.quants.QuantError:  # rows that are not whole 32-value blocks
            logger.warning(
                "%s: rows of %d values are not whole q8_0 blocks; written as f16", name, data.shape[-1]
            )
        else:
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            return
    writer.add_tensor(name, data.astype(np.float16))
