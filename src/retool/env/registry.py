"""Environments by name: what ``data.train_path`` and ``retool eval --dataset`` resolve through.

A name registered here builds its environment with ``factory(name, options)``; anything else is a path
(or a Hub id): a folder ``retool prepare dapo`` wrote is DAPO with its dev split, any other path a file
of problems. Built in: ``tasks`` (the synthetic family), ``gsm8k`` (train / test), ``dapo``, ``aime2025``, ``aime2024``,
``math500``. ``register_env`` adds more (e.g. from a user's own module) before a run is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from retool.config import Config, DataConfig
from retool.data.evalsets import NAMED_SETS
from retool.env.base import EnvError, ProblemEnv
from retool.env.files import DapoEnv, FileEnv, dapo_env, named_set_env
from retool.env.gsm8k import Gsm8kEnv
from retool.env.synthetic import TaskFamilyEnv


@dataclass(frozen=True)
class EnvOptions:
    """What a factory may read besides the name: the ``[data]`` section, and field names given
    explicitly (e.g. ``retool eval --question-field``), which win over a set's own."""

    data: DataConfig = field(default_factory=DataConfig)
    fields: Mapping[str, str] = field(default_factory=dict)


EnvFactory = Callable[[str, EnvOptions], ProblemEnv]

_FACTORIES: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory) -> None:
    """Make ``name`` (as ``data.train_path`` or ``--dataset``) build its environment with ``factory``."""
    _FACTORIES[name] = factory


def registered_envs() -> list[str]:
    return sorted(_FACTORIES)


def make_env(source: str, options: EnvOptions | None = None) -> ProblemEnv:
    """The environment ``source`` names: a registered name, a prepared DAPO folder, or a file / Hub id."""
    opts = options or EnvOptions()
    if not source:
        raise EnvError(
            "no problems named: set data.train_path to a file or to one of " + ", ".join(registered_envs())
        )
    factory = _FACTORIES.get(source)
    if factory is not None:
        return factory(source, opts)
    if Path(source).is_dir() and DapoEnv.is_prepared(source):
        return DapoEnv(source, shuffle=opts.data.shuffle, name=source)
    return FileEnv(source, opts.fields, shuffle=opts.data.shuffle)


def env_from_config(config: Config | DataConfig) -> ProblemEnv:
    """The training environment of a run: ``data.train_path`` with the ``[data]`` section's options."""
    data = config.data if isinstance(config, Config) else config
    # Only names changed from the defaults: a default name leaves the reader its own fallbacks.
    default = DataConfig()
    fields = {
        key: getattr(data, key)
        for key in ("question_field", "answer_field")
        if getattr(data, key) != getattr(default, key)
    }
    return make_env(data.train_path, EnvOptions(data=data, fields=fields))


def _tasks(name: str, options: EnvOptions) -> ProblemEnv:
    d = options.data
    return TaskFamilyEnv(
        count=d.task_count,
        test_count=d.task_test_count,
        seed=d.seed,
        hard_fraction=d.task_hard_fraction,
        kinds=d.task_kinds,
        shuffle=d.shuffle,
        name=name,
    )


def _named_set(name: str, options: EnvOptions) -> ProblemEnv:
    return named_set_env(name, options.data.data_dir, options.fields, shuffle=options.data.shuffle)


def _dapo(name: str, options: EnvOptions) -> ProblemEnv:
    return dapo_env(options.data.data_dir, shuffle=options.data.shuffle)


def _gsm8k(name: str, options: EnvOptions) -> ProblemEnv:
    return Gsm8kEnv(options.data.data_dir, shuffle=options.data.shuffle, name=name)


register_env("tasks", _tasks)
register_env("gsm8k", _gsm8k)
register_env("dapo", _dapo)
for _name in NAMED_SETS:
    register_env(_name, _named_set)
