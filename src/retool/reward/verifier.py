"""The bounded verifier: math-verify in a small pool of worker processes with a hard per-check timeout.

Why processes: math-verify (sympy underneath) can spin for minutes or exhaust memory on hostile answers such
as ``10^{10^{10}}``, and its own timeout uses ``signal.alarm``, which works only on a main thread. A trainer
calls the verifier from asyncio tasks and threads, so the parent never touches signals. Each check runs in
a worker process:

* inside the worker (its main thread) a *soft* ``setitimer`` alarm at ~80 % of the budget interrupts pure
  Python work (most sympy loops) and the worker survives;
* the parent waits at most ``timeout`` seconds on the worker's pipe; a worker stuck in C code (a huge
  integer power) is SIGKILLed and replaced, and the check is reported as ``timeout``.

Workers are fresh interpreters (``python -c``, i.e. spawn semantics), never a ``fork`` of the caller: forking
a trainer that holds a model, CUDA state and threads is both slow and unsafe. A killed worker is replaced
at once in the background, so its ~1-2 s import of sympy is rarely waited for. Waiting for a worker to
start is not charged to a check's timeout.

Timeouts and errors are counted apart from wrong answers (:attr:`Verifier.stats`): a verifier that silently
turns its own failures into "-1" would look like a policy that got worse.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import os
import queue
import resource
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from types import FrameType, TracebackType
from typing import Literal

from retool.child import messages, start_child
from retool.config import Config, RewardConfig
from retool.reward.equivalence import check_equivalence
from retool.reward.extract import extract_last_boxed

logger = logging.getLogger(__name__)

VerifyStatus = Literal["ok", "timeout", "error"]
RewardStatus = Literal["ok", "timeout", "error", "no_answer"]

ANSWER_WINDOW_CHARS = 300
_EQUIVALENCE_MODULE = "retool.reward.equivalence"


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of one equivalence check. ``equivalent`` is False whenever ``status`` is not ``ok``."""

    equivalent: bool
    status: VerifyStatus
    elapsed_s: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class RewardResult:
    """The outcome reward of one final answer: +1 correct, -1 otherwise (wrong, no box, check failed)."""

    reward: float
    correct: bool
    valid_format: bool
    answer: str | None
    status: RewardStatus = "ok"


@dataclass
class VerifierStats:
    """Counters since the verifier started. ``wrong`` counts only checks that ran and said "not equal";
    ``timeouts`` and ``errors`` are the verifier's own failures. ``worker_kills`` counts workers killed at
    the hard timeout or found dead, each replaced by a fresh one (``worker_starts`` includes the first ones).
    """

    checks: int = 0
    equivalent: int = 0
    wrong: int = 0
    timeouts: int = 0
    errors: int = 0
    worker_kills: int = 0
    worker_starts: int = 0
    total_seconds: float = 0.0
    max_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# ---------------------------------------------------------------------------------------------- worker side


class _SoftTimeout(BaseException):
    """Raised by the worker's own alarm. BaseException, so math-verify's ``except Exception`` cannot eat it."""


def _worker_main(fd: int, memory_limit_mb: int | None, hard_timeout: float) -> None:
    """Loop of one worker process: receive ``(request_id, pred, ref, soft_timeout)``, answer a tuple.

    Started as ``python -c`` by :class:`_Worker`; ``fd`` is its end of a socketpair.
    """
    conn = Connection(fd)
    # Ctrl-C goes to the whole process group; the parent decides what to do, workers just get killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_mb:
        limit = int(memory_limit_mb) * 1024 * 1024
        with contextlib.suppress(ValueError, OSError):  # an inherited lower hard limit: keep it
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    equivalence = importlib.import_module(_EQUIVALENCE_MODULE)
    armed = False

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if armed:
            raise _SoftTimeout()

    def arm_cpu_limit() -> None:
        # A kernel-enforced backstop: if the parent vanished while this worker is stuck in C code, nobody
        # would kill it; SIGXCPU does, a little after the parent's own hard timeout.
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = used.ru_utime + used.ru_stime
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(cpu + hard_timeout * 2 + 2)
        if hard == resource.RLIM_INFINITY or soft <= hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))

    # This is the worker's main thread, the only place a signal-based timeout is legal.
    signal.signal(signal.SIGALRM, on_alarm)
    conn.send(("ready", os.getpid()))
    for request_id, pred, ref, soft_timeout in messages(conn):
        arm_cpu_limit()
        try:
            try:
                armed = True
                signal.setitimer(signal.ITIMER_REAL, max(soft_timeout, 0.001))
                equivalent, status, detail = equivalence.check_equivalence(pred, ref)
            finally:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            equivalent, status, detail = False, "timeout", "soft timeout in worker"
        except MemoryError:
            equivalent, status, detail = False, "error", "MemoryError (worker memory limit)"
        except Exception as exc:  # check_equivalence catches math-verify's own; this is a last resort
            equivalent, status, detail = False, "error", f"{type(exc).__name__}: {str(exc)[:200]}"
        try:
            conn.send((request_id, bool(equivalent), status, detail))
        except (BrokenPipeError, OSError):
            return


