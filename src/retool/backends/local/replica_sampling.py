"""Generation on the data-parallel replicas too: every core's share of sampling, not only rank 0's.

Why: with ``backend.processes`` > 1 the replica processes hold the very weights rank 0 samples from
(views of one shared-memory file, ``retool.backends.local.data_parallel``), yet they sat idle while rank 0
generated alone. A small model's decoding on CPU is bound by one core's per-step overhead, not by its
arithmetic, so the RL step's rollouts ran on one core of two. Here each replica runs a generation engine
of its own over those weights, and rank 0's sampler (``SplitSamplingClient``) deals the requests of every
gathered batch out between its own engine and theirs.

- **Affinity** (``Affinity``). A request that extends a sequence one engine generated (a trajectory's next
  turn) goes to that engine, whose prefix cache holds the sequence's KV; any other request goes to the
  engine with the fewest rows in flight, identical prompts of one batch (a group) together, so that they
  are prefilled once.
- **Weights.** Every request carries rank 0's weights version; a replica that sees a new one moves to it
  (its engine then empties its prefix cache; a LoRA model's merged view is rebuilt). Rank 0 changes the
  weights (optimizer step, state load) only while no replica batch is in flight, and routes every request
  to its own engine while such a change waits or runs, as its own engine yields to the call queued
  behind it: no sequence is ever decoded across two versions.
- **Link** (``ReplicaEngine`` / ``serve_sampling``). A replica's engine talks over a socket pair of its own
  (its end handed over the training pipe), so sampling never interleaves with the training protocol; a
  reader thread resolves rank 0's futures. Samples are the replica engine's, logprobs included (the same
  weights and code as rank 0's: equal up to float rounding of a different batch). A replica that fails
  fails its batches with ``ReplicaError``; later requests stay on the engines still alive.
- **Stats.** Each reply carries the replica engine's cumulative counters; rank 0 adds what is new to its
  own ``BackendStats``, so sampled and prefilled tokens count every process's work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from multiprocessing.connection import Connection

import numpy as np

from retool.backends.engine.generation import ContinuousGenerator, GenRequest
from retool.backends.interface.types import Sample
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.sampling_client import LocalSamplingClient
from retool.backends.local.stats import BackendStats
from retool.child import messages

_SAMPLING_FIELDS = (
    "sample_seconds",
    "prefill_seconds",
    "sampled_sequences",
    "sampled_tokens",
    "prefill_tokens",
    "prompt_tokens",
)
_HASH_BASE = np.uint64(1_000_003)
_AFFINITY_LIMIT = 1 << 17  # remembered sequences before the map starts over (a few MB)


class ReplicaError(RuntimeError):
    """A replica process failed: it raised (its traceback is in the message) or it died."""


class Affinity:
    """Which engine generated the sequence a prompt extends: polynomial hashes of token prefixes
    (numpy, wrapping uint64; a collision only sends a request to an engine without its KV)."""

    def __init__(self) -> None:
        self._engine_of: dict[int, int] = {}
        self._powers = np.ones(1, dtype=np.uint64)
        self._tag: object = None

    def _prefix_hashes(self, tokens: Sequence[int]) -> np.ndarray:
        n = len(tokens)
        with np.errstate(over="ignore"):  # the arithmetic is mod 2^64 on purpose
            while len(self._powers) < n:  # grow the table of base powers
                step = self._powers[-1] * _HASH_BASE
                self._powers = np.concatenate([self._powers, self._powers * step])
            terms = (np.asarray(tokens, dtype=np.uint64) + np.uint64(1)) * self._powers[:n]
            return np.cumsum(terms, dtype=np.uint64)

    def start(self, tag: object) -> None:
        """Forget everything when the weights change (every engine's prefix cache is empty then)."""
        if tag != self._tag or len(self._engine_of) > _AFFINITY_LIMIT:
            self._engine_of.clear()
            self._tag = tag

    def remember(self, tokens: Sequence[int], engine: int) -> None:
        if tokens:
            self._engine_of[int(self._prefix_hashes(tokens)[-1])] = engine

    def lookup(self, prompt: Sequence[int]) -> int | None:
        """The engine that generated the longest remembered prefix of ``prompt`` (or ``prompt`` itself)."""
        if not self._engine_of or not prompt:
            return None
        get = self._engine_of.get
        for h in reversed(self._prefix_hashes(prompt).tolist()):
            engine = get(h)
            if engine is not None:
                return engine
        return None


def plan_batch(requests: Sequence[GenRequest], affinity: Affinity, load: list[int]) -> list[int]:
    """The engine of each request (an index into ``load``, the rows each engine has in flight, updated
    here). A continuation follows its sequence; a new prompt goes, with every identical prompt of the
    batch, to the least loaded engine."""
    chosen: list[int] = []
    by_prompt: dict[tuple[int, ...], int] = {}
    for request in requests:
        key = tuple(request.prompt)
        engine = by_prompt.get(key)
        if engine is None:
            engine = affinity.lookup(request.prompt)
            if engine is None or engine >= len(load):
                engine = min(range(len(load)), key=lambda i: load[i])
            by_prompt[key] = engine
        load[engine] += 1
        chosen.append(engine)
    return chosen


class ReplicaEngine:
    """Rank 0's handle on one replica's generation engine: ``submit`` a batch, get a future."""

    def __init__(self, link: Connection, rank: int, stats: BackendStats) -> None:
        self.rank = rank
        self.rows_in_flight = 0
        self._link = link
        self._stats = stats
        self._seen = dict.fromkeys(_SAMPLING_FIELDS, 0.0)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[concurrent.futures.Future[list[Sample]], int]] = {}
        self._ids = itertools.count()
        self._error: ReplicaError | None = None
        self._reader = threading.Thread(target=self._read, name=f"retool-replica{rank}-sampling", daemon=True)
        self._reader.start()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def submit(self, requests: list[GenRequest], version: int) -> concurrent.futures.Future[list[Sample]]:
        future: concurrent.futures.Future[list[Sample]] = concurrent.futures.Future()
        batch = next(self._ids)
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            self._pending[batch] = (future, len(requests))
            self.rows_in_flight += len(requests)
            try:
                self._link.send(("sample", batch, version, requests))
            except OSError as exc:
                self._pending.pop(batch)
                self.rows_in_flight -= len(requests)
                future.set_exception(ReplicaError(f"replica {self.rank}'s sampling link is gone ({exc})"))
        return future

    def _read(self) -> None:
        while True:
            try:
                kind, batch, payload, counters = self._link.recv()
            except (EOFError, OSError, ValueError):
                self._fail_all(ReplicaError(f"data-parallel replica {self.rank} closed its sampling link"))
                return
            with self._lock:
                future, rows = self._pending.pop(batch)
                self.rows_in_flight -= rows
            self._add_stats(counters)
            if kind == "ok":
                future.set_result(payload)
            else:
                future.set_exception(
                    ReplicaError(f"data-parallel replica {self.rank} failed to sample:\n{payload}")
                )

    def _add_stats(self, counters: dict[str, float]) -> None:
        new = {k: counters[k] - self._seen[k] for k in _SAMPLING_FIELDS}
        self._seen.update({k: counters[k] for k in _SAMPLING_FIELDS})
        for key, value in new.items():
            setattr(self._stats, key, getattr(self._stats, key) + type(getattr(self._stats, key))(value))

    def _fail_all(self, error: ReplicaError) -> None:
        with self._lock:
            self._error = error
            pending = list(self._pending.values())
            self._pending.clear()
            self.rows_in_flight = 0
        for future, _ in pending:
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._link.send(None)
        with contextlib.suppress(Exception):
            self._link.close()


