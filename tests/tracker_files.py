"""Reading what SwanLab and W&B wrote in a run folder, through their own record formats.

Both write a LevelDB-style log of protobuf records (32 KiB blocks, 7-byte record headers after a 7-byte
file header): SwanLab ``run-<id>.swanlab`` (read with SwanLab's own ``DataStoreReader``), W&B
``run-<id>.wandb`` (W&B 0.2x+ reads it in Go only, so the block format is walked here and each record
parsed with W&B's ``Record`` protobuf).
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path

Scalars = dict[str, dict[int, float]]  # metric -> step -> value

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def swanlab_runs(folder: Path) -> list[tuple[str, Scalars]]:
    """(run id, scalars) of each ``run-*.swanlab`` file under ``folder``, oldest first."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs = []
    for path in sorted(folder.glob("run-*/run-*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        run_id, scalars = "", {}
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                run_id = record.start.id
            elif kind == "scalar":
                value = record.scalar.value.number
                scalars.setdefault(record.scalar.key, {})[record.scalar.step] = value
        reader.close()
        runs.append((run_id, scalars))
    return runs


def swanlab_resume_modes(folder: Path) -> list[str]:
    """The resume mode each ``run-*.swanlab`` file under ``folder`` starts with (what a sync follows)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.proto.swanlab.run.v1.run_pb2 import ResumeMode
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    modes = []
    for path in sorted(folder.glob("run-*/run-*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "start":
                modes.append(ResumeMode.Name(record.start.resume))
        reader.close()
    return modes


def swanlab_dashboard(folder: Path) -> dict[str, Scalars]:
    """What ``swanlab watch folder`` shows (local mode): each experiment's scalars, from the dashboard's
    database (``runs.swanlab``: tag name -> log folder) and the per-tag logs it reads."""
    db = sqlite3.connect(folder / "runs.swanlab")
    try:
        rows = db.execute(
            "SELECT experiment.run_id, tag.name, tag.folder FROM tag JOIN experiment "
            "ON tag.experiment_id = experiment.id"
        ).fetchall()
    finally:
        db.close()
    out: dict[str, Scalars] = {}
    for run_folder, tag, tag_folder in rows:
        series = out.setdefault(run_folder, {}).setdefault(tag, {})
        for log in sorted((folder / run_folder / "logs" / tag_folder).glob("*.log")):
            for line in log.read_text(encoding="utf-8").splitlines():
                point = json.loads(line)
                series[int(point["index"])] = float(point["data"])
    return out


def _leveldb_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # block tail padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def wandb_runs(folder: Path) -> list[tuple[str, Scalars]]:
    """(run id, scalars) of each offline run folder under ``folder`` (``RUN_DIR/wandb``), oldest first."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        run_id, scalars = "", {}
        for data in _leveldb_records(path):
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): item.value_json for item in record.history.item
                }
                step = int(json.loads(items.pop("_step")))
                for key, value in items.items():
                    if not key.startswith("_"):
                        scalars.setdefault(key, {})[step] = float(json.loads(value))
        runs.append((run_id, scalars))
    return runs


def merged(runs: list[tuple[str, Scalars]]) -> Scalars:
    """The scalars of several files of one run, later files winning (what a sync in order gives)."""
    out: Scalars = {}
    for _, scalars in runs:
        for key, series in scalars.items():
            out.setdefault(key, {}).update(series)
    return out
