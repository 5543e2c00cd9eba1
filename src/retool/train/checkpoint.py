"""Atomic training checkpoints with keep-last-K, and the metrics-log repair that makes resume exact.

Layout under ``RUN_DIR/checkpoints/``::

    step_000050/            one complete checkpoint
        trainer_state.json  step, data position, metrics bookkeeping, backend state path (written last)
        rng.pt              Python / NumPy / torch RNG states
        backend/            whatever the training backend saved (local backends)
        pipeline.json       off-policy pipelining only: batches sampled for later steps, not yet trained
                            (JSON records of their dataclasses, ``retool.train.state_json``)
        selection.json      data.selection = "pass_rate" only: the selector's state (plain JSON: its
                            pass-rate counts, cursors and draw count; ``retool.train.selection``)
    latest                  the name of the newest complete checkpoint (written after the rename)

A checkpoint is built in a hidden temp folder and renamed into place, and ``latest`` is replaced
atomically after that; a SIGKILL at any moment leaves either the previous checkpoint or the new one,
never a half-written one that ``latest`` points to.

A write that fails (a full disk, a quota, an I/O error, whatever layer reports it: the OS, torch's zip
writer, safetensors) raises ``CheckpointWriteError`` naming the checkpoint, the file or stage that failed,
the folder, and the checkpoint a resume would start from; the half-written temp folder is removed at once
(it would only hold more of the full disk), and the previous checkpoint is never touched before the new
one is complete.

This module is the one owner of the layout: ``backend_state_of`` tells every other stage (``retool eval
--checkpoint``) which backend state a run folder, its ``checkpoints`` folder or one checkpoint holds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar

import numpy as np
import numpy.typing as npt

from retool.jsonl import JsonObject, jsonl_lines
from retool.train.state_json import RecordError, from_record, to_record

if TYPE_CHECKING:  # the name only: torch is imported where a state is taken or restored (see capture_rng)
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
PIPELINE_FILE = "pipeline.json"
SELECTION_FILE = "selection.json"
# Raised whenever a checkpoint's files change shape, including a field of the dataclasses recorded in
# ``pipeline.json``: a checkpoint of another format is refused, never read half-right.
CHECKPOINT_FORMAT = 2


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected; the message says where and why."""


class RunWriteError(RuntimeError):
    """A write of the run's record (a checkpoint, the metrics log) failed; the message says what, where,
    and what a resume would start from. Nothing written before is damaged."""


class CheckpointWriteError(RunWriteError):
    """Writing a checkpoint failed; the previous checkpoint is intact."""


