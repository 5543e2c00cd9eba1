"""The ``gsm8k`` recipe (``retool demo --recipe gsm8k``): ReTool's two stages on GSM8K with
SmolLM2-135M-Instruct, offline on CPU.

Owns its task (``task.py``: the leak-checked train source, the held-out test slice, the cold start from
annotated train solutions), its preset (``demo-gsm8k.toml``, which says why each value), its
demo-only fields and its options (``Gsm8kOptions``): cold start from annotated GSM8K train solutions, RL
on GSM8K train (short solutions only: where the cold-started model solves any), evaluation on a seeded
slice of GSM8K test in both modes (greedy: one deterministic answer per problem), the zero-shot base
model included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from retool.config import Config
from retool.env import ProblemSource
from retool.pipeline.recipe import ColdStartContext, HeldOut, Recipe, from_preset, train_on_examples
from retool.pipeline.settings import DemoSettings, RecipeOptions, demo_data_dir, options_as
from retool.recipes.gsm8k.task import TASK, coldstart_examples, gsm8k_source, held_out_problems
from retool.train.sft import SFTReport


@dataclass(frozen=True)
class Gsm8kOptions(RecipeOptions):
    """The GSM8K recipe's own options (``--set recipe.NAME=VALUE``).

    ``gsm8k_problems``: the held-out set, that many GSM8K test problems; ``coldstart_rows``: the cold start,
    from that many annotated GSM8K train solutions; ``rl_max_solution_steps``: RL on GSM8K's train split,
    only problems solved in at most that many annotated steps (when > 0): it changes RL only;
    ``coldstart_steps_per_call``: annotated steps computed per interpreter call (1: a call per step, each
    seeing the previous step's output; 0: every step in one call, whose later expressions then hold numbers
    the model has not seen yet); ``coldstart_text_only_share``: the share of those solutions written as
    plain reasoning in one turn with no tool registered (the text-only system prompt), so that the model
    keeps answering without the tool and text-only against retool compares two working modes.
    """

    RL_ONLY = frozenset({"rl_max_solution_steps"})

    gsm8k_problems: int = 0
    coldstart_rows: int = 0
    rl_max_solution_steps: int = 0
    coldstart_steps_per_call: int = 1
    coldstart_text_only_share: float = 0.0


@dataclass(frozen=True)
class Gsm8kRecipe(Recipe):
    """GSM8K: train split to learn on, a seeded test slice held out, annotated solutions to start from."""

    task: str = TASK
    options: RecipeOptions = field(default_factory=Gsm8kOptions)

    def source(self, settings: DemoSettings, config: Config) -> ProblemSource:
        source = gsm8k_source(config, options_as(settings, Gsm8kOptions).rl_max_solution_steps)
        source.problems("train")  # the leak check, before any model loads
        return source

    def held_out(self, settings: DemoSettings, source: ProblemSource) -> HeldOut:
        n = options_as(settings, Gsm8kOptions).gsm8k_problems
        return HeldOut(held_out_problems(n, demo_data_dir(settings), settings.seed))

    def cold_start(self, ctx: ColdStartContext) -> SFTReport:
        """Cold-start SFT on GSM8K train solutions turned into tool trajectories."""
        settings = ctx.settings
        options = options_as(settings, Gsm8kOptions)
        examples, conversion = coldstart_examples(
            ctx.parts,
            ctx.config,
            options.coldstart_rows,
            settings.seed,
            Path(settings.out),
            steps_per_call=options.coldstart_steps_per_call,
            text_only_share=options.coldstart_text_only_share,
        )
        ctx.emit(
            "phase",
            {
                "phase": "sft",
                "detail": f"{len(examples)} GSM8K trajectories kept of {conversion['read']} rows",
            },
        )
        return train_on_examples(ctx, examples, conversion)


PRESET = "demo-gsm8k"  # the config, and its [pipeline] fields and [recipe] options
RECIPE = Gsm8kRecipe(
    name="gsm8k",
    description="SmolLM2-135M-Instruct: cold start from annotated GSM8K solutions, RL on GSM8K train",
    model="smollm2",
    preset=PRESET,
    **from_preset(PRESET, Gsm8kOptions),
)
