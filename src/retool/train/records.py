"""The run's ``trajectories.jsonl``: which trajectories of a step are kept, which datum trained each, and
the writer and reader of the file. The record shape itself is ``retool.rollout.records``'s (shared with
evaluation).
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal, cast

from retool.backends.interface.types import Datum
from retool.jsonl import JsonObject
from retool.rollout.records import RECORD_VERSION, Decode, TrajectoryRecord, trajectory_record
from retool.rollout.types import Trajectory
from retool.train.step import StepData, group_advantages

logger = logging.getLogger(__name__)

__all__ = [
    "RECORD_VERSION",
    "TRAJECTORIES_FILE",
    "TrajectoryLog",
    "cut_from_step",
    "datum_advantage",
    "read_json_objects",
    "read_records",
    "select_groups",
    "trajectory_record",
]

TRAJECTORIES_FILE = "trajectories.jsonl"
GroupsPerStep = int | Literal["all"]


# -- training: the advantage a datum carries ------------------------------------------------------


def datum_advantage(datum: Datum) -> float | None:
    """The advantage a datum carries on its trained positions (the same on all of them)."""
    return next((a for a, w in zip(datum.advantages, datum.weights, strict=False) if w != 0.0), None)


# -- the run's trajectories.jsonl ---------------------------------------------------------------------


def select_groups(n_groups: int, groups_per_step: GroupsPerStep, seed: int, step: int) -> list[int]:
    """Which groups of a step to keep: all, none, or a seeded sample (the same again on a redone step)."""
    if groups_per_step == "all" or groups_per_step >= n_groups:
        return list(range(n_groups))
    if groups_per_step <= 0:
        return []
    rng = random.Random(seed * 1_000_003 + step)
    return sorted(rng.sample(range(n_groups), groups_per_step))


class TrajectoryLog:
    """Appends sampled trajectories of each training step to ``trajectories.jsonl``.

    One ``write`` + flush + fsync per step, so a kill leaves at most a partial last line (readers skip
    it). On the first step a process writes, records of that step and later ones (left by a run killed
    after its last checkpoint and now resumed, or a partial line) are cut away first, which keeps the
    file in step with ``metrics.jsonl`` without the loop having to call a repair.
    """

    def __init__(self, path: str | Path, groups_per_step: GroupsPerStep = 2, seed: int = 0) -> None:
        self.path = Path(path)
        self.groups_per_step = groups_per_step
        self.seed = seed
        self._checked = False

    def write_step(
        self,
        step: int,
        groups: Sequence[Sequence[Trajectory]],
        data: StepData,
        origin: Sequence[Sequence[tuple[int, int]]] = (),
        decode: Decode | None = None,
    ) -> int:
        """Record the selected groups of ``step`` (every group it sampled); returns how many trajectories
        were written. ``data`` is what the step trained, built from its trained groups; ``origin`` says
        where each trained trajectory sits in ``groups`` (group, branch: ``Collected.origin``), empty when
        the trained groups are ``groups`` themselves.

        Never raises: the log is a by-product of training, so a failure here is logged, not fatal.
        """
        try:
            return self._write_step(step, groups, data, origin, decode)
        except Exception:
            logger.exception("writing the trajectories of step %d to %s failed", step, self.path)
            return 0

    def _write_step(
        self,
        step: int,
        groups: Sequence[Sequence[Trajectory]],
        data: StepData,
        origin: Sequence[Sequence[tuple[int, int]]],
        decode: Decode | None,
    ) -> int:
        if not self._checked:
            cut_from_step(self.path, step)
            self._checked = True
        chosen = select_groups(len(groups), self.groups_per_step, self.seed, step)
        if not chosen:
            return 0
        trained: dict[tuple[int, int], Datum] = {}
        for k, slots in enumerate(data.datum_index):
            for j, index in enumerate(slots):
                if index is not None:
                    trained[origin[k][j] if origin else (k, j)] = data.datums[index]
        lines: list[str] = []
        for g in chosen:
            group = groups[g]
            advantages = group_advantages([float(t.reward) for t in group])
            for b, traj in enumerate(group):
                datum = trained.get((g, b))
                advantage = datum_advantage(datum) if datum is not None else advantages[b]
                record = trajectory_record(
                    traj, source="train", advantage=advantage, datum=datum, step=step, decode=decode
                )
                record["group"] = g
                lines.append(json.dumps(record, ensure_ascii=False))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        return len(lines)


def cut_from_step(path: Path, step: int) -> int:
    """Truncate ``path`` before its first record with ``step >= step`` or its first unreadable line.

    Returns the bytes removed. Records are appended in step order, so everything after that point is
    from steps that will be redone.
    """
    if not path.exists():
        return 0
    offset = 0
    cut: int | None = None
    with path.open("rb") as fh:
        for raw in fh:
            try:
                obj = json.loads(raw) if raw.strip() else {}
                bad = not raw.endswith(b"\n") or int(obj.get("step", 0) or 0) >= step
            except (ValueError, AttributeError, TypeError):
                bad = True
            if bad:
                cut = offset
                break
            offset += len(raw)
    if cut is None:
        return 0
    size = path.stat().st_size
    with path.open("r+b") as fh:
        fh.truncate(cut)
        fh.flush()
        os.fsync(fh.fileno())
    logger.info("%s: dropped %d bytes of trajectories from step %d on (redone now)", path, size - cut, step)
    return size - cut


def read_json_objects(path: str | Path) -> Iterator[JsonObject]:
    """The JSON objects of a JSONL file, read-only; an unreadable line (a file being written) is skipped."""
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, Mapping):
                yield dict(obj)


def read_records(path: str | Path) -> Iterator[TrajectoryRecord]:
    """The records of a ``trajectories.jsonl``, read-only; an unreadable line (a run being written) is skipped.

    The keys are those ``trajectory_record`` wrote (the record is not total: readers use ``.get``).
    """
    for obj in read_json_objects(path):
        yield cast(TrajectoryRecord, obj)
