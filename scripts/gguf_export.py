"""Write a GGUF file from a Hugging Face Qwen2 folder (unquantised float32), for the offline GGUF path.

The local backend loads ``model.name = path/to/file.gguf`` through transformers' GGUF support; this
script produces such files from a folder we already have (the tiny model in tests and the demo), so that
path is exercised end to end without downloading anything. It is not a general converter: only the
``qwen2`` architecture, f32 tensors, and a byte-level BPE ("gpt2") tokenizer. A script, not part of the
package: nothing in ``retool`` writes GGUF files (``tests/test_backends_gguf.py`` imports it from here).

Layout follows llama.cpp's ``convert_hf_to_gguf.py`` for Qwen2, which is what transformers' loader
(``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``) maps back: tensors renamed through
gguf-py's ``get_tensor_name_map(MODEL_ARCH.QWEN2, n_layers)`` (``token_embd``, ``blk.N.attn_q`` ...),
no q/k permutation (that is llama-only), ``output.weight`` omitted when embeddings are tied, and the
tokenizer as metadata: ``tokenizer.ggml.{model,pre,tokens,token_type,merges,*_token_id}`` plus
``tokenizer.chat_template``.

Usage: python scripts/gguf_export.py HF_FOLDER OUT.gguf     (needs the gguf extra: pip install -e '.[gguf]')
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType): the loader adds CONTROL tokens as special tokens and
# USER_DEFINED ones as plain added tokens, matching how the HF tokenizer treats them.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import (
        bytes_to_unicode,
    )  # deferred: transformers (~3 s), for exports only

    return list(bytes_to_unicode().values())


def _tokenizer_metadata(tokenizer: Any) -> dict[str, Any]:
    """Tokens in id order, their types and the BPE merges of a byte-level BPE fast tokenizer."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers can be exported, got {model.get('type')!r}")
    size = len(tokenizer)
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
        raise ValueError(f"tokenizer has no token for ids {missing[:10]} (vocabulary is not contiguous)")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    # llama.cpp stores added tokens as raw text. transformers' GGUF tokenizer builder re-adds a
    # user-defined one only when its text is spelled in the byte-level alphabet, so one with a space
    # (the demo's phrase tokens) comes back as ordinary BPE pieces: the model then sees other ids.
    alphabet = set(_byte_alphabet())
    lost = [
        tokens[i]
        for i, kind in enumerate(types)
        if kind == _USER_DEFINED and not set(str(tokens[i])) <= alphabet
    ]
    if lost:
        logger.warning(
            "%d added tokens will not stay whole when transformers loads this GGUF (e.g. %r); "
            "text containing them tokenizes differently than in the HF folder",
            len(lost),
            lost[0],
        )
    return {"tokens": tokens, "types": types, "merges": merges}


def export_qwen2_gguf(model_dir: str | Path, out_file: str | Path) -> Path:
    """Write ``model_dir`` (an HF Qwen2 folder with a fast BPE tokenizer) to ``out_file`` as f32 GGUF.

    A GGUF file is one writer filled in order, the format's own checklist: architecture keys, tokenizer
    and chat template, tensors.
    """
    import gguf  # deferred: gguf is optional (the gguf extra)
    import torch  # deferred: torch and transformers (~3 s), for exports only
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    out = Path(out_file)
    if out.suffix != ".gguf":
        raise ValueError(f"output file must end in .gguf, got {out}")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    if config.model_type != "qwen2":
        raise ValueError(f"only qwen2 models can be exported, {model_dir} is {config.model_type!r}")
    n_layers = int(config.num_hidden_layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])  # "qwen2"
    writer.add_name(model_dir.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_architecture(writer, config)
    n_tokens = _add_tokenizer(writer, tokenizer, int(config.vocab_size))
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # absent output.weight tells the loader the embeddings are tied
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name}")
        data = tensor.detach().to(torch.float32).contiguous().numpy()
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("wrote %s (%d layers, %d tokens)", out, n_layers, n_tokens)
    return out


def _add_architecture(writer: Any, config: Any) -> None:
    """The Qwen2 hyper-parameters llama.cpp reads."""
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_vocab_size(int(config.vocab_size))


def _add_tokenizer(writer: Any, tokenizer: Any, vocab_size: int) -> int:
    """The byte-level BPE tokenizer, its special ids and chat template; returns the number of tokens."""
    meta = _tokenizer_metadata(tokenizer)
    if len(meta["tokens"]) != vocab_size:
        # The loader takes the vocabulary size from the embedding; a mismatch would misalign ids.
        raise ValueError(f"tokenizer has {len(meta['tokens'])} tokens but the model {vocab_size} rows")
    writer.add_tokenizer_model("gpt2")
    # "default" = GPT-2's split regex (llama.cpp and transformers both), which is what a byte-level
    # tokenizer trained with the GPT-2 regex (like the tiny model's) uses.
    writer.add_tokenizer_pre("default")
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    for add, token_id in (
        (writer.add_bos_token_id, tokenizer.bos_token_id),
        (writer.add_eos_token_id, tokenizer.eos_token_id),
        (writer.add_pad_token_id, tokenizer.pad_token_id),
    ):
        if token_id is not None:
            add(int(token_id))
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    return len(meta["tokens"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="an HF folder of a Qwen2 model")
    ap.add_argument("out_file", type=Path, help="the GGUF file to write (ends in .gguf)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    print(export_qwen2_gguf(args.model_dir, args.out_file))


if __name__ == "__main__":
    main()
