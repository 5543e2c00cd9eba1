"""What a recipe is: the questions the generic pipeline (``retool.pipeline.run``) asks of a task, and
the helpers a recipe's cold start builds with.

The pipeline knows no task by name. Everything that differs between tasks is a method of ``Recipe``:

- ``source``: the problems RL trains on (a ``ProblemSource``; its leak check runs before any model loads);
- ``held_out``: the problems the demo evaluates on (and, for a source that generates its own, its train
  problems and the text the tiny model's tokenizer learns);
- ``cold_start``: the SFT examples of the first stage, trained through ``train_on_examples`` (or the
  recipe's own call of ``retool.train.sft.train_sft_as_configured``), given one ``ColdStartContext``;
- ``eval_source``: the source that scores the held-out set, when its answers need their own checker.

A recipe also carries what it runs with: its name, the model it is sized for, its Config preset, the
generic demo-only fields it sets (``DemoSettings``) and its own options (a ``RecipeOptions`` subclass
declared in its folder: a recipe's knob needs no field outside it). The recipes themselves and their registry sit one layer up, in
``retool.recipes``: this module is the interface they implement, below them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict, cast

from retool.components import Components
from retool.config import Config, ConfigError, recipe_tables
from retool.data.problem import Problem
from retool.env import ProblemSource
from retool.jsonl import JsonObject
from retool.pipeline.settings import DemoFields, DemoSettings, Event, RecipeOptions, options_as
from retool.sandbox import Executor
from retool.train.sft import SFTExample, SFTReport, train_sft_as_configured


@dataclass(frozen=True)
class HeldOut:
    """The problems the demo evaluates on (``problems``). A recipe whose source generates its own problems
    also gives its train problems (``train``, written beside them to ``tasks/train.jsonl``) and the text the
    tiny model's tokenizer learns (``texts``); both stay empty for a dataset."""

    problems: list[Problem]
    train: list[Problem] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ColdStartContext:
    """What a recipe's cold start works with: the run's parts (the model to fine-tune on ``parts.backend``),
    its settings and config, the problem source RL will train on, and where progress goes (``emit``;
    ``on_examples`` hears how many trajectories the cold start built, when it knows)."""

    parts: Components
    settings: DemoSettings
    config: Config
    source: ProblemSource
    emit: Event
    on_examples: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Recipe(ABC):
    """One task the demo pipeline runs end to end: cold start -> evaluate -> RL -> evaluate -> report.

    ``name``: what ``DemoSettings.recipe`` holds for it (what a run folder's ``settings.json`` records);
    ``task``: the task it runs (recipes of one task share its code, with other presets and fields);
    ``model``: the model its preset is sized for (``tiny``, built here, or a ``retool.pipeline.real_model``
    name); ``preset``: its Config preset (a TOML file in its folder); ``fields``: the generic demo-only
    fields it sets; ``options``: its own options with this recipe's values (their type, ``options_type``,
    says which names ``--set recipe.NAME=VALUE`` takes); ``tiny_model``: whether the tiny model can run it (the
    tiny tokenizer is trained on the train tasks' text, so only a recipe with train tasks can).
    """

    name: str
    description: str
    task: str
    model: str = "tiny"
    preset: str = "demo-tiny"
    fields: DemoFields = field(default_factory=lambda: DemoFields())
    options: RecipeOptions = field(default_factory=RecipeOptions)
    tiny_model: bool = False

    @property
    def options_type(self) -> type[RecipeOptions]:
        return type(self.options)

    def own_options(self, settings: DemoSettings) -> DemoSettings:
        """``settings`` with options of this recipe's type (what ``settings.json`` records): as given, or,
        for settings built without the recipe, its type's defaults with the values given set."""
        try:
            return dataclasses.replace(settings, options=options_as(settings, self.options_type))
        except ConfigError as exc:  # e.g. --set pipeline.recipe=NAME on another recipe's settings
            raise ConfigError(
                f"the {self.name} recipe: {exc}; these settings are another recipe's: run this one with "
                f"--recipe {self.name}"
            ) from None

    @abstractmethod
    def source(self, settings: DemoSettings, config: Config) -> ProblemSource:
        """The problems RL trains on."""

    @abstractmethod
    def held_out(self, settings: DemoSettings, source: ProblemSource) -> HeldOut:
        """The evaluation set (and a generated source's train problems and tokenizer text)."""

    @abstractmethod
    def cold_start(self, ctx: ColdStartContext) -> SFTReport:
        """Build the cold-start trajectories and train ``ctx.parts.backend`` on them (``[sft]``)."""

    def eval_source(self, problems: Sequence[Problem]) -> ProblemSource | None:
        """The source whose scorer checks the held-out answers (None: the default verifier)."""
        return None


class PresetSettings(TypedDict):
    """What a recipe's preset sets beside the config: its demo-only fields and its options."""

    fields: DemoFields
    options: RecipeOptions


def from_preset(preset: str, options_type: type[RecipeOptions]) -> PresetSettings:
    """A recipe's demo-only fields and options from its preset's ``[pipeline]`` and ``[recipe]`` tables,
    validated by the settings' and the options' own classes (one TOML file per recipe)."""
    tables = recipe_tables(preset)
    known = DemoSettings.field_names()
    unknown = [name for name in tables["pipeline"] if name not in known]
    if unknown:
        raise ConfigError(
            f"preset {preset!r}: [pipeline] {', '.join(unknown)}: not demo fields ({', '.join(known)})"
        )

    def plain(value: object) -> object:  # TOML arrays are the settings' tuples
        return tuple(value) if isinstance(value, list) else value

    fields = cast(DemoFields, {k: plain(v) for k, v in tables["pipeline"].items()})
    try:
        options = options_type().with_values({k: plain(v) for k, v in tables["recipe"].items()})
    except ConfigError as exc:
        raise ConfigError(f"preset {preset!r}: [recipe]: {exc}") from None
    return {"fields": fields, "options": options}


def train_on_examples(
    ctx: ColdStartContext, examples: Sequence[SFTExample], conversion: JsonObject
) -> SFTReport:
    """Cold-start SFT (``[sft]``) on trajectories a task built, its build report kept as the report's
    ``conversion``."""
    steps, emit = ctx.config.sft.steps_for(len(examples)), ctx.emit
    report = train_sft_as_configured(
        ctx.parts.backend,
        examples,
        ctx.config,
        on_step=lambda step, loss: emit("sft_step", {"step": step + 1, "steps": steps, "loss": loss}),
    )
    report.conversion = conversion
    return report


def sandbox_observer(executor: Executor) -> Callable[[str], str]:
    """SFT observations: the canonical code's REAL output through the sandbox executor.

    Each distinct program runs once: canonical code is deterministic, and the two SFT stages share
    their problems, so most of the second stage's calls would repeat the first's.
    """
    seen: dict[str, str] = {}

    def observe(code: str) -> str:
        if code not in seen:
            seen[code] = executor.format_tool_content(executor.run(code))
        return seen[code]

    return observe
