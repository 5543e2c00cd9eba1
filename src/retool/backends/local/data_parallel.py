"""Data-parallel training of the local backend over several processes of one CPU machine.

``DataParallelTrainingClient`` is a ``LocalTrainingClient`` (rank 0) with ``processes - 1`` replica
processes. It owns their lifecycle (start, failure, shutdown), the shared memory they train through and
how each ``forward_backward`` call is dealt out. Why processes: a small model's training step on CPU
gains little from intra-op threads (measured on the tiny demo model: 2 threads <= 1.25x), while two
processes each running half of every batch take half the time.

- **One set of weights.** Every parameter lives in one shared-memory file that every process maps; the
  modules of each process are views of it. Rank 0's optimizer updates it in place, so the replicas see
  the new weights at once and can never drift; nothing is broadcast, and checkpoints, LoRA and the
  optimizer stay rank 0's business alone. The replicas sample from those weights too
  (``retool.backends.local.replica_sampling``: each runs a generation engine rank 0's sampler deals
  requests to).
- **Gradients add up.** Losses are sums over tokens and datums (Tinker semantics: the caller puts its
  normalisation into the weights), so the gradient of a call is the sum of its shares' gradients. A
  replica writes the gradient of its share into its own shared buffer; rank 0 adds it to its own before
  the call returns, so ``optim_step`` (clipping included) and ``zero_grad`` see exactly what one process
  would have accumulated, up to float summation order.
- **Shares.** ``retool.backends.training.packing.split_for_workers`` cuts the datums, sorted by length, into one
  contiguous run per process, balancing padded area (similar lengths in a share also waste less padding).
- **Faults.** A replica that raises reports its traceback, and the call raises it; one that dies fails
  the call with its exit code; either way the client is closed, not left half-trained. A replica exits
  when rank 0 closes the client, and at once when rank 0 dies (its pipe closes; Linux also sends it
  SIGKILL through ``PR_SET_PDEATHSIG``).

Replicas are plain ``python -c`` interpreters on a socket pair (as the verifier's workers: never a fork of
a process holding torch's threads, never a re-import of the caller's ``__main__``). They start before
rank 0 loads its model, so their imports overlap its loading. CPU only: there is no shared memory between
GPUs here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import mmap
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

import torch

from retool.backends.interface.types import AdamParams, Datum, OptimStepResult
from retool.backends.local.client import LocalTrainingClient
from retool.backends.local.datums_pass import DatumsPass
from retool.backends.local.heap import cap_mmap_threshold
from retool.backends.local.loading import resolve_device
from retool.backends.local.replica_sampling import (
    ReplicaEngine,
    ReplicaError,
    SplitSamplingClient,
    WeightsGate,
    serve_sampling,
)
from retool.backends.training.packing import split_for_workers
from retool.child import messages, start_child

_GRAD_ALIGN = 64  # bytes: every gradient in a replica's buffer starts on a cache line
_START_TIMEOUT = 300.0  # seconds a replica may take to import torch and load the model
_STOP_TIMEOUT = 5.0
_BOOT = "import sys; from retool.backends.local.data_parallel import replica_main as m; m(int(sys.argv[1]))"


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_processes(processes: int, device: str = "cpu", limit: int = 8) -> int:
    """``backend.processes``: a count, or 0 for one per available core (at most ``limit``) on CPU and 1
    on another device (data parallelism here is a CPU affair)."""
    if processes < 0:
        raise ValueError(f"backend.processes must be >= 0, got {processes}")
    if processes:
        return processes
    return min(available_cores(), limit) if resolve_device(device).type == "cpu" else 1


def core_per_rank(processes: int) -> list[int]:
    """The core each rank's training thread is pinned to, or none (``[]``) when there are fewer cores
    than processes (or no affinity control). Why pin: rank 0 wakes a replica by writing to its socket,
    a wake-up Linux treats as a hand-over (the writer is about to sleep) and serves on the writer's core,
    though rank 0 goes on computing its own share; the two then share one core until the load balancer
    separates them (measured on 2 cores: rank 0's share 45 ms of CPU took 64 ms of wall a step)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return []
    return cores[:processes] if len(cores) >= processes else []


@dataclass(frozen=True)
class _Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the weights file (a page boundary: each parameter is mapped on its own)
    grad_offset: int  # bytes into a gradient buffer; -1: frozen, no gradient

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _layout(model: torch.nn.Module) -> tuple[list[_Slot], int, int]:
    """Where each parameter sits in the weights file (and, when trainable, in a gradient buffer); the
    two files' sizes in bytes."""
    slots: list[_Slot] = []
    weights = grads = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        slots.append(_Slot(name, p.dtype, tuple(p.shape), weights, grads if p.requires_grad else -1))
        weights += _round_up(nbytes, mmap.PAGESIZE)
        grads += _round_up(nbytes, _GRAD_ALIGN) if p.requires_grad else 0
    return slots, weights, grads


def _map(path: Path, size: int, offset: int = 0) -> torch.Tensor:
    """``size`` bytes of the shared file ``path`` from ``offset`` (a page boundary) as a tensor of its
    own storage (the mapping outlives the file's name)."""
    with open(path, "r+b") as fh:
        mem = mmap.mmap(fh.fileno(), max(size, 1), offset=offset)
    return torch.frombuffer(mem, dtype=torch.uint8)[:size]


def _typed(raw: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return raw.view(slot.dtype).view(slot.shape)


class SharedWeights:
    """A model's parameters in one shared-memory file, and one gradient buffer per replica (a file of the
    trainable parameters' size each). ``create`` (rank 0) writes the files; ``attach`` (a replica) maps
    them; both point the model's parameters at the shared weights, each parameter a storage of its own
    (as in any model: savers that look for tensors sharing storage, tied weights, see what they expect)."""

    def __init__(self, slots: list[_Slot], grads: list[torch.Tensor]) -> None:
        self.slots, self.grads = slots, grads

    @classmethod
    def create(cls, model: torch.nn.Module, replicas: int, folder: Path) -> tuple[SharedWeights, list[Path]]:
        """Copy ``model``'s parameters into new files under ``folder`` and share them; the files' paths
        (weights first), to hand to the replicas and to unlink once they mapped them."""
        slots, weights_size, grads_size = _layout(model)
        paths = [Path(tempfile.mkstemp(prefix="retool-dp-", dir=folder)[1]) for _ in range(1 + replicas)]
        for path, size in zip(paths, [weights_size] + [grads_size] * replicas, strict=True):
            os.truncate(path, max(size, 1))
        shared = cls(slots, [_map(p, grads_size) for p in paths[1:]])
        shared._point(model, paths[0], copy=True)
        return shared, paths

    @classmethod
    def attach(
        cls, model: torch.nn.Module, slots: list[_Slot], paths: list[Path], rank: int
    ) -> SharedWeights:
        """Map the files of ``create`` and point ``model`` (built like rank 0's) at the shared weights;
        a replica (``rank`` >= 1) keeps only its own gradient buffer."""
        mine, _, grads_size = _layout(model)
        if [(s.name, s.shape, s.dtype) for s in mine] != [(s.name, s.shape, s.dtype) for s in slots]:
            raise RuntimeError("replica's model differs from rank 0's (parameter names, shapes or dtypes)")
        shared = cls(slots, [_map(paths[rank], grads_size)])
        shared._point(model, paths[0], copy=False)
        return shared

    def _point(self, model: torch.nn.Module, path: Path, copy: bool) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for slot in self.slots:
                p = params[slot.name]
                view = _typed(_map(path, slot.nbytes, slot.offset), slot)
                if copy:
                    view.copy_(p.detach())
                p.data = view

    def _grad_views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for slot in self.slots:
            if slot.grad_offset >= 0:
                yield slot.name, _typed(buffer[slot.grad_offset : slot.grad_offset + slot.nbytes], slot)

    @torch.no_grad()
    def put_grads(self, model: torch.nn.Module) -> None:
        """Replica: move the gradient accumulated in ``model`` into this replica's buffer."""
        params = dict(model.named_parameters())
        for name, view in self._grad_views(self.grads[0]):
            p = params[name]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
                p.grad = None

    @torch.no_grad()
    def add_grads(self, model: torch.nn.Module, replica: int) -> None:
        """Rank 0: add replica ``replica``'s (0-based) gradient buffer to ``model``'s gradients."""
        params = dict(model.named_parameters())
        for name, view in self._grad_views(self.grads[replica]):
            p = params[name]
            p.grad = view.clone() if p.grad is None else p.grad.add_(view)


class _Replica:
    """Rank 0's handle on one replica process."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank  # given when a client adopts it (a spare has none yet)
        self.process, self.conn = start_child(_BOOT)

    def send(self, message: object) -> None:
        try:
            self.conn.send(message)
        except OSError as exc:
            raise self._died(f"could not be reached ({exc})") from None

    def receive(self, timeout: float | None = None) -> object:
        """The replica's next reply; raises ``ReplicaError`` when it reports an error or dies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.process.poll() is not None:
                raise self._died("exited")
            if deadline is not None and time.monotonic() > deadline:
                raise self._died(f"did not answer within {timeout:.0f} s")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            raise self._died("closed its pipe") from None
        if kind == "error":
            raise ReplicaError(f"data-parallel replica {self.rank} failed:\n{payload}")
        return payload

    def _died(self, what: str) -> ReplicaError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=1.0)
        code = self.process.returncode
        status = "still running" if code is None else f"exit code {code}"
        return ReplicaError(f"data-parallel replica {self.rank} (pid {self.process.pid}) {what} ({status})")

    def stop(self) -> None:
        """Ask it to exit; kill it if it has not within a few seconds."""
        with contextlib.suppress(Exception):
            self.conn.send(None)
        try:
            self.process.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            with contextlib.suppress(Exception):
                self.process.wait(timeout=_STOP_TIMEOUT)
        with contextlib.suppress(Exception):
            self.conn.close()


_SPARES: list[_Replica] = []  # started ahead by ``prestart_replicas``, not yet adopted
_SPARES_LOCK = threading.Lock()


def prestart_replicas(count: int) -> None:
    """Have ``count`` replica processes started now, for the next data-parallel clients to adopt. A
    replica's interpreter start and imports (torch, transformers) take ~4 s, which a client built later
    would wait for: a caller that knows one is coming (the demo, before each training phase) hides that
    behind its own work. Spares nobody adopts are stopped when this process exits."""
    with _SPARES_LOCK:
        while len(_SPARES) < count:
            _SPARES.append(_Replica())


def _replica(rank: int) -> _Replica:
    """A spare started ahead, or a new replica."""
    with _SPARES_LOCK:
        while _SPARES:
            spare = _SPARES.pop(0)
            if spare.process.poll() is None:
                spare.rank = rank
                return spare
    return _Replica(rank)


def _stop_spares() -> None:
    with _SPARES_LOCK:
        spares = list(_SPARES)
        _SPARES.clear()
    _stop_all(spares)


atexit.register(_stop_spares)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def _stop_all(replicas: list[_Replica]) -> None:
    for replica in replicas:
        with contextlib.suppress(Exception):
            replica.conn.send(None)  # all asked first: shutdown costs one wait, not one per replica
    for replica in replicas:
        replica.stop()


class DataParallelTrainingClient(LocalTrainingClient):
    """A ``LocalTrainingClient`` whose ``forward_backward`` runs on ``processes`` processes (see the module
    docstring), and whose live sampler generates on all of them (``replica_sampling``; off with
    ``sample_on_replicas=False``). The optimizer and checkpoints stay in this process."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        processes: int = 2,
        mmap_threshold_mb: float = 0.0,
        sample_on_replicas: bool = True,
        **kwargs: object,
    ) -> None:
        """``mmap_threshold_mb``: the replicas' ``retool.backends.local.heap.cap_mmap_threshold`` (this
        process sets its own, as ``retool.backends.make_training_client`` does); 0 leaves glibc's.
        ``sample_on_replicas``: the live sampler generates on every process
        (``retool.backends.local.replica_sampling``), not on this one alone."""
        if processes < 2:
            raise ValueError(f"a data-parallel client needs >= 2 processes, got {processes}")
        if kwargs.get("shared_base") is not None:
            raise ValueError("a data-parallel client cannot train on a shared base model")
        self.processes = processes
        self._mmap_threshold_mb = mmap_threshold_mb
        self._gate = WeightsGate()
        self._replica_engines: list[ReplicaEngine] = []  # their sampling links, once they are ready
        self._ready: threading.Thread | None = None
        self._ready_error: BaseException | None = None
        self._pinned = False
        self._replicas = [_replica(rank) for rank in range(1, processes)]  # their imports overlap our load
        self._finalizer = weakref.finalize(self, _stop_all, self._replicas)
        try:
            super().__init__(model_path, **kwargs)  # type: ignore[arg-type]  # LocalTrainingClient's own keywords
            if self.device.type != "cpu":
                raise ValueError(f"backend.processes > 1 trains on CPU only, not on {self.device}")
            self._start_replicas(model_path, kwargs, sample_on_replicas)
        except BaseException:
            self._finalizer()
            raise
        if sample_on_replicas:
            self._sampler = SplitSamplingClient(
                self, lambda: self._replica_engines, self._gate, self._gather_ms
            )
        # A client never closed nor used leaves no file behind either: the names go when it does.
        weakref.finalize(self, _unlink_all, list(self._shared_files))

    def _start_replicas(self, model_path: str | Path, kwargs: dict[str, object], sample: bool) -> None:
        """Hand each replica the model and the shared weights (and, with ``sample``, the end of a sampling
        link); a thread awaits their answers, so their start-up overlaps whatever this process does first
        (the first training call waits for it: ``_await_replicas``)."""
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self._shared, self._shared_files = SharedWeights.create(self.model, len(self._replicas), folder)
        own = {**kwargs, "lora": self.lora, "seed": self.seed, "num_threads": self.num_threads}
        self._cores = core_per_rank(self.processes)
        links: list[Connection] = []
        try:
            for replica in self._replicas:
                core = self._cores[replica.rank] if self._cores else None
                slots, files = self._shared.slots, self._shared_files
                replica.send(
                    ("init", replica.rank, core, self._mmap_threshold_mb, str(model_path), own, slots, files)
                )
                if sample:
                    links.append(_open_sampling_link(replica))
        except BaseException:
            self._unlink_shared_files()
            raise
        self._ready = threading.Thread(
            target=self._wait_ready, args=(links,), name="retool-dp-ready", daemon=True
        )
        self._ready.start()

    def _wait_ready(self, links: list[Connection]) -> None:
        """Thread: every replica's answer to its init; then their engines take sampling requests."""
        try:
            for replica in self._replicas:
                replica.receive(timeout=_START_TIMEOUT)
            if links:  # sampling on the replicas too
                pairs = zip(links, self._replicas, strict=True)
                self._replica_engines = [ReplicaEngine(link, r.rank, self.stats) for link, r in pairs]
        except BaseException as exc:
            self._ready_error = exc
        finally:
            self._unlink_shared_files()

    def _await_replicas(self) -> None:
        """Worker thread, before a training share is dealt out: the replicas are up (or their failure
        raised here); this thread is pinned to its core."""
        if self._ready is not None:
            self._ready.join()
        if self._ready_error is not None:
            raise self._ready_error
        if self._cores and not self._pinned:  # this process's other threads stay free to move
            os.sched_setaffinity(0, {self._cores[0]})  # called on the worker thread: pins that thread
            self._pinned = True

    def _unlink_shared_files(self) -> None:
        """Every process has mapped them (or failed): the names can go."""
        for path in self._shared_files:
            with contextlib.suppress(OSError):
                path.unlink()
        self._shared_files = []

    def _optim_step(self, adam: AdamParams) -> OptimStepResult:
        with self._gate.changing():  # no replica decodes across the change (replica_sampling)
            return super()._optim_step(adam)

    def _load_state(self, path: str) -> None:
        with self._gate.changing():
            super()._load_state(path)

    def _run_datums(
        self, datums: Sequence[Datum], loss_fn: str, loss_config: dict[str, float] | None, backward: bool
    ) -> DatumsPass:
        """Deal ``datums`` out to the processes, run rank 0's share here, gather the others' passes (and
        add their gradients)."""
        lengths = [len(d) for d in datums]
        # A replica's share costs about one micro-batch more (messages, the gradient copy): measured.
        cost = self.micro_batch_overhead
        shares = split_for_workers(lengths, self.processes, self.micro_batch_tokens, cost, cost)
        shares = shares[-1:] + shares[:-1]  # rank 0 (which also gathers) takes the last share
        busy = [(r, rows) for r, rows in zip(self._replicas, shares[1:], strict=True) if rows]
        try:
            self._await_replicas()
            for replica, rows in busy:
                share = [datums[i] for i in rows]  # the replica autocasts as this process does (SFT)
                replica.send(("run", share, loss_fn, loss_config, backward, self.train_autocast))
            own = super()._run_datums([datums[i] for i in shares[0]], loss_fn, loss_config, backward)
            parts = [(shares[0], own)]
            for replica, rows in busy:
                part = replica.receive()
                assert isinstance(part, DatumsPass)
                parts.append((rows, part))
                if backward:
                    self._shared.add_grads(self.model, replica.rank - 1)
        except BaseException:
            self._finalizer()  # a replica's state is unknown now: stop them all, the client is done
            raise
        return DatumsPass.merge(parts, len(datums))

    async def close_async(self) -> None:
        await super().close_async()
        for engine in self._replica_engines:
            engine.close()
        self._finalizer()
        self._unlink_shared_files()


