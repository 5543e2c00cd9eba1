"""The phase bookkeeping of a demo run: which phases a run folder finished (``phases.json``), and each
phase's wall time and work counters (``Clock``), so a resumed run skips them and still reports the whole
time split."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TypedDict

from retool.backends.local.heap import release_free_memory
from retool.components import Components
from retool.pipeline.report import DemoResult
from retool.pipeline.settings import Event
from retool.train.checkpoint import write_text_atomic

PHASES_FILE = "phases.json"


class PhaseEntry(TypedDict, total=False):
    """A finished phase in ``phases.json``: its wall seconds and (when measured) its work counters."""

    seconds: float
    work: dict[str, float]


class Phases:
    """The finished phases of a run folder (``phases.json``) with their seconds and throughput: a resumed
    run skips them and still reports the whole time split."""

    def __init__(self, out: Path) -> None:
        self.path = out / PHASES_FILE
        self.data: dict[str, PhaseEntry] = (
            json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        )

    def done(self, name: str) -> bool:
        return name in self.data

    def record(self, name: str, entry: PhaseEntry) -> None:
        self.data[name] = entry
        write_text_atomic(self.path, json.dumps(self.data, indent=2) + "\n")


class Clock:
    """Phase timings of one demo run, reported through ``emit`` as each phase ends and kept in
    ``phases.json``; ``measure`` adds the backend's sampling / training counters and the sandbox's
    execution time of the phase (``throughput`` in the report)."""

    def __init__(self, result: DemoResult, emit: Event, phases: Phases | None = None) -> None:
        self.result, self.emit = result, emit
        self.phases = phases
        self.t0 = time.perf_counter()
        self._marks: tuple[Components, dict[str, float]] | None = None

    def measure(self, parts: Components | None) -> None:
        """Count the work of ``parts`` (backend, sandbox) from now until the phase ends."""
        before = _work(parts)
        self._marks = (parts, before) if parts is not None else None

    def done(self, name: str) -> None:
        # What a phase freed goes back to the OS before the next one allocates: otherwise the run's peak
        # RSS approaches the sum of its phases' peaks (``retool.backends.heap``).
        release_free_memory()
        seconds = round(time.perf_counter() - self.t0, 1)
        self.result.timings[name] = seconds
        entry: PhaseEntry = {"seconds": seconds}
        if self._marks is not None:
            parts, before = self._marks
            after = _work(parts)
            entry["work"] = {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
            self.result.throughput[name] = entry["work"]
        if self.phases is not None:
            self.phases.record(name, entry)
        self.emit("phase_done", {"phase": name, "seconds": seconds})
        self.t0 = time.perf_counter()
        self._marks = None

    def skip(self, name: str) -> bool:
        """True (and the recorded timing restored) when a resumed run finished ``name`` already."""
        if self.phases is None or not self.phases.done(name):
            return False
        entry = self.phases.data[name]
        self.result.timings[name] = float(entry["seconds"])
        if "work" in entry:
            self.result.throughput[name] = dict(entry["work"])
        self.emit("phase_done", {"phase": name, "seconds": entry["seconds"], "resumed": True})
        self.t0 = time.perf_counter()
        return True


_WORK_KEYS = (
    "sample_seconds",
    "prefill_seconds",
    "sampled_tokens",
    "sampled_sequences",
    "prefill_tokens",
    "train_seconds",
    "trained_tokens",
    "trained_padded_tokens",
)


def _work(parts: Components | None) -> dict[str, float]:
    """Cumulative work counters: the local backend's ``stats`` and the sandbox's execution seconds."""
    out: dict[str, float] = {}
    if parts is None:
        return out
    stats = getattr(parts.backend, "stats", None)
    if stats is not None:
        out.update({key: float(getattr(stats, key)) for key in _WORK_KEYS})
    exec_stats = getattr(parts.executor, "stats", None)
    if exec_stats is not None:
        out["exec_calls"] = float(exec_stats.calls)
        out["exec_seconds"] = float(exec_stats.total_latency)
    return out
