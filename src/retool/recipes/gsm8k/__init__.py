"""The ``gsm8k`` recipe (``retool demo --recipe gsm8k``): ReTool's two stages on GSM8K with
SmolLM2-135M-Instruct, offline on CPU.

Owns its task (``task.py``: the leak-checked train source, the held-out test slice, the cold start from
annotated train solutions), its preset (``demo-smollm2-gsm8k.toml``, which says why each value) and its
demo-only fields: cold start from annotated GSM8K train solutions, RL on GSM8K train (short solutions
only: where the cold-started model solves any), evaluation on a seeded slice of GSM8K test in both modes
(greedy: one deterministic answer per problem), the zero-shot base model included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from retool.components import Components
from retool.config import Config
from retool.data.synthetic import Task
from retool.env import ProblemSource
from retool.recipes.gsm8k.task import TASK, coldstart_examples, gsm8k_source, held_out_problems
from retool.tasks.recipe import HeldOut, Recipe, train_on_examples
from retool.tasks.settings import DemoFields, DemoSettings, Event, demo_data_dir
from retool.tasks.sft import SFTReport

FIELDS: DemoFields = {
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


@dataclass(frozen=True)
class Gsm8kRecipe(Recipe):
    """GSM8K: train split to learn on, a seeded test slice held out, annotated solutions to start from."""

    task: str = TASK

    def source(self, settings: DemoSettings, config: Config) -> ProblemSource:
        source = gsm8k_source(config, settings.rl_max_solution_steps)
        source.problems("train")  # the leak check, before any model loads
        return source

    def held_out(self, settings: DemoSettings, source: ProblemSource) -> HeldOut:
        return HeldOut(
            [], [], held_out_problems(settings.gsm8k_problems, demo_data_dir(settings), settings.seed)
        )

    def cold_start(
        self,
        parts: Components,
        settings: DemoSettings,
        train: Sequence[Task],
        config: Config,
        emit: Event,
        on_examples: Callable[[int], None] | None = None,
    ) -> SFTReport:
        """Cold-start SFT on GSM8K train solutions turned into tool trajectories."""
        out = Path(settings.out)
        examples, conversion = coldstart_examples(parts, config, settings.coldstart_rows, settings.seed, out)
        emit(
            "phase",
            {
                "phase": "sft",
                "detail": f"{len(examples)} GSM8K trajectories kept of {conversion['read']} rows",
            },
        )
        return train_on_examples(parts, config, examples, conversion, emit)


RECIPE = Gsm8kRecipe(
    name="gsm8k",
    description="SmolLM2-135M-Instruct: cold start from annotated GSM8K solutions, RL on GSM8K train",
    model="smollm2",
    preset="demo-smollm2-gsm8k",
    fields=FIELDS,
)
