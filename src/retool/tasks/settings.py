"""What a demo run is given: ``DemoSettings`` (a ``Config`` plus the demo-only fields), the typed keyword
form of those fields (``DemoFields``), and the progress events a run reports (``DemoEvent``).

The fields are one flat namespace for every recipe (``retool.recipes``), because a run folder's
``settings.json`` records them so: a resumed run (``--resume``) and a run reusing another's SFT model
(``--reuse-sft``) compare them key by key, so the set of names and their meaning stay as they were. A
recipe sets the ones it uses through its own ``fields``; the pipeline (``retool.tasks.pipeline``) reads
only the generic ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from retool.config import Config, ConfigError, apply_overrides, load_config, override_config
from retool.jsonl import JsonObject
from retool.tasks.report import FlatSummary
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
DEMO_PRESET = "demo"


def seed_overrides(seed: int) -> list[str]:
    """One seed for everything the demo draws: tasks and their order, model, SFT, sampling, evaluation."""
    return [f"train.seed={seed}", f"data.seed={seed}", f"eval.seed={seed}"]


class DemoFields(TypedDict, total=False):
    """The demo-only fields of ``DemoSettings`` as keywords (what a recipe's ``fields`` set)."""

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


@dataclass(frozen=True)
class DemoSettings:
    """The demo's settings: a ``Config`` (the ``demo`` preset) plus the knobs only the demo has.

    ``out``: the run folder; ``size``: the tiny model's size (``test`` trains in seconds, for tests);
    ``eval_modes``: the evaluated modes; ``plots``: draw them; ``reuse_sft``: a finished demo run folder
    whose SFT model and SFT evaluation (same tasks and SFT settings) this run starts from, redoing only
    RL and its evaluation, e.g. to compare RL settings on one SFT model.

    Real models (``config.model.name`` a name from ``retool.tasks.real_model`` or a GGUF / HF path; the
    ``demo-smollm2`` preset): ``test_hard_fraction`` (hard share of the held-out split; None: the train
    split's), ``gsm8k_problems`` (GSM8K test problems added to the held-out set, from ``data_dir``),
    ``base_eval_problems`` (zero-shot eval of the model before SFT on every k-th held-out problem, in
    ``base_eval_modes``).
    ``task``: the recipe's task (``retool.recipes``): ``synthetic`` (the task family) or ``gsm8k``
    (``retool.recipes.gsm8k``, real models only:
    cold start from ``coldstart_rows`` annotated GSM8K train solutions, RL on GSM8K's train split (only
    problems solved in at most ``rl_max_solution_steps`` annotated steps, when > 0), the held-out set
    ``gsm8k_problems`` test problems) or ``mathematics`` (``retool.recipes.mathematics``, real models only:
    cold start from the model's own verified attempts, ``coldstart_samples`` at ``coldstart_temperature``
    on ``coldstart_rows`` train problems *per module*; RL on the generated train split; held out: the first
    ``mathematics_problems`` questions of every interpolate and extrapolate module).
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
    test_hard_fraction: float | None = None
    gsm8k_problems: int = 0
    data_dir: str | None = None
    base_eval_problems: int = 0
    base_eval_modes: tuple[str, ...] = ("retool",)
    task: str = "synthetic"
    coldstart_rows: int = 0
    coldstart_samples: int = 2
    coldstart_temperature: float = 0.7
    mathematics_problems: int = 0
    rl_max_solution_steps: int = 0
    eval_temperature: float | None = None
    resume: bool = False

    @classmethod
    def load(
        cls, overrides: Sequence[str] = (), *, config: str | Path = DEMO_PRESET, **fields: Unpack[DemoFields]
    ) -> DemoSettings:
        """Settings from ``config`` (a preset or TOML file) and ``overrides``: ``section.key=value`` for the
        config, ``field=value`` (no dot) for a demo-only field; ``fields`` set demo-only fields directly."""
        return cls(config=load_config(config), **fields).with_overrides(overrides)

    def with_overrides(self, overrides: Sequence[str]) -> DemoSettings:
        config_sets = [o for o in overrides if "." in o.partition("=")[0]]
        own = {k: v for k, v in (_demo_field(o) for o in overrides if o not in config_sets)}
        return dataclasses.replace(self, config=override_config(self.config, config_sets), **own)

    def with_seed(self, seed: int) -> DemoSettings:
        return self.with_overrides(seed_overrides(seed))

    @property
    def seed(self) -> int:
        return self.config.train.seed

    def as_dict(self) -> JsonObject:
        """What ``settings.json`` / ``report.json`` record: the demo-only fields, the seed, the config."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return {
            **own,
            "eval_modes": list(self.eval_modes),
            "base_eval_modes": list(self.base_eval_modes),
            "seed": self.seed,
            "config": self.config.model_dump(),
        }


def _demo_field(override: str) -> tuple[str, Any]:  # a field chosen by name: its type is the value's
    name = override.partition("=")[0].strip()
    known = [f.name for f in dataclasses.fields(DemoSettings) if f.name != "config"]
    if name not in known:
        raise ConfigError(
            f"override {override!r}: not section.key=value, nor a demo field ({', '.join(known)})"
        )
    value = apply_overrides({}, [override])[name]
    return name, tuple(value) if isinstance(value, list) else value


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
