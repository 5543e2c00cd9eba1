"""Problem sources by name: what ``data.source`` and ``retool eval --dataset`` resolve through.

A name registered here builds its source with ``factory(name, options)``; anything else is a path
(or a Hub id): a folder ``retool prepare dapo`` wrote is DAPO with its dev split, any other path a file
of problems. Built in: ``synthetic`` (the task family), ``gsm8k`` (train / test), ``dapo``, ``aime2025``, ``aime2024``,
``math500``, ``mathematics`` (DeepMind Mathematics: train / interpolate + extrapolate; ``mathematics_interpolate``
and ``mathematics_extrapolate`` evaluate on one test split). ``register_source`` adds more (e.g. from a user's own module) before a run is built.

A source may take options of its own: ``[data.options]`` of a config whose ``data.source`` names it,
validated by the pydantic model it was registered with (a source registered without one takes none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError

from retool.config import Config, DataConfig
from retool.data.evalsets import NAMED_SETS
from retool.data.mathematics import MathSplit
from retool.env.files import DapoSource, FileSource, dapo_source, named_set_source
from retool.env.gsm8k import Gsm8kSource
from retool.env.mathematics import MathematicsSource
from retool.env.source import ProblemSource, SourceError
from retool.env.synthetic import SyntheticSourceOptions, TaskFamilySource


@dataclass(frozen=True)
class SourceOptions:
    """What a factory may read besides the name: the ``[data]`` section, field names given explicitly
    (e.g. ``retool eval --question-field``), which win over a set's own, and the source's own options
    (``own``: ``[data.options]`` validated, for the source ``data.source`` names; else the defaults)."""

    data: DataConfig = field(default_factory=DataConfig)
    fields: Mapping[str, str] = field(default_factory=dict)
    own: BaseModel | None = None


SourceFactory = Callable[[str, SourceOptions], ProblemSource]


@dataclass(frozen=True)
class _Registered:
    factory: SourceFactory
    options: type[BaseModel] | None


_SOURCES: dict[str, _Registered] = {}


def register_source(name: str, factory: SourceFactory, options: type[BaseModel] | None = None) -> None:
    """Make ``name`` (as ``data.source`` or ``--dataset``) build its source with ``factory``; ``options``:
    the model its ``[data.options]`` are validated by (None: it takes none)."""
    _SOURCES[name] = _Registered(factory, options)


def registered_sources() -> list[str]:
    return sorted(_SOURCES)


def make_source(source: str, options: SourceOptions | None = None) -> ProblemSource:
    """The problem source ``source`` names: a registered name, a prepared DAPO folder, or a file / Hub id."""
    opts = options or SourceOptions()
    if not source:
        raise SourceError(
            "no problems named: set data.source to a file or to one of " + ", ".join(registered_sources())
        )
    # [data.options] belong to the training source: a held-out set named beside it keeps its defaults.
    given = opts.data.options if source == opts.data.source else {}
    registered = _SOURCES.get(source)
    if registered is not None:
        own = _own_options(source, registered.options, given)
        return registered.factory(source, dataclasses.replace(opts, own=own))
    if given:
        raise SourceError(f"data.options: {source!r} is a file or folder of problems, which takes no options")
    if Path(source).is_dir() and DapoSource.is_prepared(source):
        return DapoSource(source, shuffle=opts.data.shuffle, name=source)
    return FileSource(source, opts.fields, shuffle=opts.data.shuffle)


def _own_options(source: str, model: type[BaseModel] | None, given: Mapping[str, object]) -> BaseModel | None:
    if model is None:
        if given:
            raise SourceError(
                f"data.options: the {source!r} source takes no options (given: {', '.join(given)})"
            )
        return None
    try:
        return model.model_validate(dict(given))
    except ValidationError as exc:
        problems = [f"data.options.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise SourceError(f"the {source!r} source: " + "; ".join(problems)) from None


def source_from_config(config: Config | DataConfig) -> ProblemSource:
    """The training problem source of a run: ``data.source`` with the ``[data]`` section's options."""
    data = config.data if isinstance(config, Config) else config
    # Only names changed from the defaults: a default name leaves the reader its own fallbacks.
    default = DataConfig()
    fields = {
        key: getattr(data, key)
        for key in ("question_field", "answer_field")
        if getattr(data, key) != getattr(default, key)
    }
    return make_source(data.source, SourceOptions(data=data, fields=fields))


def _synthetic(name: str, options: SourceOptions) -> ProblemSource:
    own = options.own
    assert isinstance(own, SyntheticSourceOptions)
    return TaskFamilySource(
        count=own.count,
        test_count=own.test_count,
        seed=options.data.seed,
        hard_fraction=own.hard_fraction,
        kinds=own.kinds,
        shuffle=options.data.shuffle,
        name=name,
    )


def _named_set(name: str, options: SourceOptions) -> ProblemSource:
    return named_set_source(name, options.data.data_dir, options.fields, shuffle=options.data.shuffle)


def _dapo(name: str, options: SourceOptions) -> ProblemSource:
    return dapo_source(options.data.data_dir, shuffle=options.data.shuffle)


def _gsm8k(name: str, options: SourceOptions) -> ProblemSource:
    return Gsm8kSource(options.data.data_dir, shuffle=options.data.shuffle, name=name)


_MATHEMATICS_TESTS: dict[str, tuple[MathSplit, ...]] = {
    "mathematics": ("interpolate", "extrapolate"),
    "mathematics_interpolate": ("interpolate",),
    "mathematics_extrapolate": ("extrapolate",),
}


def _mathematics(name: str, options: SourceOptions) -> ProblemSource:
    d = options.data
    return MathematicsSource(d.data_dir, shuffle=d.shuffle, test_splits=_MATHEMATICS_TESTS[name], name=name)


register_source("synthetic", _synthetic, SyntheticSourceOptions)
for _name in _MATHEMATICS_TESTS:
    register_source(_name, _mathematics)
register_source("gsm8k", _gsm8k)
register_source("dapo", _dapo)
for _name in NAMED_SETS:
    register_source(_name, _named_set)
