"""The PyTRIO and Tinker adapters under faults, through the retry guard, the real SDKs and the stub services.

Each test builds an adapter with ``make_training_client`` against an ``sdk_stubs`` server, wraps it the way
the trainer does (``guard_training_client``), scripts a fault on the stub (a hang, a dropped connection
after the call was applied, a 503 / 429) and then checks what took effect on the "service": how many
gradient accumulations each optimizer step consumed (``stub.steps``) and under which idempotency id every
request arrived (``stub.wire_ids``: PyTRIO's event id, Tinker's ``<model_id>:<seq_id>``; a sample's request
id). The guarantees under test (see ``retool.backends.remote.calls``):

- ``forward_backward`` / ``optim_step`` are re-sent by the SDK alone, under its own idempotency id, so a
  dropped or refused request is applied exactly once and the guard re-sends nothing;
- when the outcome stays unknown (the SDK gave up, or the guard's timeout fired on a hung call), nothing
  re-sends the call and ``optim_step`` refuses the doubtful gradient;
- samples are re-sent by the guard after a hang or a failure the SDK reports, and the abandoned SDK call is
  cancelled so it holds nothing the retry needs.

Timeouts and backoffs are small and set through the config; nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytrio
import tinker
from pytrio.config.config import configuration as pytrio_configuration
from pytrio.errors.actor import ActorAPIError, ActorEventSubmitError

from retool.backends import make_training_client
from retool.backends.interface.types import AdamParams, Datum, SamplingParams
from retool.backends.remote.common import RemoteCallError, RemoteSamplingClient, RemoteTrainingClient
from retool.backends.remote.guarded import GuardedSamplingClient, GuardedTrainingClient, guard_training_client
from retool.backends.remote.pytrio import PytrioTrainingClient
from retool.backends.remote.tinker import TinkerTrainingClient
from retool.config import load_config
from retool.retry import Failure, RetryPolicy, RetryStats, UnsafeRetryError, classify
from sdk_stubs import PYTRIO_KEY, TINKER_KEY, PytrioStub, StubServer, TinkerStub, learner_lp, sampled_tokens

KINDS = ("pytrio", "tinker")
HANG_TIMEOUT = 2.0  # the guard's per-call timeout around a call a test hangs (normal calls take ~0.05 s)


@contextlib.contextmanager
def hang_timeout(remote: Remote) -> Iterator[None]:
    """The guard's call timeout cut to ``HANG_TIMEOUT`` only around the call meant to hang. Every other
    call keeps the factory's 60 s: a loaded CI machine once took over 2 s for the first call of a run
    (its session and model set-up), which a short timeout for the whole test turned into a failure."""
    normal = remote.guarded.policy
    remote.guarded.policy = dataclasses.replace(normal, timeout=HANG_TIMEOUT)
    try:
        yield
    finally:
        remote.guarded.policy = normal


# The PyTRIO SDK's own retry settings these tests change (process-wide), restored after each test.
PYTRIO_RETRY_FIELDS = (
    "retry_max_attempts",
    "retry_initial_delay_seconds",
    "training_retry_timeout_seconds",
    "control_retry_timeout_seconds",
    "sampling_retry_timeout_seconds",
    "sampling_request_max_in_flight",
)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """An empty HOME, the stubs' keys, no telemetry; the PyTRIO SDK re-sends after 10 ms for 5 s. (PyTRIO
    reads its configuration when a client is created: a test changes it before ``remote_factory``.)"""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in (
        "PYTRIO_BASE_URL",
        "PYTRIO_ENV",
        "TINKER_BASE_URL",
        "TINKER_CREDENTIAL_CMD",
        "TINKER_PROJECT_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTRIO_API_KEY", PYTRIO_KEY)
    monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    saved = {name: getattr(pytrio_configuration, name) for name in PYTRIO_RETRY_FIELDS}
    pytrio.configure_observability(enabled=False)
    pytrio.configure(
        retry_max_attempts=1,
        retry_initial_delay_seconds=0.01,
        training_retry_timeout_seconds=5,
        control_retry_timeout_seconds=2,
        sampling_retry_timeout_seconds=5,
    )
    yield
    pytrio.configure(**saved)


@dataclass
class Remote:
    kind: str
    stub: Any  # PytrioStub | TinkerStub
    adapter: RemoteTrainingClient
    guarded: GuardedTrainingClient


def open_remote(kind: str, tok_dir: Path, *overrides: str) -> tuple[StubServer, Any]:
    stub: StubServer = PytrioStub() if kind == "pytrio" else TinkerStub()
    stub.start()
    cfg = load_config(
        None,
        [
            f'backend.kind="{kind}"',
            f'model.name="{tok_dir}"',
            f'backend.base_url="{stub.url}"',
            "lora.rank=16",
            "retry.attempts=3",
            "retry.backoff=0.001",
            "retry.max_backoff=0.002",
            "retry.call_timeout=60",
            "retry.sample_timeout=60",
            *overrides,
        ],
    )
    return stub, cfg


@pytest.fixture
def remote_factory(env: None, tok_dir: Path) -> Iterator[Any]:
    """``make(kind, *config_overrides)``: a stub, the adapter on it and the guard around it. Afterwards:
    hangs released, the SDK session closed, the stub stopped and free of internal errors."""
    made: list[Remote] = []

    def make(kind: str, *overrides: str) -> Remote:
        stub, cfg = open_remote(kind, tok_dir, *overrides)
        adapter = make_training_client(cfg)
        guarded = guard_training_client(adapter, cfg)
        assert isinstance(guarded, GuardedTrainingClient)
        made.append(Remote(kind, stub, adapter, guarded))
        return made[-1]

    yield make
    for remote in made:
        remote.stub.release()
        client = remote.adapter
        runtime = getattr(client._client, "_runtime", None)  # pytrio
        if runtime is not None:
            runtime.shutdown()
        service = getattr(client, "_service", None)  # tinker
        if service is not None and service._session_holder is not None:
            service.close("success").result(timeout=10)
        remote.stub.stop()
        assert remote.stub.errors == []


def micro_batch(k: int) -> list[Datum]:
    """One datum per micro-batch; ``k`` makes the tokens (and so the gradient) differ between them."""
    toks = [5, 6, 7 + k, 8 + k]
    old = [learner_lp(t) - 0.1 for t in toks[1:]]
    return [Datum(toks[:-1], toks[1:], old, [1.0, -0.5, 0.25], [1.0, 1.0, 1.0])]


async def forward_backward(remote: Remote, k: int) -> None:
    await remote.guarded.forward_backward_async(micro_batch(k), "importance_sampling")


def distinct(ids: list[str]) -> int:
    return len(set(ids))


# -- declarations and error restating (no faults on the wire) ------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_declare_neither_request_dedupe_nor_zero_grad(remote_factory: Any, kind: str) -> None:
    remote = remote_factory(kind)
    assert not remote.adapter.dedupes_request_ids
    assert not hasattr(remote.adapter, "zero_grad_async")
    assert remote.guarded.guard == "none"  # the guard's rule 3: only the SDK re-sends training calls


def test_classify_believes_an_outcome_the_exception_states() -> None:
    refused = RemoteCallError("x", outcome=Failure.UNKNOWN, status_code=429)
    assert classify(refused) is Failure.UNKNOWN  # the status alone would say NOT_SENT


def _tinker_status_error(status: int, **headers: str) -> tinker.APIStatusError:
    request = httpx.Request("POST", "http://stub/api/v1/forward_backward")
    response = httpx.Response(status, request=request, headers=headers)
    cls = tinker.RateLimitError if status == 429 else tinker.InternalServerError
    return cls(f"HTTP {status}", response=response, body=None)


def test_tinker_errors_are_restated_only_where_classify_would_misread_them() -> None:
    adapter = TinkerTrainingClient(tinker, lambda: None, base_model="m")
    limited = _tinker_status_error(429, **{"retry-after": "3"})
    # A sample refused with 429 is "not sent" and keeps its Retry-After: passed through unchanged.
    assert adapter.restate(limited, "sample", idempotent=True) is limited
    # The same answer to forward_backward comes after the SDK's own re-sends: outcome unknown.
    restated = adapter.restate(limited, "forward_backward", idempotent=False)
    assert isinstance(restated, RemoteCallError) and classify(restated) is Failure.UNKNOWN
    assert (restated.status_code, restated.retry_after) == (429, 3.0)
    unavailable = _tinker_status_error(503)
    assert adapter.restate(unavailable, "forward_backward", idempotent=False) is unavailable
    failed = tinker.RequestFailedError("boom", "req-1", tinker.types.RequestErrorCategory.Server)
    assert classify(adapter.restate(failed, "sample", idempotent=True)) is Failure.UNKNOWN
    refused = tinker.RequestFailedError("bad", "req-2", tinker.types.RequestErrorCategory.User)
    assert classify(adapter.restate(refused, "sample", idempotent=True)) is Failure.PERMANENT


def test_pytrio_errors_without_an_http_status_are_restated() -> None:
    adapter = PytrioTrainingClient(pytrio, lambda: None, base_model="m")
    # What the SDK raises when the connection dropped and its retries ran out: status_code 0.
    dropped = ActorAPIError("Response read failed", retryable=True)
    assert classify(dropped) is Failure.PERMANENT  # why restating is needed
    assert classify(adapter.restate(dropped, "sample", idempotent=True)) is Failure.UNKNOWN
    stalled = ActorAPIError("no first chunk", code="actor.sampling.first_chunk_timeout")
    assert classify(adapter.restate(stalled, "sample", idempotent=True)) is Failure.UNKNOWN
    unavailable = ActorAPIError("busy", status_code=503)
    assert adapter.restate(unavailable, "sample", idempotent=True) is unavailable
    # A failed event submission breaks the SDK's training run: permanent, whatever the status said.
    for status in (0, 429, 503):
        gave_up = ActorEventSubmitError("gave up", status_code=status, retryable=True)
        restated = adapter.restate(gave_up, "optim_step", idempotent=False)
        assert classify(restated) is Failure.PERMANENT and "resume" in str(restated)


# -- training calls: the SDK re-sends, the service applies once, the guard re-sends nothing ------


@pytest.mark.parametrize("fault", ["drop", "503", "429"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_forward_backward_is_resent_by_the_sdk_alone_and_counted_once(
    remote_factory: Any, kind: str, fault: str
) -> None:
    remote = remote_factory(kind)
    remote.stub.retry_after = 0.01  # honoured by Tinker's HTTP retries; PyTRIO's use their own delay

    async def step() -> None:
        await forward_backward(remote, 0)
        remote.stub.fail("forward_backward", fault)  # "drop": applied, then the connection closed
        await forward_backward(remote, 1)
        await forward_backward(remote, 2)
        await remote.guarded.optim_step_async(AdamParams())

    asyncio.run(step())
    ids = remote.stub.wire_ids["forward_backward"]
    assert len(ids) == 4 and distinct(ids) == 3  # the failed request re-sent once, under its own id
    assert remote.stub.steps == [3]  # one optimizer step over three accumulations: none doubled
    assert remote.guarded.retry_stats.retries == 0  # the guard re-sent nothing
    assert remote.guarded.retry_stats.failures == 0


@pytest.mark.parametrize("fault", ["drop", "503"])
@pytest.mark.parametrize("kind", KINDS)
def test_optim_step_is_resent_by_the_sdk_alone_and_applied_once(
    remote_factory: Any, kind: str, fault: str
) -> None:
    remote = remote_factory(kind)
    remote.stub.retry_after = 0.01

    async def steps() -> None:
        for k in range(2):
            await forward_backward(remote, k)
            remote.stub.fail("optim_step", fault)
            await remote.guarded.optim_step_async(AdamParams())

    asyncio.run(steps())
    ids = remote.stub.wire_ids["optim_step"]
    assert len(ids) == 4 and distinct(ids) == 2
    assert remote.stub.steps == [1, 1]  # two optimizer steps, each applied once
    assert remote.guarded.retry_stats.retries == 0


@pytest.mark.parametrize("fault", ["drop", "429"])
def test_when_the_pytrio_sdk_gives_up_on_a_training_call_nothing_resends_it(
    remote_factory: Any, fault: str
) -> None:
    pytrio.configure(training_retry_timeout_seconds=0)  # the SDK gives up at the first failure
    remote = remote_factory("pytrio")

    async def step() -> None:
        await forward_backward(remote, 0)
        remote.stub.fail("forward_backward", fault)
        with pytest.raises(RemoteCallError, match="resume from the last checkpoint") as failed:
            await forward_backward(remote, 1)
        assert classify(failed.value) is Failure.PERMANENT
        with pytest.raises(UnsafeRetryError, match="optim_step refused"):
            await remote.guarded.optim_step_async(AdamParams())

    asyncio.run(step())
    assert len(remote.stub.wire_ids["forward_backward"]) == 2  # sent once each, never again
    assert remote.stub.applied["forward_backward"] == (2 if fault == "drop" else 1)
    assert remote.stub.steps == []  # no optimizer step used the doubtful gradient


@pytest.mark.parametrize("kind", KINDS)
def test_a_hung_forward_backward_times_out_is_not_resent_and_blocks_the_optimizer_step(
    remote_factory: Any, kind: str
) -> None:
    pytrio.configure(training_retry_timeout_seconds=0)  # let the SDK give up once the hang is released
    remote = remote_factory(kind)

    async def step() -> None:
        await forward_backward(remote, 0)
        remote.stub.fail("forward_backward", "hang")  # applied, then no answer
        with hang_timeout(remote), pytest.raises(UnsafeRetryError, match="unknown outcome"):
            await forward_backward(remote, 1)
        with pytest.raises(UnsafeRetryError, match="optim_step refused"):
            await remote.guarded.optim_step_async(AdamParams())

    asyncio.run(step())
    assert remote.guarded.retry_stats.timeouts == 1
    assert distinct(remote.stub.wire_ids["forward_backward"]) == 2  # no new request for the hung call
    assert remote.stub.steps == []


# -- idempotent calls: the guard re-sends them, and abandons what hung --------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_hung_sample_times_out_is_cancelled_in_the_sdk_and_retried(remote_factory: Any, kind: str) -> None:
    # One sample slot in the PyTRIO SDK: the retry gets it only if the abandoned request was cancelled.
    pytrio.configure(sampling_request_max_in_flight=1)
    remote = remote_factory(kind, f"retry.sample_timeout={HANG_TIMEOUT}")

    async def sample() -> list[Any]:
        sampler = await remote.guarded.sampling_client_async()
        remote.stub.fail("sample", "hang")
        return await sampler.sample_async([1, 2, 3], 2, SamplingParams(max_tokens=3))

    samples = asyncio.run(sample())
    assert [s.tokens for s in samples] == [sampled_tokens([1, 2, 3], i, 3) for i in range(2)]
    assert remote.guarded.retry_stats.timeouts == 1 and remote.guarded.retry_stats.retries == 1
    assert distinct(remote.stub.wire_ids["sample"]) == 2  # the retry is a new request


@dataclass
class _Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "stop"


@dataclass
class _Answer:
    sequences: list[_Sequence]


class _StuckSampler:
    """An SDK sampler whose first request blocks its thread inside the SDK, with no future to cancel."""

    def __init__(self) -> None:
        self.requests = 0
        self.release = threading.Event()

    def sample(self, prompt: Any, num_samples: int, sampling_params: Any) -> _Answer:
        self.requests += 1
        if self.requests == 1:
            self.release.wait(30)
        return _Answer([_Sequence([7], [-0.5]) for _ in range(num_samples)])


def test_a_call_that_cannot_be_cancelled_never_holds_the_event_loops_pool() -> None:
    owner = TinkerTrainingClient(tinker, lambda: None, base_model="m")
    stuck = _StuckSampler()
    policy = RetryPolicy(attempts=2, timeout=0.5, backoff=0.001, max_backoff=0.002)
    sampler = GuardedSamplingClient(RemoteSamplingClient(tinker, stuck, owner), policy, RetryStats())

    async def sample() -> list[Any]:
        # One worker in the loop's default pool: a retry could not run while the hung call sat in it.
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        return await sampler.sample_async([1, 2], 1, SamplingParams(max_tokens=3))

    try:
        [only] = asyncio.run(sample())
    finally:
        stuck.release.set()
    assert only.tokens == [7] and stuck.requests == 2


@pytest.mark.parametrize("fault", ["503", "429", "drop"])
def test_a_sample_the_pytrio_sdk_gave_up_on_is_retried_by_the_guard(remote_factory: Any, fault: str) -> None:
    pytrio.configure(sampling_retry_timeout_seconds=0)  # the SDK reports the first failure
    remote = remote_factory("pytrio")
    remote.stub.retry_after = 0.01

    async def sample() -> list[Any]:
        sampler = await remote.guarded.sampling_client_async()
        remote.stub.fail("sample", fault)
        return await sampler.sample_async([4, 5], 1, SamplingParams(max_tokens=3))

    [only] = asyncio.run(sample())
    assert only.tokens == sampled_tokens([4, 5], 0, 3)
    assert remote.guarded.retry_stats.retries == 1  # "drop" is reported with status 0: restated, retried
    assert len(remote.stub.wire_ids["sample"]) == 2


def test_a_503_on_a_tinker_sample_is_retried_by_the_sdk_alone(remote_factory: Any) -> None:
    remote = remote_factory("tinker")

    async def sample() -> list[Any]:
        sampler = await remote.guarded.sampling_client_async()
        remote.stub.fail("sample", "503")
        return await sampler.sample_async([4, 5], 1, SamplingParams(max_tokens=3))

    [only] = asyncio.run(sample())
    assert only.tokens == sampled_tokens([4, 5], 0, 3)
    ids = remote.stub.wire_ids["sample"]
    assert len(ids) == 2 and distinct(ids) == 1  # the SDK re-sent the same request
    assert remote.guarded.retry_stats.retries == 0


def test_a_hung_tinker_save_is_cancelled_in_the_sdk_so_later_calls_are_not_stuck_behind_it(
    remote_factory: Any,
) -> None:
    """Tinker runs a training client's requests in turn order; an abandoned call still holding its turn
    would stall every later one. Cancelling the SDK's future hands the turn on."""
    remote = remote_factory("tinker")

    async def run() -> str:
        await forward_backward(remote, 0)
        remote.stub.fail("save_state", "hang")
        with hang_timeout(remote):
            path = await remote.guarded.save_state_async("ckpt")
        await forward_backward(remote, 1)
        await remote.guarded.optim_step_async(AdamParams())
        return path

    assert asyncio.run(run()).endswith("/weights/ckpt")
    assert remote.guarded.retry_stats.timeouts == 1 and remote.guarded.retry_stats.retries == 1
    assert remote.stub.steps == [2]
