"""The ``mathematics`` recipe (``retool demo --recipe mathematics``): ReTool's two stages on DeepMind
Mathematics (``retool data mathematics``) with SmolLM2-135M-Instruct, offline on CPU.

Owns its task (``task.py``: the leak-checked train split, the held-out interpolate + extrapolate slice,
the cold start from the model's own verified attempts), the benchmark's answer checker for the held-out
set, its preset (``demo-mathematics.toml``, which says why each value), its demo-only fields and its
options (``MathematicsOptions``):
greedy evaluation text-only and with the tool on the first questions of every interpolate and extrapolate
module, the zero-shot base model included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from retool.config import Config
from retool.data.mathematics import module_of
from retool.data.problem import Problem
from retool.env import ProblemSource
from retool.env.mathematics import MathematicsList, MathematicsSource
from retool.pipeline.recipe import ColdStartContext, HeldOut, Recipe, from_preset, train_on_examples
from retool.pipeline.settings import DemoSettings, RecipeOptions, options_as
from retool.recipes.mathematics.task import (
    TASK,
    ColdStart,
    coldstart_expert_iteration,
    coldstart_summary,
    held_out_problems,
    mathematics_source,
)
from retool.train.expert_iteration import RoundReport
from retool.train.sft import SFTReport


@dataclass(frozen=True)
class MathematicsOptions(RecipeOptions):
    """The DeepMind Mathematics recipe's own options (``--set recipe.NAME=VALUE``).

    ``mathematics_problems``: held out, the first that many questions of every interpolate and extrapolate
    module; the cold start samples the model's own attempts under a few-shot prompt, ``coldstart_samples``
    at ``coldstart_temperature`` on ``coldstart_rows`` train problems *per module*, and keeps the verified
    ones. With ``coldstart_rounds`` > 1 it grows by expert iteration: each further round samples the SFT
    model without the prompt, ``coldstart_round_samples`` at ``coldstart_round_temperature`` on
    ``coldstart_round_rows`` other train problems per module, keeps at most ``coldstart_keep`` verified
    attempts a problem, and fine-tunes on the pool again; sampling stops after
    ``coldstart_max_trajectories`` trajectories (0: no limit).
    """

    mathematics_problems: int = 0
    coldstart_rows: int = 0
    coldstart_samples: int = 2
    coldstart_temperature: float = 0.7
    # One round is the few-shot sampling alone (what the demo is sized for); the bench raises it.
    coldstart_rounds: int = 1
    coldstart_round_rows: int = 16
    coldstart_round_samples: int = 4
    coldstart_round_temperature: float = 0.7
    coldstart_keep: int = 1
    coldstart_max_trajectories: int = 0


def cold_start_of(options: MathematicsOptions) -> ColdStart:
    """The cold start's sizes the options set."""
    return ColdStart(
        per_module=options.coldstart_rows,
        samples=options.coldstart_samples,
        temperature=options.coldstart_temperature,
        rounds=options.coldstart_rounds,
        round_per_module=options.coldstart_round_rows,
        round_samples=options.coldstart_round_samples,
        round_temperature=options.coldstart_round_temperature,
        keep=options.coldstart_keep,
        max_trajectories=options.coldstart_max_trajectories or None,
    )


@dataclass(frozen=True)
class MathematicsRecipe(Recipe):
    """DeepMind Mathematics: the generated train split, the first questions of every test module held out."""

    task: str = TASK
    options: RecipeOptions = field(default_factory=MathematicsOptions)

    def source(self, settings: DemoSettings, config: Config) -> ProblemSource:
        maths = mathematics_source(config, settings.data_dir)
        maths.problems("train")  # the leak check, before any model loads
        return maths

    def held_out(self, settings: DemoSettings, source: ProblemSource) -> HeldOut:
        assert isinstance(source, MathematicsSource), "the mathematics recipe's source reads its data folder"
        n = options_as(settings, MathematicsOptions).mathematics_problems
        return HeldOut(held_out_problems(n, source.data_dir))

    def cold_start(self, ctx: ColdStartContext) -> SFTReport:
        """Cold-start SFT on the model's own verified attempts at train problems (rounds of expert
        iteration after the few-shot one, ``coldstart_rounds``)."""
        settings, emit = ctx.settings, ctx.emit
        emit("phase", {"phase": "sft", "detail": "sampling the model's own attempts under a few-shot prompt"})
        cold = cold_start_of(options_as(settings, MathematicsOptions))

        def heard(report: RoundReport) -> None:
            detail = f"round {report.round}: {report.kept} verified attempts kept of {report.sampled}"
            emit("phase", {"phase": "sft", "detail": f"{detail} (pool {report.pool})"})

        result = coldstart_expert_iteration(
            ctx.parts,
            ctx.config,
            cold,
            out=Path(settings.out),
            train=lambda pool: train_on_examples(ctx, pool, {}),
            data_dir=settings.data_dir,
            on_round=heard,
        )
        result.sft.conversion = coldstart_summary(result)
        return result.sft

    def eval_source(self, problems: Sequence[Problem]) -> ProblemSource | None:
        """The benchmark's checker: answers are checked as DeepMind Mathematics means them, not by
        math-verify."""
        if problems and all(module_of(p) for p in problems):
            return MathematicsList(problems, shuffle=False, name="held-out")
        return None


PRESET = "demo-mathematics"  # the config, and its [pipeline] fields and [recipe] options
RECIPE = MathematicsRecipe(
    name="mathematics",
    description="SmolLM2-135M-Instruct on DeepMind Mathematics: cold start from its own verified attempts",
    model="smollm2",
    preset=PRESET,
    **from_preset(PRESET, MathematicsOptions),
)
