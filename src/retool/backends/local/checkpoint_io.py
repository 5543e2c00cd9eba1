"""The folder a local client saves its state in, written and read back.

``save_state(name)`` writes a folder (``checkpoint_dir/name``, or ``name`` itself when it is a path):
``adapter_model.safetensors`` + ``adapter_config.json`` (LoRA, PEFT format) or ``model.safetensors``
(full fine-tuning), ``optimizer.pt``, ``rng.pt`` (torch, CUDA, Python, NumPy and sampler-seed RNGs) and
``trainer_state.json`` (step, model, LoRA settings). ``load_state`` restores all of it into a client built
with the same model and LoRA settings, so the next step's loss is bitwise identical.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model

from retool.backends.local.loading import LocalLoraSpec

# The metadata of a saved state. Its name (kept so states saved earlier still load) is also the trainer
# checkpoint's; ``retool.train.checkpoint`` tells the two apart by their contents.
BACKEND_META_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
FULL_WEIGHTS_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def state_folder(name: str, checkpoint_dir: Path) -> Path:
    """Where ``save_state(name)`` writes: ``name`` itself when it is a path, else ``checkpoint_dir/name``."""
    path = Path(name)
    if path.is_absolute() or len(path.parts) > 1:
        return path
    return checkpoint_dir / name


def lora_record(lora: LocalLoraSpec | None) -> dict[str, object] | None:
    """The LoRA settings as ``trainer_state.json`` holds them (``None``: full fine-tuning)."""
    return None if lora is None else {**vars(lora), "target_modules": list(lora.target_modules)}


def save_state_folder(
    folder: Path,
    *,
    model: Any,
    lora: LocalLoraSpec | None,
    optimizer: torch.optim.Optimizer | None,
    seed_rng: random.Random,
    meta: dict[str, object],
) -> None:
    """Write the weights, the optimizer state, every RNG and ``meta`` (step, model, ``has_optimizer``;
    the LoRA settings are added here) into ``folder``. ``model`` is a transformers / PEFT model."""
    folder.mkdir(parents=True, exist_ok=True)
    if lora is not None:
        # PEFT's own format (adapter_config.json + adapter_model.safetensors): vLLM can load it as is.
        model.save_pretrained(folder)
    else:
        save_model(model, str(folder / FULL_WEIGHTS_FILE))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
    rng: dict[str, object] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "sampler_seeds": seed_rng.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / RNG_FILE)
    record = {**meta, "lora": lora_record(lora), "has_optimizer": optimizer is not None}
    (folder / BACKEND_META_FILE).write_text(json.dumps(record, indent=2) + "\n")


def load_state_folder(
    folder: Path,
    *,
    model: torch.nn.Module,
    lora: LocalLoraSpec | None,
    device: torch.device,
    make_optimizer: Callable[[], torch.optim.Optimizer],
    seed_rng: random.Random,
) -> int:
    """Restore what ``save_state_folder`` wrote into ``model``, the optimizer ``make_optimizer`` returns
    (called only when the state has one), the global RNGs and ``seed_rng``; the saved step. A state saved
    with other LoRA settings is refused."""
    meta_path = folder / BACKEND_META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{folder} is not a saved state (no {BACKEND_META_FILE})")
    meta = json.loads(meta_path.read_text())
    mine = lora_record(lora)
    if meta.get("lora") != mine:
        raise ValueError(
            f"state {folder} was saved with lora={meta.get('lora')}, this client has lora={mine}"
        )
    if lora is not None:
        from peft import set_peft_model_state_dict  # deferred: LoRA only

        weights = load_file(str(folder / ADAPTER_WEIGHTS_FILE), device=str(device))
        result = set_peft_model_state_dict(model, weights)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter in {folder} has unexpected keys: {unexpected[:5]}")
    else:
        load_model(model, str(folder / FULL_WEIGHTS_FILE), device=str(device))
    if meta.get("has_optimizer"):
        state = torch.load(folder / OPTIMIZER_FILE, map_location=device, weights_only=False)
        make_optimizer().load_state_dict(state)
    rng = torch.load(folder / RNG_FILE, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    seed_rng.setstate(rng["sampler_seeds"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(meta["step"])
