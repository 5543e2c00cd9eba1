"""A recipe of one's own: the synthetic arithmetic of the ``tiny`` recipe, with the sympy calculator of
``calculator_env.py`` as the tool instead of the Python sandbox, run by the unchanged demo pipeline.

``docs/recipes.md`` walks through it. A recipe answers four questions (``retool.pipeline.recipe.Recipe``):
what RL trains on (``source``), what is held out (``held_out``), how the cold start is built
(``cold_start``) and what scores the held-out answers (``eval_source``); it names its preset and demo-only
fields, declares its own options (``CalculatorOptions``: ``--set recipe.kinds=[...]``), and is registered by name:
no file outside this one changes. Run it::

    python examples/calculator_recipe.py --out runs/calculator       # the whole pipeline, tiny model, CPU
    python examples/calculator_recipe.py --set "recipe.kinds=['add_small', 'mul_big']"   # its own option

or, from code, ``run_demo(calculator_settings("runs/calculator"))``. Its task kinds are the arithmetic
ones: the calculator evaluates arithmetic, and the digit-sum and prime-count kinds' canonical code is a
Python loop. ``tests/test_examples_calculator.py`` runs it, shrunk.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from calculator_env import CalculatorSource, SympyCalculator

from retool.config import Config
from retool.data.problem import Problem
from retool.env import ProblemList, ProblemSource, SyntheticSourceOptions, TaskFamilySource
from retool.pipeline.recipe import ColdStartContext, HeldOut, Recipe, from_preset
from retool.pipeline.report import gain_line, markdown_table
from retool.pipeline.settings import DemoFields, DemoSettings, RecipeOptions, options_as
from retool.recipes import register_recipe
from retool.recipes.demo import recipe_fields, run_demo
from retool.recipes.tiny import SyntheticOptions, cold_start_sft, held_out_tasks, task_source_of
from retool.train.sft import SFTReport

# The synthetic kinds whose canonical code is arithmetic (assignments and one printed expression).
ARITHMETIC_KINDS = ("add_small", "mul_small", "mul_big", "mod_pow", "linear_system")


@dataclass(frozen=True)
class CalculatorOptions(SyntheticOptions):
    """The recipe's own options (``--set recipe.NAME=VALUE``; ``settings.json`` records them under ``options``):
    the tiny recipe's (``test_hard_fraction``, ``gsm8k_problems``: its held-out split is reused) and
    ``kinds``, the synthetic kinds it trains and is evaluated on (a subset of ``ARITHMETIC_KINDS``)."""

    kinds: tuple[str, ...] = ARITHMETIC_KINDS


@dataclass(frozen=True)
class CalculatorRecipe(Recipe):
    """Arithmetic tasks; every tool call, in SFT, RL and evaluation, goes to the sympy calculator."""

    task: str = "calculator"
    options: RecipeOptions = field(default_factory=CalculatorOptions)
    tiny_model: bool = True  # it has train tasks: the tiny model's tokenizer is trained on their text

    def source(self, settings: DemoSettings, config: Config) -> ProblemSource:
        d = config.data
        sizes = SyntheticSourceOptions.model_validate(d.options)  # the preset's [data.options]
        family = TaskFamilySource(
            count=sizes.count,
            test_count=sizes.test_count,
            seed=d.seed,
            hard_fraction=sizes.hard_fraction,
            kinds=options_as(settings, CalculatorOptions).kinds,
            shuffle=d.shuffle,
        )
        return CalculatorSource(family)

    def held_out(self, settings: DemoSettings, source: ProblemSource) -> HeldOut:
        assert isinstance(source, CalculatorSource)
        return held_out_tasks(settings, task_source_of(source.inner))

    def cold_start(self, ctx: ColdStartContext) -> SFTReport:
        assert isinstance(ctx.source, CalculatorSource)
        train = task_source_of(ctx.source.inner).tasks("train")
        calculator = SympyCalculator()

        def observe(code: str) -> str:  # what the calculator shows for the canonical code
            return calculator.format_tool_content(asyncio.run(calculator.arun(code)))

        return cold_start_sft(ctx, train, options_as(ctx.settings, CalculatorOptions), observe=observe)

    def eval_source(self, problems: Sequence[Problem]) -> ProblemSource | None:
        return CalculatorSource(ProblemList(list(problems), shuffle=False))


# The tiny recipe's TOML: its config, and its [recipe] table (the cold start's styles) as our options.
PRESET = "demo-tiny"
RECIPE = register_recipe(
    CalculatorRecipe(
        name="calculator",
        description="the tiny model learns to call a sympy calculator on synthetic arithmetic",
        preset=PRESET,
        fields={"out": "runs/calculator"},
        options=from_preset(PRESET, CalculatorOptions)["options"],
    )
)


def calculator_settings(out: str, overrides: Sequence[str] = ()) -> DemoSettings:
    """The recipe's settings: its preset (the tiny recipe's), fields and options, then ``overrides``."""
    fields: DemoFields = {**recipe_fields(RECIPE), "out": out}
    return DemoSettings.load(overrides, config=RECIPE.preset, **fields)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RECIPE.fields.get("out")))
    sets = "section.key=value, a demo field or an option of the recipe (kinds=[...])"
    ap.add_argument("--set", dest="overrides", action="append", default=[], help=sets)
    args = ap.parse_args()
    result = run_demo(calculator_settings(args.out, args.overrides))
    print(markdown_table(result.table))
    print(gain_line(result.gain))
    print(f"run folder: {result.out}")


if __name__ == "__main__":
    main()
