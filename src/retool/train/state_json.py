"""The dataclasses of this package as JSON records, for what a checkpoint keeps of the training pipeline
(``pipeline.json``: the batches sampled ahead and not yet trained, ``retool.train.ahead.PipelineState``).

A record names its class (``{"__type__": "retool.rollout.types:Trajectory", ...}``) and holds the fields
its constructor takes; tuples, sets and mappings keep their kind (a frozen record stays hashable, a
tuple field stays a tuple). Read back, a record may name only a dataclass of this package: unlike a
pickle, a file cannot name code to run. A record that no longer fits its class (a field renamed, or added
without a default) is refused in one line (``RecordError``), never read half-right; the checkpoint's format
number (``retool.train.checkpoint.CHECKPOINT_FORMAT``) changes with the fields of these classes.
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
from collections.abc import Mapping
from typing import Any

from retool.jsonl import JsonValue

TYPE, TUPLE, SET, ITEMS = "__type__", "__tuple__", "__set__", "__items__"
_PACKAGE = "retool"


class RecordError(ValueError):
    """A record that cannot be written, or read back into a class of this package."""


def to_record(value: Any) -> JsonValue:
    """``value`` as plain JSON: dataclasses of this package, tuples, lists, sets, mappings and numbers."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if not _ours(cls.__module__):
            raise RecordError(
                f"cannot record a {cls.__module__}.{cls.__qualname__}: not a class of {_PACKAGE}"
            )
        fields = {f.name: to_record(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {TYPE: f"{cls.__module__}:{cls.__qualname__}", **fields}
    if isinstance(value, tuple):
        return {TUPLE: [to_record(v) for v in value]}
    if isinstance(value, list):
        return [to_record(v) for v in value]
    if isinstance(value, set | frozenset):
        return {SET: [to_record(v) for v in value]}
    if isinstance(value, Mapping):
        return {ITEMS: [[to_record(k), to_record(v)] for k, v in value.items()]}
    raise RecordError(f"cannot record a {type(value).__name__}")


def from_record(record: JsonValue) -> Any:
    """What ``to_record`` wrote, rebuilt; ``RecordError`` naming the class a record no longer fits."""
    if isinstance(record, list):
        return [from_record(v) for v in record]
    if not isinstance(record, dict):
        return record
    if TUPLE in record:
        return tuple(from_record(v) for v in _list(record[TUPLE]))
    if SET in record:
        return frozenset(from_record(v) for v in _list(record[SET]))
    if ITEMS in record:
        return {from_record(k): from_record(v) for k, v in (_pair(p) for p in _list(record[ITEMS]))}
    name = record.get(TYPE)
    if not isinstance(name, str):
        raise RecordError(f"a JSON object that is not a record (no {TYPE}): keys {sorted(record)[:5]}")
    cls = _class(name)
    values = {k: from_record(v) for k, v in record.items() if k != TYPE}
    try:
        return cls(**values)
    except TypeError as exc:  # a field renamed or added without a default since the record was written
        raise RecordError(f"a {name} record does not fit its class: {exc}") from None


def _class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not _ours(module) or not qualname:
        raise RecordError(f"a record names {name!r}: only dataclasses of {_PACKAGE} are read back")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        raise RecordError(
            f"a record names {name!r}, which this version of {_PACKAGE} does not have"
        ) from None
    if not (isinstance(found, type) and dataclasses.is_dataclass(found)):
        raise RecordError(f"a record names {name!r}, which is not a dataclass")
    return found


def _ours(module: str) -> bool:
    return module == _PACKAGE or module.startswith(_PACKAGE + ".")


def _list(value: JsonValue) -> list[JsonValue]:
    if not isinstance(value, list):
        raise RecordError(f"expected a JSON list in a record, got {type(value).__name__}")
    return value


def _pair(value: JsonValue) -> tuple[JsonValue, JsonValue]:
    items = _list(value)
    if len(items) != 2:
        raise RecordError(f"a mapping item of {len(items)} values, not a key and a value")
    return items[0], items[1]
