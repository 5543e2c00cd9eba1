"""``retool demo`` and ``retool sft`` by recipe: the recipe a run's settings name (``DemoSettings.recipe``),
run through the generic pipeline (``retool.pipeline.run``).

The entry points the benches, tests and docs call: ``run_demo``, ``run_sft``, ``recipe_settings`` (a
recipe's preset, demo-only fields and options, then overrides), ``recipe_fields``, ``run_settings`` (a run
folder's ``settings.json``), ``demo_source`` and ``held_out`` (what a run trains and is
evaluated on). The pipeline's own helpers keep their home in ``retool.pipeline.run``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Unpack

from retool.config import Config
from retool.env import ProblemSource
from retool.jsonl import JsonObject
from retool.pipeline.recipe import HeldOut, Recipe
from retool.pipeline.report import DemoResult
from retool.pipeline.run import run_pipeline, run_recipe_sft
from retool.pipeline.settings import DemoFields, DemoSettings, Event, recorded_settings
from retool.recipes import recipe_named


def run_demo(settings: DemoSettings, on_event: Event | None = None) -> DemoResult:
    """(Zero-shot eval), SFT, evaluate, RL, evaluate with the recipe ``settings.recipe`` names; everything
    under ``settings.out`` (``retool.pipeline.run.run_pipeline``)."""
    return run_pipeline(recipe_named(settings.recipe), settings, on_event)


def run_sft(
    settings: DemoSettings,
    model: str | Path | None = None,
    on_event: Event | None = None,
    evaluate: bool = True,
) -> JsonObject:
    """The cold start of the recipe ``settings.recipe`` names, on its own (``retool sft``)."""
    return run_recipe_sft(recipe_named(settings.recipe), settings, model, on_event, evaluate)


def recipe_settings(name: str, overrides: Sequence[str] = (), **fields: Unpack[DemoFields]) -> DemoSettings:
    """``DemoSettings`` of the recipe ``name``: its preset, demo-only fields and options, then ``overrides``
    (``section.key=value``, or ``name=value`` for a field or an option) and ``fields``."""
    recipe = recipe_named(name)
    merged: DemoFields = {**recipe_fields(recipe), **fields}
    return DemoSettings.load(overrides, config=recipe.preset, **merged)


def recipe_fields(recipe: Recipe) -> DemoFields:
    """What ``recipe`` sets of ``DemoSettings``: its name, its demo-only fields and its options."""
    return {**recipe.fields, "recipe": recipe.name, "options": recipe.options}


def run_settings(folder: Path) -> JsonObject:
    """A run folder's ``settings.json`` (``retool.pipeline.settings.recorded_settings``)."""
    return recorded_settings(folder / "settings.json")


def demo_source(settings: DemoSettings, config: Config) -> ProblemSource:
    """The problems RL trains on, as the recipe ``settings.recipe`` picks them."""
    return recipe_named(settings.recipe).source(settings, config)


def held_out(settings: DemoSettings, source: ProblemSource) -> HeldOut:
    """What the recipe ``settings.recipe`` holds out (its evaluation set)."""
    return recipe_named(settings.recipe).held_out(settings, source)