@dataclass
class TrainerState:
    """``trainer_state.json``: what a resume needs besides the weights."""

    step: int  # training steps completed
    data_position: dict[str, int]
    metrics_line: JsonObject | None = None  # the metrics of `step`, re-appended on resume
    metrics_offset: int = 0  # bytes of metrics.jsonl holding steps < `step`
    backend_state: str = ""  # path (relative to the checkpoint folder when local) or remote URI
    backend_state_is_local: bool = True
    extra: JsonObject = field(default_factory=dict)
    format: int = (
        CHECKPOINT_FORMAT  # the layout of the whole checkpoint, the queued batches' records included
    )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: Path | str = STATE_FILE) -> TrainerState:
        """The state ``text`` records; a ``CheckpointError`` in one line for a checkpoint of another format
        (no compatibility code before a tagged release: resume it with the version that wrote it)."""
        data = json.loads(text)
        written = data.get("format") if isinstance(data, dict) else None
        if written != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{where}: a checkpoint of format {written}, written by another version of retool (this one "
                f"reads format {CHECKPOINT_FORMAT}); resume it with that version, or start a new run"
            )
        return cls(**data)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` all at once: the old content stays until the new one is on disk."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a partial temp file would only take more of a full disk
        raise
    _fsync_dir(path.parent)


class RngState(TypedDict, total=False):
    """``rng.pt``: the generators' states (torch's only where torch is installed, CUDA's where present)."""

    python: tuple[object, ...]
    numpy: dict[str, object] | tuple[str, npt.NDArray[np.uint32], int, int, float]
    torch: torch.Tensor
    cuda: list[torch.Tensor]


def capture_rng() -> RngState:
    state: RngState = {"python": random.getstate()}
    state["numpy"] = np.random.get_state()
    try:
        import torch  # deferred: torch (~2 s); `retool view` and `analyze` use this package without it

        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
    except ImportError:
        pass
    return state


def restore_rng(state: RngState) -> None:
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch  # deferred: as in capture_rng

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last: int = 3) -> None:
        self.root = Path(run_dir) / CHECKPOINTS
        self.keep_last = keep_last

    @staticmethod
    def name_for(step: int) -> str:
        return f"step_{step:06d}"

    def begin(self, step: int) -> Path:
        """A fresh hidden temp folder for the checkpoint of ``step`` (the backend saves into it)."""
        tmp = self.root / f".tmp-{self.name_for(step)}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            raise self.write_error(step, "creating its temp folder", tmp, exc) from exc
        return tmp

    def write_error(self, step: int, stage: str, where: Path, exc: BaseException) -> CheckpointWriteError:
        """The error for a failed write of checkpoint ``step``; removes its half-written temp folder."""
        tmp = self.root / f".tmp-{self.name_for(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        previous = self.latest()
        resume = (
            f"the previous checkpoint {previous} is intact and a resume starts from it"
            if previous is not None
            else "there is no earlier checkpoint, so a resume starts from step 0"
        )
        return CheckpointWriteError(
            f"checkpoint {self.name_for(step)}: {stage} ({where}) failed: {type(exc).__name__}: {exc}; "
            f"{resume} (retool train --resume {self.root.parent}) once the cause is fixed"
        )

    def commit(
        self,
        tmp: Path,
        state: TrainerState,
        backend_path: str,
        backend_is_local: bool,
    ) -> Path:
        """Finish the checkpoint in ``tmp`` and move it into place atomically; return its folder.

        A local ``backend_path`` inside ``tmp`` is stored relative to it, so the rename keeps it valid.
        """
        import torch  # deferred: as in capture_rng

        path = backend_path
        if backend_is_local:
            p = Path(backend_path).resolve()
            try:
                path = str(p.relative_to(tmp.resolve()))
            except ValueError:
                path = str(p)
        state.backend_state = path
        state.backend_state_is_local = backend_is_local
        stage, where = "writing the RNG state", tmp / "rng.pt"
        try:
            torch.save(capture_rng(), where)
            stage, where = "writing the trainer state", tmp / STATE_FILE
            write_text_atomic(where, state.to_json())
            _fsync_dir(tmp)
        except Exception as exc:  # OSError, or torch's RuntimeError around the same ENOSPC
            raise self.write_error(state.step, stage, where, exc) from exc
        return self.publish(tmp, state.step)

    def publish(self, tmp: Path, step: int) -> Path:
        """Move the complete checkpoint in ``tmp`` into place, point ``latest`` at it, prune old ones."""
        name = self.name_for(step)
        final = self.root / name
        try:
            if final.exists():  # a stale copy of this step from a run that died after the rename
                shutil.rmtree(final)
            os.rename(tmp, final)
        except OSError as exc:
            raise self.write_error(step, "moving it into place", final, exc) from exc
        _fsync_dir(self.root)
        try:
            write_text_atomic(self.root / LATEST, name + "\n")
        except OSError as exc:
            # The new checkpoint is complete but the pointer still names the previous one, which is
            # complete too: a resume starts from that one and redoes the steps after it.
            raise CheckpointWriteError(
                f"checkpoint {name} is complete, but updating {self.root / LATEST} failed: "
                f"{type(exc).__name__}: {exc}; a resume starts from the checkpoint it names"
            ) from exc
        self._prune(keep=name)
        return final

    def _prune(self, keep: str) -> None:
        complete = self.complete_checkpoints()
        doomed = complete[: max(0, len(complete) - self.keep_last)] if self.keep_last > 0 else []
        for path in doomed:
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True)
        for leftover in self.root.glob(".tmp-*"):  # from a run killed while writing
            shutil.rmtree(leftover, ignore_errors=True)

    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if (p / STATE_FILE).is_file())

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to (the newest complete one if the pointer is missing)."""
        pointer = self.root / LATEST
        if pointer.is_file():
            name = pointer.read_text(encoding="utf-8").strip()
            path = self.root / name
            if (path / STATE_FILE).is_file():
                return path
            logger.warning(
                "checkpoint pointer names %s, which is incomplete; using the newest complete one", name
            )
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def write_pipeline(self, tmp: Path, step: int, payload: object) -> None:
        """Store the pipeline's queued batches (``retool.train.ahead.PipelineState``) in the checkpoint
        being built in ``tmp``, as JSON records of their dataclasses (``retool.train.state_json``)."""
        where = tmp / PIPELINE_FILE
        try:
            text = json.dumps(to_record(payload), separators=(",", ":"))
            with open(where, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        except Exception as exc:  # a full disk, as for every other file of the checkpoint
            raise self.write_error(step, "writing the queued batches", where, exc) from exc

    @staticmethod
    def load_pipeline(path: Path, kind: type[T]) -> T | None:
        """The pipeline state stored in checkpoint ``path``, a ``kind``; None when it stores none
        (synchronous runs). A ``CheckpointError`` in one line when the file holds something else."""
        where = path / PIPELINE_FILE
        if not where.is_file():
            return None
        try:
            payload = from_record(json.loads(where.read_text(encoding="utf-8")))
        except (ValueError, RecordError) as exc:  # not JSON, or records this version cannot read
            raise CheckpointError(f"{where}: {exc}") from None
        if not isinstance(payload, kind):
            raise CheckpointError(f"{where}: holds a {type(payload).__name__}, not a {kind.__name__}")
        return payload

    def write_selection(self, tmp: Path, step: int, state: JsonObject) -> None:
        """Store the pass-rate selector's state (``retool.train.selection``) in the checkpoint being built
        in ``tmp``, as JSON."""
        where = tmp / SELECTION_FILE
        try:
            write_text_atomic(where, json.dumps(state, sort_keys=True))
        except OSError as exc:  # a full disk, as for every other file of the checkpoint
            raise self.write_error(step, "writing the selection state", where, exc) from exc

    @staticmethod
    def load_selection(path: Path) -> JsonObject | None:
        """The selector's state stored in checkpoint ``path``; None when it stores none (epoch order)."""
        where = path / SELECTION_FILE
        if not where.is_file():
            return None
        try:
            state = json.loads(where.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise CheckpointError(f"{where}: unreadable ({exc})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{where}: holds a JSON {type(state).__name__}, not an object")
        return state

    @staticmethod
    def load(path: Path) -> tuple[TrainerState, RngState, str]:
        """Trainer state, RNG state and the backend state path (absolute when local)."""
        import torch  # deferred: as in capture_rng

        state = TrainerState.from_json((path / STATE_FILE).read_text(encoding="utf-8"), path / STATE_FILE)
        rng = torch.load(path / "rng.pt", weights_only=False)
        backend = state.backend_state
        if state.backend_state_is_local and backend and not os.path.isabs(backend):
            backend = str(path / backend)
        return state, rng, backend


def repair_metrics(metrics_path: Path, state: TrainerState) -> int:
    """Make ``metrics.jsonl`` hold exactly steps 1..state.step: drop later (and partial) lines.

    Keeps every well-formed line for a step below the checkpoint's, then writes the checkpoint's own
    step line from the checkpoint (it may or may not have reached the file before the kill). Returns the
    number of lines dropped. Written atomically.
    """
    kept: list[str] = []
    seen: set[int] = set()
    dropped = 0
    if metrics_path.is_file():
        for entry in jsonl_lines(metrics_path):
            try:
                raw = entry.text
                obj = json.loads(raw)
            except ValueError:  # a torn line (JSONDecodeError, or a cut multi-byte character)
                dropped += 1
                continue
            if (
                isinstance(obj, dict)
                and isinstance(obj.get("step"), int)
                and obj["step"] < state.step
                and obj["step"] not in seen
            ):
                seen.add(obj["step"])
                kept.append(raw)
            else:
                dropped += 1
    if state.metrics_line is not None:
        line = json.dumps(state.metrics_line, sort_keys=True)
        kept.append(line)
        dropped -= 1  # the checkpoint's own line was probably there already
    text = "".join(f"{line}\n" for line in kept)
    write_text_atomic(metrics_path, text)
    return max(dropped, 0)


def _trainer_state(folder: Path) -> JsonObject | None:
    """The raw trainer state of a checkpoint folder; None when ``folder`` is not one. (The local backend
    writes a file of the same name into its own state folder, without ``backend_state``.)"""
    state_file = folder / STATE_FILE
    if not state_file.is_file():
        return None
    try:
        data = json.loads(state_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{state_file}: unreadable ({exc})") from None
    return data if isinstance(data, dict) and "backend_state" in data else None


def backend_state_of(path: str) -> str:
    """What ``load_state`` needs, from what a user naturally passes.

    A training run folder (uses ``checkpoints/latest``), its ``checkpoints`` folder, or one checkpoint
    folder ``step_NNNNNN`` resolve to the backend state saved in it; anything else (a backend state
    folder, a remote URI) is passed through unchanged. Raises ``CheckpointError`` when ``latest`` names
    an incomplete checkpoint or a checkpoint records no backend state.
    """
    folder = Path(path)
    if not folder.is_dir():
        return path
    for root in (folder / CHECKPOINTS, folder):
        pointer = root / LATEST
        if pointer.is_file():
            name = pointer.read_text(encoding="utf-8").strip()
            if _trainer_state(root / name) is None:
                raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint")
            folder = root / name
            break
    state = _trainer_state(folder)
    if state is None:
        return str(folder)
    backend = str(state.get("backend_state") or "")
    if not backend:
        raise CheckpointError(f"{folder / STATE_FILE} records no backend state to load")
    if state.get("backend_state_is_local", True) and not os.path.isabs(backend):
        return str(folder / backend)
    return backend