def _open_sampling_link(replica: _Replica) -> Connection:
    """A socket pair for the replica's sampling service; its end goes over the training pipe."""
    ours, theirs = socket.socketpair()
    try:
        replica.send(("link",))
        send_handle(replica.conn, theirs.fileno(), replica.process.pid)
    finally:
        theirs.close()
    return Connection(ours.detach())


# ------------------------------------------------------------------------------------------ replica side


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a killed trainer leaves no replica behind)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def replica_main(fd: int) -> None:
    """A replica's body: build the model as rank 0 did, map the shared weights, then run shares of
    ``forward_backward`` calls until rank 0 says stop (``None``) or goes away."""
    _die_with_parent()
    conn = Connection(fd)
    try:
        _, rank, core, mmap_threshold_mb, model_path, kwargs, slots, paths = conn.recv()
        if core is not None:
            os.sched_setaffinity(0, {core})
        cap_mmap_threshold(mmap_threshold_mb)  # before the model's first allocations, as rank 0
        client = LocalTrainingClient(model_path, **kwargs)
        shared = SharedWeights.attach(client.model, slots, [Path(p) for p in paths], rank)
    except (EOFError, OSError):
        return
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    _serve(conn, client, shared)


def _serve(conn: Connection, client: LocalTrainingClient, shared: SharedWeights) -> None:
    waiting = [0]  # training shares queued for the worker thread (the sampling engine yields to them)
    for message in messages(conn):
        if message[0] == "link":
            link = Connection(recv_handle(conn))
            args = (link, client, lambda: waiting[0] > 0)
            threading.Thread(target=serve_sampling, args=args, name="retool-sampling", daemon=True).start()
            continue
        waiting[0] += 1
        try:
            reply = client._executor.submit(_run_share, client, shared, message, waiting).result()
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            return


def _run_share(
    client: LocalTrainingClient, shared: SharedWeights, message: tuple[Any, ...], waiting: list[int]
) -> tuple[str, object]:
    """Worker thread (where this replica's sampling engine runs too): one share of a training call."""
    waiting[0] -= 1
    _, datums, loss_fn, loss_config, backward, autocast = message
    try:
        client.train_autocast = autocast
        client.model.train()
        part = client._run_datums(datums, loss_fn, loss_config, backward)
        if backward:
            shared.put_grads(client.model)
        return ("ok", part)
    except Exception:
        return ("error", traceback.format_exc())