# ---------------------------------------------------------------------------------------------- parent side

_WORKER_BOOT = "import sys; from retool.reward.verifier import _worker_main; _worker_main(int(sys.argv[1]), {mem}, {hard})"


class _Worker:
    """One worker: a fresh ``python -c`` interpreter (never a fork of the caller) on a socketpair
    (``retool.child``, which says why not ``multiprocessing``)."""

    def __init__(self, memory_limit_mb: int | None, hard_timeout: float) -> None:
        boot = _WORKER_BOOT.format(mem=repr(memory_limit_mb), hard=repr(float(hard_timeout)))
        self.process, self.conn = start_child(boot)
        self.ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float) -> bool:
        if self.ready:
            return True
        try:
            if not self.conn.poll(timeout):
                return False
            message = self.conn.recv()
        except (EOFError, OSError):
            return False
        self.ready = isinstance(message, tuple) and message[:1] == ("ready",)
        return self.ready

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.wait(timeout=5.0)
        with contextlib.suppress(Exception):
            self.conn.close()

    def stop(self) -> None:
        """Exit politely (``None`` may already have been sent by the pool), else kill after a second."""
        with contextlib.suppress(Exception):
            self.conn.send(None)
        try:
            self.process.wait(timeout=1.0)
        except Exception:
            self.kill()
        with contextlib.suppress(Exception):
            self.conn.close()


