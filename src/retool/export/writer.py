"""``export_model``: one export from request to finished folder, all or nothing.

Owns the order and the layout of an export folder:

- ``hf``: the merged model at the folder's root (``AutoModelForCausalLM.from_pretrained(DIR)``);
- ``peft``: the adapter at the root, or in ``adapter/`` when ``hf`` is written too (a root holding both
  ``config.json`` and ``adapter_config.json`` would make transformers load the adapter over its base);
- ``gguf``: ``<DIR name>-<type>.gguf`` at the root, one per ``--gguf-type``;
- ``README.md``: the model card (``retool.export.card``).

Everything is written into a hidden sibling folder (``.<name>.export-tmp-<pid>``) and renamed into place
at the end; with ``--force`` the old folder is renamed away first and removed after. A failure at any point
(a full disk included) removes the temp folder, so no half-written export is ever left, and an existing
folder is replaced only by a complete one. The GGUF files are written before the ``hf`` folder, which
casts the float32 model in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from retool.export.card import CardFile, base_license, model_card
from retool.export.errors import ExportError
from retool.export.gguf import GGUF_TYPES, write_gguf
from retool.export.hub import push_to_hub
from retool.export.source import ExportSource, ModelChoice, resolve_source
from retool.export.weights import DTYPES, base_model_name, load_trained, write_hf, write_peft

if TYPE_CHECKING:  # the name only: transformers is imported where an export runs
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMATS = ("hf", "peft", "gguf")
CARD_FILE = "README.md"


@dataclass(frozen=True)
class ExportRequest:
    """What ``retool export`` was asked for (its flags, with their defaults)."""

    source: Path
    out: Path
    formats: tuple[str, ...] = ("hf",)
    step: int | None = None
    model: ModelChoice | None = None
    dtype: str = "bf16"
    gguf_types: tuple[str, ...] = ("f16",)
    force: bool = False
    push_to_hub: str | None = None
    private: bool = False


@dataclass
class ExportResult:
    out: Path
    source: ExportSource
    files: list[CardFile] = field(default_factory=list)
    seconds: float = 0.0
    hub_url: str | None = None


def export_model(request: ExportRequest) -> ExportResult:
    """Write the export ``request`` asks for; an ``ExportError`` in one line when it cannot be made."""
    t0 = time.perf_counter()
    _check_request(request)
    source = resolve_source(request.source, request.step, request.model)
    if "peft" in request.formats and source.adapter is None:
        raise ExportError(f"--format peft: {source.no_adapter}")
    out = request.out
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = _write_formats(source, request, tmp)
        _publish(tmp, out, request.force)
    except BaseException as exc:  # an interrupt too: the temp folder never outlives the export
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError":  # safetensors' ENOSPC
            raise ExportError(
                f"the export failed ({type(exc).__name__}: {exc}); nothing was left behind"
                + (f" and {out} is unchanged" if out.exists() else "")
            ) from None
        raise
    result = ExportResult(out, source, files, time.perf_counter() - t0)
    if request.push_to_hub:
        result.hub_url = push_to_hub(out, request.push_to_hub, private=request.private)
    return result


def _check_request(request: ExportRequest) -> None:
    unknown = [f for f in request.formats if f not in FORMATS]
    if unknown or not request.formats:
        raise ExportError(
            f"unknown format {unknown[0] if unknown else ''!r}; choose from {', '.join(FORMATS)}"
        )
    if request.dtype not in DTYPES:
        raise ExportError(f"unknown dtype {request.dtype!r}; choose one of {', '.join(DTYPES)}")
    bad = [t for t in request.gguf_types if t not in GGUF_TYPES]
    if bad or not request.gguf_types:
        raise ExportError(f"unknown GGUF type {bad[0] if bad else ''!r}; choose from {', '.join(GGUF_TYPES)}")
    out, source = request.out.resolve(), request.source.resolve()
    if out == source or out in source.parents:
        raise ExportError(
            f"--out {request.out} would replace the source {request.source}: choose another folder"
        )
    if request.out.exists() and not request.force:
        raise ExportError(f"{request.out} exists: pass --force to replace it, or choose another --out")


def _write_formats(source: ExportSource, request: ExportRequest, folder: Path) -> list[CardFile]:
    """Every format asked for, then the card, into ``folder``."""
    files: list[CardFile] = []
    name = request.out.name
    tokenizer: PreTrainedTokenizerBase | None = None
    if "hf" in request.formats or "gguf" in request.formats:
        model, tokenizer = load_trained(source.weights)
        license_id = base_license(source)
        for gguf_type in dict.fromkeys(request.gguf_types) if "gguf" in request.formats else ():
            path = write_gguf(
                model,
                tokenizer,
                folder / f"{name}-{gguf_type}.gguf",
                gguf_type,
                name=name,
                license_id=license_id,
            )
            files.append(
                CardFile(
                    path.name,
                    f"gguf ({gguf_type})",
                    f"`llama-server -m {path.name} --jinja`; Ollama: `FROM ./{path.name}`",
                )
            )
        if "hf" in request.formats:
            write_hf(model, tokenizer, folder, request.dtype)
            files.insert(
                0,
                CardFile(
                    "model.safetensors, config.json, tokenizer files",
                    f"hf ({request.dtype})",
                    "`AutoModelForCausalLM.from_pretrained(DIR)`; `vllm serve DIR`",
                ),
            )
        del model
    if "peft" in request.formats:
        assert source.adapter is not None  # export_model checked
        where = folder / "adapter" if "hf" in request.formats else folder
        write_peft(source.adapter, where)
        rel = "adapter/" if "hf" in request.formats else "adapter_model.safetensors, adapter_config.json"
        base = repr(base_model_name(source.adapter))
        if source.adapter.gguf_file:  # a base read from a GGUF file
            base += f", gguf_file={source.adapter.gguf_file!r}"
        files.append(
            CardFile(
                rel,
                "peft (LoRA adapter, float32)",
                f"`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base}), DIR{'/adapter' if 'hf' in request.formats else ''})`",
            )
        )
    if tokenizer is None:
        tokenizer = _tokenizer_of(source)
    (folder / CARD_FILE).write_text(model_card(source, tokenizer, files, name), encoding="utf-8")
    return files


def _tokenizer_of(source: ExportSource) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # deferred: transformers (~3 s), for exports only

    weights = source.adapter or source.weights
    kwargs = {"gguf_file": weights.gguf_file} if weights.gguf_file else {}
    return AutoTokenizer.from_pretrained(weights.base, **kwargs)


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` (``force``) is moved away first and
    removed once the new one is in place."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if not force:
        raise ExportError(f"{out} exists: pass --force to replace it, or choose another --out")
    old = out.parent / f".{out.name}.export-old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)  # put the previous export back
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            old.unlink()
