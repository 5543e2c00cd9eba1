"""What a demo run is given: ``DemoSettings`` (a ``Config``, the generic demo-only fields and the recipe's
own options), the typed keyword form of those fields (``DemoFields``), the base of a recipe's options
(``RecipeOptions``), and the progress events a run reports (``DemoEvent``).

The generic fields are what the pipeline (``retool.pipeline.run``) reads; a recipe's knobs are its
``RecipeOptions`` subclass, declared in its own folder, so a new recipe needs no field here.
``settings.json`` records the options under ``options``; ``recorded_settings`` reads it back and refuses,
in one line, a file of another shape (no compatibility code before a tagged release).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypedDict, TypeVar, Unpack

from retool.config import Config, ConfigError, apply_overrides, load_config, override_config, recipe_tables
from retool.jsonl import JsonObject
from retool.pipeline.report import FlatSummary
from retool.train.metrics import MetricsRecord

if TYPE_CHECKING:  # only the name of a type: the tiny model's module imports torch
    from retool.backends.local.tinymodel import ModelSize


class DemoEvent(TypedDict, total=False):
    """What an ``Event`` carries; which keys depends on its kind (``phase``, ``phase_done``, ``sft_step``,
    ``eval_progress``, ``rl_step``, ``eval``)."""

    phase: str
    detail: str
    seconds: float
    resumed: bool
    step: int
    steps: int
    loss: float
    model: str
    mode: str
    done: int
    total: int
    metrics: MetricsRecord
    summaries: dict[str, FlatSummary]


Event = Callable[[str, DemoEvent], None]
DEMO_PRESET = "demo-tiny"
# The tables of a recipe's settings beside the config's sections: ``--set pipeline.NAME=value`` sets a
# demo-only field, ``--set recipe.NAME=value`` one of the recipe's options.
PIPELINE_TABLE = "pipeline"
RECIPE_TABLE = "recipe"


def seed_overrides(seed: int) -> list[str]:
    """One seed for everything the demo draws: tasks and their order, model, SFT, sampling, evaluation."""
    return [f"train.seed={seed}", f"data.seed={seed}", f"eval.seed={seed}"]


@dataclass(frozen=True)
class RecipeOptions:
    """A recipe's own options: subclassed in the recipe's folder as a frozen dataclass whose every field has
    a default (JSON values: a bool, number, string, None or tuple of them). ``--set recipe.NAME=VALUE`` sets one,
    ``settings.json`` records them under ``options``. This base has none: the options of settings built
    without a recipe, which the recipe that runs them reads as its own defaults (``options_as``).

    ``RL_ONLY``: the options that change only RL, not the tasks or the SFT model, so a run may reuse the SFT
    model of a run that differs in them (``--reuse-sft``).
    """

    RL_ONLY: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_values(self, values: Mapping[str, object]) -> Self:
        """These options with ``values`` set; ``ConfigError`` naming the known options for an unknown name."""
        unknown = [name for name in values if name not in self.names()]
        if unknown:
            raise ConfigError(f"no option {', '.join(unknown)} in {self.described()}")
        return dataclasses.replace(self, **values)

    def described(self) -> str:
        """The options by name, for an error message: ``SyntheticOptions (test_hard_fraction, ...)``."""
        return f"{type(self).__name__} ({', '.join(self.names()) or 'none'})"

    def as_dict(self) -> JsonObject:
        """What ``settings.json`` records (tuples as the lists JSON reads back)."""
        values = {name: getattr(self, name) for name in self.names()}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


Options = TypeVar("Options", bound=RecipeOptions)


def options_as(settings: DemoSettings, kind: type[Options]) -> Options:
    """``settings.options`` as the recipe's options type ``kind``: as they are when they are of it, else
    (settings built without the recipe) ``kind``'s defaults with the values given set."""
    if isinstance(settings.options, kind):
        return settings.options
    given = settings.options
    return kind().with_values({name: getattr(given, name) for name in given.names()})


class DemoFields(TypedDict, total=False):
    """The demo-only fields of ``DemoSettings`` as keywords (what a recipe's ``fields`` set)."""

    out: str
    size: ModelSize
    eval_modes: tuple[str, ...]
    plots: bool
    reuse_sft: str | None
    data_dir: str | None
    base_eval_problems: int
    base_eval_modes: tuple[str, ...]
    recipe: str
    eval_temperature: float | None
    resume: bool
    options: RecipeOptions