@dataclass
class _Counters:
    stats: VerifierStats = field(default_factory=VerifierStats)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Verifier:
    """A pool of ``workers`` verifier processes with a hard ``timeout`` (seconds) per check.

    Thread-safe; ``averify``/``ascore`` run the blocking wait on a private thread pool, so many coroutines can
    await checks without blocking the event loop. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout: float = 5.0,
        *,
        tail_chars: int = ANSWER_WINDOW_CHARS,
        memory_limit_mb: int | None = 2048,
        startup_timeout: float = 120.0,
        soft_fraction: float = 0.8,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.workers = workers
        self.timeout = float(timeout)
        self.tail_chars = tail_chars
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout = float(startup_timeout)
        self.soft_timeout = max(0.001, self.timeout * soft_fraction)
        self._counters = _Counters()
        self._ids = itertools.count()
        self._closed = False
        self._close_lock = threading.Lock()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: set[_Worker] = set()
        self._all_lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="retool-verify")
        for _ in range(workers):
            self._idle.put(self._start_worker())

    @classmethod
    def from_config(cls, config: Config | RewardConfig) -> Verifier:
        """The verifier a run's config asks for: a ``retool.config.Config`` or its ``RewardConfig`` section
        (``verify_workers``, ``verify_timeout``, ``tail_chars``). Training and evaluation both build it here,
        so the two score answers alike."""
        reward = config.reward if isinstance(config, Config) else config
        return cls(workers=reward.verify_workers, timeout=reward.verify_timeout, tail_chars=reward.tail_chars)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        worker = _Worker(self.memory_limit_mb, self.timeout)
        with self._all_lock:
            self._all.add(worker)
        with self._counters.lock:
            self._counters.stats.worker_starts += 1
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._all_lock:
            self._all.discard(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and put a fresh one in the idle pool (it reports ready on first use)."""
        self._discard(worker)
        with self._counters.lock:
            self._counters.stats.worker_kills += 1
        if not self._closed:
            fresh = self._start_worker()
            self._idle.put(fresh)
            if self._closed:  # close() ran meanwhile and did not see this worker
                self._discard(fresh)

    def close(self) -> None:
        """Stop all workers. Checks still in flight finish or time out; later calls raise RuntimeError."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._all_lock:
            workers = list(self._all)
            self._all.clear()
        # Ask all workers to exit first, then wait: shutdown costs one wait, not one per worker.
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.conn.send(None)
        for worker in workers:
            worker.stop()

    def __enter__(self) -> Verifier:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes (for monitoring and fault tests)."""
        with self._all_lock:
            return [w.pid for w in self._all if w.process.poll() is None]

    @property
    def stats(self) -> VerifierStats:
        """A snapshot of the counters."""
        with self._counters.lock:
            return replace(self._counters.stats)

    # -- checks ----------------------------------------------------------------------------------------------

    def _record(self, outcome: VerifyOutcome) -> VerifyOutcome:
        with self._counters.lock:
            s = self._counters.stats
            s.checks += 1
            s.total_seconds += outcome.elapsed_s
            s.max_seconds = max(s.max_seconds, outcome.elapsed_s)
            if outcome.status == "timeout":
                s.timeouts += 1
            elif outcome.status == "error":
                s.errors += 1
            elif outcome.equivalent:
                s.equivalent += 1
            else:
                s.wrong += 1
        if outcome.status != "ok":
            logger.warning("verifier %s after %.2fs: %s", outcome.status, outcome.elapsed_s, outcome.detail)
        return outcome

    def _acquire(self) -> _Worker:
        """An idle worker that has finished starting up (waiting for startup is not charged to the check)."""
        failures = 0
        while True:
            if self._closed:
                raise RuntimeError("Verifier is closed")
            try:
                worker = self._idle.get(timeout=0.5)
            except queue.Empty:  # re-check `closed` so a waiter never outlives close()
                continue
            if worker.wait_ready(self.startup_timeout):
                return worker
            logger.error("verifier worker pid %s failed to start; replacing it", worker.pid)
            self._replace(worker)
            failures += 1
            if failures >= 3:  # a broken installation, not a hostile answer: say so instead of looping
                raise RuntimeError(
                    f"verifier workers fail to start ({failures} in a row; see their stderr above): "
                    f"check that `{sys.executable} -c 'import math_verify'` works"
                )

    def verify(self, pred: str, ref: str) -> VerifyOutcome:
        """Is ``pred`` equivalent to the reference ``ref``? Returns within ``timeout`` seconds of starting."""
        worker = self._acquire()
        request_id = next(self._ids)
        start = time.monotonic()
        try:
            worker.conn.send((request_id, str(pred), str(ref), self.soft_timeout))
            if not worker.conn.poll(self.timeout):
                elapsed = time.monotonic() - start
                self._replace(worker)
                return self._record(VerifyOutcome(False, "timeout", elapsed, "worker killed at hard timeout"))
            answer = worker.conn.recv()
        except (EOFError, OSError) as exc:  # the worker died (crash, OOM kill): replace it, report an error
            elapsed = time.monotonic() - start
            self._replace(worker)
            return self._record(VerifyOutcome(False, "error", elapsed, f"worker died: {type(exc).__name__}"))
        except BaseException:
            # Interrupted mid-request (KeyboardInterrupt...): the pipe state is unknown, so drop the worker.
            self._replace(worker)
            raise
        elapsed = time.monotonic() - start
        got_id, equivalent, status, detail = answer
        if got_id != request_id:  # cannot happen with one request in flight per worker; never trust it
            self._replace(worker)
            return self._record(VerifyOutcome(False, "error", elapsed, "verifier protocol out of sync"))
        if self._closed:
            self._discard(worker)
        else:
            self._idle.put(worker)
        return self._record(VerifyOutcome(bool(equivalent) and status == "ok", status, elapsed, detail))

    async def averify(self, pred: str, ref: str) -> VerifyOutcome:
        """:meth:`verify` for asyncio: the wait happens on the verifier's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.verify, pred, ref)

    def score(self, text: str, reference: str) -> RewardResult:
        """Reward of a final answer text: last ``\\boxed{}`` in its last ``tail_chars`` characters."""
        return score_answer(text, reference, verifier=self)

    async def ascore(self, text: str, reference: str) -> RewardResult:
        answer = _extract_answer(text, self.tail_chars)
        if answer is None:
            return _no_answer()
        outcome = await self.averify(answer.strip(), str(reference).strip())
        return _reward_from(answer, outcome)


# ---------------------------------------------------------------------------------------------- scoring


def _extract_answer(text: str, tail_chars: int) -> str | None:
    # Only the end of the final text counts, so a \boxed{} quoted mid-reasoning is not graded (chapter 8.4.4).
    return extract_last_boxed(text[-tail_chars:] if tail_chars > 0 else text)


def _no_answer() -> RewardResult:
    return RewardResult(-1.0, False, False, None, "no_answer")


def _reward_from(answer: str, outcome: VerifyOutcome) -> RewardResult:
    correct = outcome.equivalent and outcome.status == "ok"
    return RewardResult(1.0 if correct else -1.0, correct, True, answer, outcome.status)


def score_answer(text: str, reference: str, verifier: Verifier | None = None) -> RewardResult:
    """+1 if the last ``\\boxed{}`` in the last 300 characters of ``text`` equals ``reference``, else -1.

    With ``verifier`` the check is bounded in time (worker processes); without it, math-verify runs in this
    process with no time limit (fine for trusted input and tests; a trainer should pass a Verifier).
    """
    tail_chars = verifier.tail_chars if verifier is not None else ANSWER_WINDOW_CHARS
    answer = _extract_answer(text, tail_chars)
    if answer is None:
        return _no_answer()
    pred, ref = answer.strip(), str(reference).strip()
    if verifier is not None:
        return _reward_from(answer, verifier.verify(pred, ref))
    start = time.monotonic()
    equivalent, status, detail = check_equivalence(pred, ref)
    if status != "ok":
        logger.debug("in-process verify %s: %s", status, detail)
    return _reward_from(answer, VerifyOutcome(equivalent, status, time.monotonic() - start, detail))
