"""Row readers: local JSONL / JSON / parquet files and Hugging Face Hub datasets, as ``(row_number, row)``.

Readers never raise on a bad row; they yield a :class:`BadRow` marker (with its 1-based line or row number
and the reason) so the caller counts and logs it and goes on. Only a source that cannot be opened at all
(missing file, unknown name, a needed optional package not installed, the Hub unreachable) raises
:class:`DataError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from retool.errors import UserError
from retool.jsonl import jsonl_lines

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(UserError):
    """A data source that cannot be used at all: missing file, unknown name, missing optional package."""


@dataclass(frozen=True)
class BadRow:
    """A row that could not even be read as a JSON object."""

    number: int
    reason: str
    detail: str = ""


RowItem = tuple[int, dict[str, object] | BadRow]  # a row's values: whatever its file format holds


def looks_like_hub_id(source: str) -> bool:
    """``owner/name`` with no file suffix and no such local path."""
    if Path(source).exists() or source.endswith(LOCAL_SUFFIXES):
        return False
    parts = source.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts)


def iter_jsonl_rows(path: Path) -> Iterator[RowItem]:
    # Bytes first (``retool.jsonl``: lines end at "\n" only): one undecodable line must not abort the file.
    for line in jsonl_lines(path):
        number = line.number
        try:
            text = line.text
        except UnicodeDecodeError as exc:
            yield number, BadRow(number, "bad_encoding", str(exc)[:120])
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            yield number, BadRow(number, "malformed_json", str(exc)[:120])
            continue
        if not isinstance(row, dict):
            yield number, BadRow(number, "not_an_object", type(row).__name__)
            continue
        yield number, row


def iter_json_array(path: Path) -> Iterator[RowItem]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        # Not one JSON document: maybe JSONL with a .json name.
        yield from iter_jsonl_rows(path)
        return
    if isinstance(data, dict):
        # {"data": [...]} / {"rows": [...]} style wrappers.
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else [data]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for number, row in enumerate(data, start=1):
        if isinstance(row, dict):
            yield number, row
        else:
            yield number, BadRow(number, "not_an_object", type(row).__name__)


def iter_parquet(path: Path) -> Iterator[RowItem]:
    try:
        import pyarrow.parquet as pq  # deferred: pyarrow is optional (the parquet extra)
    except ImportError as exc:
        raise DataError(
            f"reading parquet ({path}) needs pyarrow: pip install pyarrow (or 'retool-rl[parquet]'), "
            "or convert the file to JSONL"
        ) from exc
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc
    number = 0
    # Batches keep memory flat on the full 1.79M-row Hub file.
    for batch in parquet.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def iter_local(path: Path) -> Iterator[RowItem]:
    if not path.exists():
        raise DataError(f"file not found: {path}")
    if path.is_dir():
        raise DataError(f"{path} is a directory; give a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return iter_parquet(path)
    if suffix == ".json":
        return iter_json_array(path)
    return iter_jsonl_rows(path)


def iter_hub(hub_id: str, split: str, config_name: str | None = None) -> Iterator[RowItem]:
    try:
        import datasets  # deferred: datasets is optional (the hub extra)
    except ImportError as exc:
        raise DataError(
            f"loading {hub_id!r} from the Hugging Face Hub needs the datasets package: "
            "pip install 'retool-rl[hub]' (or give a local .jsonl/.parquet file)"
        ) from exc
    try:
        dataset = datasets.load_dataset(hub_id, config_name, split=split)
    except Exception as exc:  # offline, no such repo, no such split: all mean "cannot use this source"
        raise DataError(
            f"loading {hub_id!r} (split {split!r}) from the Hugging Face Hub failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    logger.info("loaded %s split %s from the Hub: %d rows", hub_id, split, len(dataset))
    return _enumerate_rows(dataset)


def _enumerate_rows(rows: Iterable[object]) -> Iterator[RowItem]:
    for number, row in enumerate(rows, start=1):
        if isinstance(row, dict):
            yield number, row
        else:
            yield number, BadRow(number, "not_an_object", type(row).__name__)
