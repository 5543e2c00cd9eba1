"""The one reader of the JSONL files the project writes (records, metrics, trajectories, evaluations).

A record is one line ended by ``"\\n"``, and only by it. ``str.splitlines()`` also splits on U+0085,
U+2028, U+2029 (and other separators) that model text carries raw into a record written with
``ensure_ascii=False``, which cuts such a record in two; so every read goes through here, in binary
mode, where only ``b"\\n"`` ends a line. Blank lines are skipped. What to do with a line that does not
parse is the caller's choice (``errors``): ``raise`` a ``JsonlError`` naming the file and line,
``warn`` (log and skip) or ``skip``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

logger = logging.getLogger(__name__)

OnError = Literal["raise", "warn", "skip"]

# What ``json.loads`` can return; a reader narrows it with ``isinstance`` before use.
JsonValue: TypeAlias = str | int | float | bool | list["JsonValue"] | dict[str, "JsonValue"] | None
JsonObject: TypeAlias = dict[str, JsonValue]


class JsonlError(ValueError):
    """A line of a JSONL file that is not JSON (the message names the file and the line)."""


@dataclass(frozen=True)
class JsonlLine:
    """One non-blank line: its 1-based number, its bytes (newline excluded), whether a newline ended it."""

    number: int
    raw: bytes
    complete: bool

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8")


def jsonl_lines(path: str | Path) -> Iterator[JsonlLine]:
    """The non-blank lines of ``path``, split on ``b"\\n"`` only (binary iteration does exactly that)."""
    with Path(path).open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            complete = raw.endswith(b"\n")
            body = raw[:-1] if complete else raw
            if body.strip():
                yield JsonlLine(number, body, complete)


def iter_jsonl(path: str | Path, errors: OnError = "raise") -> Iterator[JsonValue]:
    """The parsed lines of ``path``, in order; an unparsable line handled as ``errors`` says."""
    for line in jsonl_lines(path):
        try:
            yield json.loads(line.raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
            if errors == "raise":
                raise JsonlError(f"{path}:{line.number}: not a JSON line ({exc})") from None
            if errors == "warn":
                logger.warning("%s:%d: skipping an unreadable line", path, line.number)


def read_jsonl(path: str | Path, errors: OnError = "raise") -> list[JsonValue]:
    """Every parsed line of ``path`` (see ``iter_jsonl``)."""
    return list(iter_jsonl(path, errors))


def read_jsonl_objects(path: str | Path, errors: OnError = "raise") -> list[JsonObject]:
    """Every line of ``path``, each a JSON object: a line holding another JSON value is a ``JsonlError``."""
    out: list[JsonObject] = []
    for number, obj in enumerate(iter_jsonl(path, errors), start=1):
        if not isinstance(obj, dict):
            raise JsonlError(f"{path}: record {number} is a JSON {type(obj).__name__}, not an object")
        out.append(obj)
    return out


def as_number(value: JsonValue) -> int | float:
    """``value`` itself when it is a JSON number; a ``TypeError`` naming what it is otherwise."""
    if isinstance(value, int | float):
        return value
    raise TypeError(f"expected a JSON number, got {type(value).__name__}")


def as_list(value: JsonValue) -> list[JsonValue]:
    """``value`` itself when it is a JSON array; a ``TypeError`` naming what it is otherwise."""
    if isinstance(value, list):
        return value
    raise TypeError(f"expected a JSON array, got {type(value).__name__}")


def as_object(value: JsonValue) -> JsonObject:
    """``value`` itself when it is a JSON object; a ``TypeError`` naming what it is otherwise."""
    if isinstance(value, dict):
        return value
    raise TypeError(f"expected a JSON object, got {type(value).__name__}")


def first_jsonl_object(path: str | Path) -> JsonObject | None:
    """The first line of ``path`` if it is a JSON object; ``None`` if it is not, or the file cannot be read."""
    try:
        for line in jsonl_lines(path):
            obj = json.loads(line.raw)
            return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
    return None