@dataclass(frozen=True)
class DemoSettings:
    """The demo's settings: a ``Config`` (the ``demo`` preset) plus the knobs only the demo has.

    ``out``: the run folder; ``size``: the tiny model's size (``test`` trains in seconds, for tests);
    ``eval_modes``: the evaluated modes; ``plots``: draw them; ``reuse_sft``: a finished demo run folder
    whose SFT model and SFT evaluation (same tasks and SFT settings) this run starts from, redoing only
    RL and its evaluation, e.g. to compare RL settings on one SFT model.

    ``data_dir``: the folder the task's data files are read from (``--data-dir``); ``base_eval_problems``
    (real models): zero-shot eval of the model before SFT on every k-th held-out problem, in
    ``base_eval_modes``.
    ``recipe``: the name of the recipe that runs (``retool.recipes``: ``tiny``, ``smollm2``, ``gsm8k``,
    ``mathematics``, ...; recorded in ``settings.json``);
    ``options``: the recipe's own options (its ``RecipeOptions`` subclass, e.g. the GSM8K recipe's cold-start
    rows), set by ``--set recipe.NAME=VALUE`` (a field by ``--set pipeline.NAME=VALUE``).
    ``eval_temperature``: the evaluations' sampling temperature (None: ``[sampling]``'s, as in RL; 0: greedy).
    ``resume``: continue the run in ``out`` (finished phases skipped, RL from its last checkpoint, an
    evaluation from its JSONL); the settings must match its ``settings.json``.
    """

    config: Config = field(default_factory=lambda: load_config(DEMO_PRESET))
    out: str = "runs/demo"
    size: ModelSize = "demo"
    eval_modes: tuple[str, ...] = ("text-only", "retool")
    plots: bool = True
    reuse_sft: str | None = None
    data_dir: str | None = None
    base_eval_problems: int = 0
    base_eval_modes: tuple[str, ...] = ("retool",)
    recipe: str = "tiny"
    eval_temperature: float | None = None
    resume: bool = False
    options: RecipeOptions = field(default_factory=RecipeOptions)

    @classmethod
    def load(
        cls, overrides: Sequence[str] = (), *, config: str | Path = DEMO_PRESET, **fields: Unpack[DemoFields]
    ) -> DemoSettings:
        """Settings from ``config`` (a preset or TOML file) and ``overrides``, one dotted grammar for all:
        ``section.key=value`` for the config, ``pipeline.NAME=value`` for a demo-only field,
        ``recipe.NAME=value`` for one of the recipe's ``options``; ``fields`` set demo-only fields (and
        ``options``) directly. A ``[recipe]`` table in ``config`` sets the recipe's options (when ``options``
        is a recipe's type: one's own TOML given with ``--config`` tunes the recipe it names)."""
        settings = cls(config=load_config(config), **fields)
        in_file = recipe_tables(config)[RECIPE_TABLE]
        if in_file and type(settings.options) is not RecipeOptions:
            plain = {k: tuple(v) if isinstance(v, list) else v for k, v in in_file.items()}
            try:
                options = settings.options.with_values(plain)
            except ConfigError as exc:
                raise ConfigError(f"{config}: [recipe]: {exc}") from None
            settings = dataclasses.replace(settings, options=options)
        return settings.with_overrides(overrides)

    def with_overrides(self, overrides: Sequence[str]) -> DemoSettings:
        by_table: dict[str, list[str]] = {PIPELINE_TABLE: [], RECIPE_TABLE: [], "config": []}
        for override in overrides:
            head, dot, _ = override.partition("=")[0].strip().partition(".")
            table = head if dot and head in (PIPELINE_TABLE, RECIPE_TABLE) else "config"
            if not dot:
                raise ConfigError(
                    f"override {override!r}: not section.key=value; a demo field is pipeline.NAME=value "
                    f"({', '.join(_OWN_FIELDS)}), an option of the recipe recipe.NAME=value "
                    f"({self.options.described()})"
                )
            by_table[table].append(override)
        fields = f"the demo fields ({', '.join(_OWN_FIELDS)})"
        own = dict(_named_value(o, _OWN_FIELDS, fields) for o in by_table[PIPELINE_TABLE])
        options = self.options.with_values(
            dict(
                _named_value(o, self.options.names(), f"the recipe's {self.options.described()}")
                for o in by_table[RECIPE_TABLE]
            )
        )
        config = override_config(self.config, by_table["config"])
        return dataclasses.replace(self, config=config, options=options, **own)

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """The demo-only fields (what ``pipeline.NAME=value`` and a preset's ``[pipeline]`` table set)."""
        return _OWN_FIELDS

    def with_seed(self, seed: int) -> DemoSettings:
        return self.with_overrides(seed_overrides(seed))

    @property
    def seed(self) -> int:
        return self.config.train.seed

    def as_dict(self) -> JsonObject:
        """What ``settings.json`` / ``report.json`` record: the demo-only fields, the recipe's options, the
        seed, the config."""
        own = {name: getattr(self, name) for name in _OWN_FIELDS}
        return {
            **own,
            "eval_modes": list(self.eval_modes),
            "base_eval_modes": list(self.base_eval_modes),
            "options": self.options.as_dict(),
            "seed": self.seed,
            "config": self.config.model_dump(),
        }


# The demo-only fields ``field=value`` sets (the options and the config are set by their own names).
_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(DemoSettings) if f.name not in ("config", "options"))


def _named_value(override: str, names: Sequence[str], what: str) -> tuple[str, Any]:
    """``table.NAME=value`` -> (NAME, value: its type is the value's), NAME one of ``names``."""
    named = override.partition(".")[2]
    name = named.partition("=")[0].strip()
    if name not in names:
        raise ConfigError(f"override {override!r}: {name!r} is none of {what}")
    value = apply_overrides({}, [named])[name]
    return name, tuple(value) if isinstance(value, list) else value


def recorded_settings(path: Path) -> JsonObject:
    """A run folder's ``settings.json``, as ``DemoSettings.as_dict`` wrote it. A file of another shape (an
    earlier version's, before recipes declared their options) is refused: start a new run."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(saved, dict) or "options" not in saved:
        raise ValueError(f"{path} was written by another version of retool (no 'options'): start a new run")
    return saved


def with_data_dir(settings: DemoSettings, config: Config) -> Config:
    """The demo's ``data_dir`` (``--data-dir``) as the config's ``data.data_dir``, so the GSM8K train split and
    the cold start read the folder the held-out slice is read from."""
    if settings.data_dir is None or config.data.data_dir == settings.data_dir:
        return config
    return config.model_copy(update={"data": config.data.model_copy(update={"data_dir": settings.data_dir})})


def demo_data_dir(settings: DemoSettings) -> str | None:
    """Where the demo reads GSM8K: ``data_dir``, else the config's ``data.data_dir``, else (``None``) the
    data folder (``retool.data.paths``)."""
    return settings.data_dir or settings.config.data.data_dir