class WeightsGate:
    """Rank 0's rule that no replica batch is in flight while its weights change (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._changing = 0

    def try_enter(self) -> bool:
        """Count a replica batch in (true), or refuse while a weight change waits or runs."""
        with self._cond:
            if self._changing:
                return False
            self._in_flight += 1
            return True

    def enter(self) -> None:
        """Count one more batch in, for a caller already inside (no change can start meanwhile)."""
        with self._cond:
            self._in_flight += 1

    def leave(self, _: object = None) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold replica batches out, wait for those in flight, then let the caller change the weights."""
        with self._cond:
            self._changing += 1
            self._cond.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self._cond:
                self._changing -= 1


class SplitSamplingClient(LocalSamplingClient):
    """Rank 0's live sampler over its own engine and its replicas' (see the module docstring)."""

    _owner: LocalTrainingClient  # it reads more of its trainer than the base class's SamplerOwner names

    def __init__(
        self,
        owner: LocalTrainingClient,
        replicas: Callable[[], list[ReplicaEngine]],
        gate: WeightsGate,
        gather_ms: float = 5.0,
    ) -> None:
        super().__init__(owner, gather_ms=gather_ms, engine=owner.engine)
        self._replicas = replicas  # empty until they are ready
        self._gate = gate
        self._affinity = Affinity()
        # Rows this process's engine has in flight: a balancing estimate, updated by the event loop and the
        # engine's thread without a lock (a lost update only skews one placement).
        self._local_rows = 0

    def _start_batch(self, requests: list[GenRequest]) -> Awaitable[list[Sample]]:
        owner = self._owner
        replicas = [r for r in self._replicas() if not r.failed]
        if not replicas or owner._waiting_jobs > 0 or not self._gate.try_enter():
            return self._run_here(requests)  # a weight change waits: its own engine yields to it
        version = owner._weights_version
        self._affinity.start(version)
        load = [self._local_rows] + [r.rows_in_flight for r in replicas]
        chosen = plan_batch(requests, self._affinity, load)
        parts: list[tuple[int, list[int], Awaitable[list[Sample]]]] = []
        try:
            for engine in sorted(set(chosen)):
                rows = [i for i, e in enumerate(chosen) if e == engine]
                subset = [requests[i] for i in rows]
                if engine == 0:
                    parts.append((0, rows, self._run_here(subset)))
                else:
                    self._gate.enter()  # held until the batch is done: weights stay until then
                    future = replicas[engine - 1].submit(subset, version)
                    future.add_done_callback(self._gate.leave)
                    parts.append((engine, rows, asyncio.wrap_future(future)))
        finally:
            self._gate.leave()  # the planning's own count
        return self._gather(requests, parts, version)

    def _run_here(self, requests: list[GenRequest]) -> Awaitable[list[Sample]]:
        self._local_rows += len(requests)
        future = self._engine.submit(requests)  # type: ignore[union-attr]  # built with the owner's engine

        def done(_: object) -> None:
            self._local_rows -= len(requests)

        future.add_done_callback(done)
        return asyncio.wrap_future(future)

    async def _gather(
        self,
        requests: list[GenRequest],
        parts: list[tuple[int, list[int], Awaitable[list[Sample]]]],
        version: int,
    ) -> list[Sample]:
        out: list[Sample | None] = [None] * len(requests)
        results = await asyncio.gather(*(p[2] for p in parts))
        for (engine, rows, _), samples in zip(parts, results, strict=True):
            for i, sample in zip(rows, samples, strict=True):
                out[i] = sample
                if version == self._owner._weights_version:
                    self._affinity.remember([*requests[i].prompt, *sample.tokens], engine)
        return [s for s in out if s is not None]


# ------------------------------------------------------------------------------------------ replica side


def serve_sampling(link: Connection, client: LocalTrainingClient, training_waits: Callable[[], bool]) -> None:
    """A replica's sampling service: batches from rank 0's ``ReplicaEngine`` into an engine of this
    process (on the client's worker thread, yielding to a training share queued there), replies back."""
    engine: ContinuousGenerator = client.make_engine(
        client.sampling_model, lambda: client._weights_version, client._executor, training_waits
    )
    send_lock = threading.Lock()

    def reply(batch: int, future: concurrent.futures.Future[list[Sample]]) -> None:
        payload: list[Sample] | str
        try:
            kind, payload = "ok", future.result()
        except Exception as exc:  # the caller gets it, as for a failed training share
            kind, payload = "error", f"{type(exc).__name__}: {exc}"
        counters = {k: float(getattr(client.stats, k)) for k in _SAMPLING_FIELDS}
        with send_lock, contextlib.suppress(OSError):
            link.send((kind, batch, payload, counters))

    for _, batch, version, requests in messages(link):
        if version != client._weights_version:  # nothing of the old version is in flight (the gate)
            client._executor.submit(setattr, client, "_weights_version", version).result()
        engine.submit(requests).add_done_callback(functools.partial(reply, batch))
