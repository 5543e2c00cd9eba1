"""``GuardedTrainingClient``: timeouts and retries on every backend call, and the gradient guard.

The fake service keeps a scalar "gradient": each ``forward_backward`` adds its datums' sum, each
``optim_step`` moves a weight by it and clears it. Faults are scripted per call: drop the answer *after*
applying (the dangerous case: a blind re-send would count the micro-batch twice), hang after applying
(our timeout fires), answer 503 or 429 without applying, refuse the connection. Every test checks the one
thing that matters: the gradient that reaches ``optim_step`` holds each micro-batch exactly once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    OptimStepResult,
    Sample,
    SamplingParams,
)
from retool.backends.remote.guarded import GuardedSamplingClient, GuardedTrainingClient, guard_training_client
from retool.config import load_config
from retool.retry import RetriesExhaustedError, RetryPolicy, UnsafeRetryError
from retool.train.step import train_step

POLICY = RetryPolicy(attempts=4, timeout=0.2, backoff=0.001, max_backoff=0.002)


class Status(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


def datum(value: float, n: int = 3) -> Datum:
    return Datum([1] * n, [2] * n, [-0.1] * n, [value] * n, [1.0] * n)


class FakeService:
    """A training service with scripted faults: ``faults[(kind, index)] = [fault, ...]`` per attempt."""

    tokenizer = "tok"
    one_call_per_step = False  # a TrainingClient capability: micro-batches may be separate calls

    def __init__(self, faults: dict[tuple[str, int], list[str]] | None = None) -> None:
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        self.grad = 0.0
        self.weight = 0.0
        self.calls: list[tuple[str, int, str | None]] = []
        self.fb_index = 0
        self.steps = 0

    async def _maybe_fault(self, key: tuple[str, int], apply) -> None:
        fault = self.faults.get(key, []).pop(0) if self.faults.get(key) else None
        if fault in ("503", "429", "refused"):
            if fault == "refused":
                raise ConnectionRefusedError("connection refused")
            raise Status(int(fault))
        apply()
        if fault == "drop":
            raise ConnectionResetError("connection reset after the request was applied")
        if fault == "hang":
            await asyncio.sleep(30)  # our timeout cancels this; the effect has happened already

    async def forward_backward_async(self, datums, loss_fn, loss_config=None) -> ForwardBackwardResult:
        index = self.fb_index
        self.calls.append(("fb", index, None))

        def apply() -> None:
            self.grad += sum(d.advantages[0] for d in datums)

        await self._maybe_fault(("fb", index), apply)
        self.fb_index += 1
        return ForwardBackwardResult(loss=0.0, trained_tokens=sum(len(d) for d in datums))

    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult:
        self.calls.append(("optim", self.steps, None))

        def apply() -> None:
            self.weight += self.grad
            self.grad = 0.0

        await self._maybe_fault(("optim", self.steps), apply)
        self.steps += 1
        self.fb_index = 0
        return OptimStepResult(grad_norm=abs(self.weight), lr=adam.lr)

    async def save_state_async(self, name: str) -> str:
        await self._maybe_fault(("save", 0), lambda: None)
        return f"state://{name}"

    async def load_state_async(self, path: str) -> None:
        await self._maybe_fault(("load", 0), lambda: None)

    async def sampling_client_async(self) -> FakeSampler:
        await self._maybe_fault(("sampler", 0), lambda: None)
        return FakeSampler(self.faults)

    async def close_async(self) -> None:
        pass


class ReplayService(FakeService):
    """Can discard its accumulated gradient: the guard replays the window."""

    async def zero_grad_async(self) -> None:
        self.calls.append(("zero_grad", 0, None))
        self.grad = 0.0
        self.fb_index = 0


class DedupeService(FakeService):
    """Applies a request id once (like an idempotency key); retries carry the same id."""

    dedupes_request_ids = True

    def __init__(self, faults: dict[tuple[str, int], list[str]] | None = None) -> None:
        super().__init__(faults)
        self.seen: set[str] = set()
        self.ids: list[str] = []

    async def forward_backward_async(self, datums, loss_fn, loss_config=None, *, request_id: str):
        self.ids.append(request_id)
        index = int(request_id.rsplit(":", 1)[1])

        def apply() -> None:
            if request_id not in self.seen:
                self.seen.add(request_id)
                self.grad += sum(d.advantages[0] for d in datums)

        await self._maybe_fault(("fb", index), apply)
        return ForwardBackwardResult(loss=0.0, trained_tokens=1)

    async def optim_step_async(self, adam: AdamParams, *, request_id: str) -> OptimStepResult:  # type: ignore[override]
        self.ids.append(request_id)

        def apply() -> None:
            if request_id not in self.seen:
                self.seen.add(request_id)
                self.weight += self.grad
                self.grad = 0.0
                self.steps += 1

        await self._maybe_fault(("optim", self.steps), apply)
        return OptimStepResult(grad_norm=0.0, lr=adam.lr)


class FakeSampler:
    def __init__(self, faults: dict[tuple[str, int], list[str]]) -> None:
        self.faults = faults
        self.requests = 0
        self.batch_limit = 7

    async def sample_async(self, prompt_tokens, num_samples, params) -> list[Sample]:
        self.requests += 1
        fault = self.faults.get(("sample", 0), []).pop(0) if self.faults.get(("sample", 0)) else None
        if fault == "hang":
            await asyncio.sleep(30)
        if fault == "drop":
            raise ConnectionResetError("dropped")
        if fault == "503":
            raise Status(503)
        return [Sample([5], [-0.5], "stop") for _ in range(num_samples)]


VALUES = [1.0, 10.0, 100.0]  # one micro-batch each: a double count shows in the sum


async def _step(client: Any) -> None:
    for v in VALUES:
        await client.forward_backward_async([datum(v)], "ppo")
    await client.optim_step_async(AdamParams())


@pytest.mark.parametrize("fault", ["drop", "hang", "503", "429", "refused"])
def test_replay_guard_counts_each_micro_batch_once(fault: str) -> None:
    service = ReplayService({("fb", 1): [fault, fault]})
    client = GuardedTrainingClient(service, policy=POLICY)
    assert client.guard == "replay"
    asyncio.run(_step(client))
    assert service.weight == sum(VALUES)
    applied_before_answer = fault in ("drop", "hang")
    # Only an unknown outcome makes the guard discard and replay (503 is unknown, too).
    assert client.replays == (2 if applied_before_answer or fault == "503" else 0)
    assert client.retry_stats.retries == 2 and client.retry_stats.failures == 0
    assert client.retry_stats.timeouts == (2 if fault == "hang" else 0)


def test_replay_guard_reissues_the_window_from_its_first_call() -> None:
    service = ReplayService({("fb", 2): ["drop"]})
    client = GuardedTrainingClient(service, policy=POLICY)
    asyncio.run(_step(client))
    kinds = [(k, i) for k, i, _ in service.calls]
    assert kinds == [
        ("fb", 0),
        ("fb", 1),
        ("fb", 2),
        ("zero_grad", 0),
        ("fb", 0),
        ("fb", 1),
        ("fb", 2),
        ("optim", 0),
    ]
    assert service.weight == sum(VALUES)


def test_dedupe_guard_resends_the_same_request_id() -> None:
    service = DedupeService({("fb", 1): ["drop", "hang"], ("optim", 0): ["drop"]})
    client = GuardedTrainingClient(service, policy=POLICY)
    assert client.guard == "dedupe"
    asyncio.run(_step(client))
    assert service.weight == sum(VALUES) and service.steps == 1
    fb1 = [i for i in service.ids if i.endswith(":fb:1")]
    assert len(fb1) == 3 and len(set(fb1)) == 1  # three attempts, one id
    optim = [i for i in service.ids if ":optim:" in i]
    assert len(optim) == 2 and len(set(optim)) == 1
    asyncio.run(_step(client))  # the next step uses fresh ids
    assert service.weight == 2 * sum(VALUES) and service.steps == 2


def test_without_a_guard_an_unknown_outcome_is_not_resent_and_blocks_the_optimizer_step() -> None:
    service = FakeService({("fb", 1): ["drop"]})
    client = GuardedTrainingClient(service, policy=POLICY)
    assert client.guard == "none"

    async def main() -> None:
        await client.forward_backward_async([datum(1.0)], "ppo")
        with pytest.raises(UnsafeRetryError, match="unknown outcome"):
            await client.forward_backward_async([datum(10.0)], "ppo")
        with pytest.raises(UnsafeRetryError, match="optim_step refused"):
            await client.optim_step_async(AdamParams())

    asyncio.run(main())
    assert [k for k, _, _ in service.calls] == ["fb", "fb"]  # never re-sent, never stepped
    assert service.weight == 0.0


@pytest.mark.parametrize("fault", ["429", "refused"])
def test_without_a_guard_requests_that_never_arrived_are_retried(fault: str) -> None:
    service = FakeService({("fb", 1): [fault], ("optim", 0): [fault]})
    client = GuardedTrainingClient(service, policy=POLICY)
    asyncio.run(_step(client))
    assert service.weight == sum(VALUES) and service.steps == 1


@pytest.mark.parametrize("service_cls", [FakeService, ReplayService])
def test_optim_step_is_never_applied_twice(service_cls: type[FakeService]) -> None:
    service = service_cls({("optim", 0): ["drop"]})
    client = GuardedTrainingClient(service, policy=POLICY)
    with pytest.raises(UnsafeRetryError, match="optim_step failed with an unknown outcome"):
        asyncio.run(_step(client))
    assert [k for k, _, _ in service.calls].count("optim") == 1


def test_retries_are_bounded() -> None:
    service = ReplayService({("fb", 0): ["503"] * 10})
    client = GuardedTrainingClient(service, policy=POLICY)
    with pytest.raises(RetriesExhaustedError, match="forward_backward failed after 4 attempt"):
        asyncio.run(_step(client))
    assert client.retry_stats.failures == 1


@pytest.mark.parametrize("fault", ["hang", "drop", "503"])
def test_sampler_requests_are_retried(fault: str) -> None:
    service = FakeService({("sample", 0): [fault, fault], ("sampler", 0): ["503"]})
    client = GuardedTrainingClient(service, policy=POLICY)

    async def main() -> list[Sample]:
        sampler = await client.sampling_client_async()
        assert isinstance(sampler, GuardedSamplingClient) and sampler.batch_limit == 7  # attributes pass
        return await sampler.sample_async([1, 2], 3, SamplingParams(max_tokens=4))

    samples = asyncio.run(main())
    assert len(samples) == 3
    assert client.retry_stats.retries == 3  # one for the sampler refresh, two for the request
    counters = client.fault_counters()
    assert counters["faults/remote_retries"] == 3 and counters["faults/remote_timeouts"] == (
        2 if fault == "hang" else 0
    )


def test_save_and_load_are_retried_and_load_resets_the_window() -> None:
    service = ReplayService({("save", 0): ["drop"], ("load", 0): ["503"]})
    client = GuardedTrainingClient(service, policy=POLICY)

    async def main() -> str:
        path = await client.save_state_async("ckpt")
        await client.forward_backward_async([datum(1.0)], "ppo")
        await client.load_state_async(path)
        return path

    assert asyncio.run(main()) == "state://ckpt"
    assert client._window == []


def test_train_step_through_the_guard_equals_a_fault_free_step() -> None:
    datums = [datum(float(v), n) for v, n in ((1, 3), (2, 5), (4, 2), (8, 7), (16, 1))]

    async def run(service: FakeService) -> float:
        await train_step(
            GuardedTrainingClient(service, policy=POLICY),
            datums,
            loss_fn="ppo",
            loss_config=None,
            adam=AdamParams(),
            micro_batch_tokens=8,
        )
        return service.weight

    clean = asyncio.run(run(ReplayService()))
    faulty = asyncio.run(run(ReplayService({("fb", 1): ["drop"], ("fb", 2): ["hang", "503"]})))
    assert clean == faulty == sum(d.advantages[0] for d in datums)


def test_guard_applies_to_remote_backends_by_default() -> None:
    service = FakeService()
    assert guard_training_client(service, load_config(None, [])) is service  # local: not wrapped
    remote = guard_training_client(
        service, load_config(None, ["backend.kind='tinker'", "retry.call_timeout=5"])
    )
    assert isinstance(remote, GuardedTrainingClient) and remote.policy.timeout == 5
    assert remote.tokenizer == "tok"
    forced = guard_training_client(
        service, load_config(None, ["retry.guard='always'", "retry.sample_timeout=0"])
    )
    assert isinstance(forced, GuardedTrainingClient) and forced.sample_policy.timeout is None
    assert (
        guard_training_client(service, load_config(None, ["backend.kind='tinker'", "retry.guard='never'"]))
        is service
    )


def test_every_command_gets_the_guard_through_build_components(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train, eval, sft and demo build their parts with ``build_components``: a remote backend comes back
    behind the guard there (so ``retool eval`` has the same timeouts as training), a local one bare."""
    import retool.components
    from retool.components import build_components

    service = FakeService()
    monkeypatch.setattr(retool.components, "make_training_client", lambda config: service)
    monkeypatch.setattr("retool.protocol.ChatProtocol.from_config", lambda *a, **k: object())
    remote = build_components(load_config(None, ["backend.kind='tinker'"]), tools=False)
    local = build_components(load_config(None, []), tools=False)
    try:
        assert isinstance(remote.backend, GuardedTrainingClient) and remote.backend.inner is service
        assert local.backend is service
    finally:
        remote.verifier.close()
        local.verifier.close()


def test_replay_on_the_real_local_backend_gives_the_same_gradient(tiny_model_dir) -> None:
    """The local backend's ``zero_grad_async`` + replay: after a forward_backward whose answer was lost
    (applied, then the connection "dropped"), the accumulated gradient equals a fault-free one bitwise."""
    import torch

    from retool.backends.local.client import LocalTrainingClient

    client = LocalTrainingClient(tiny_model_dir, device="cpu", seed=0, num_threads=1)
    datums = [Datum([5, 6, 7, 8], [6, 7, 8, 9], [-1.0] * 4, [a] * 4, [0.1] * 4) for a in (0.5, -1.0, 2.0)]

    async def accumulate(target: Any) -> list[torch.Tensor]:
        for d in datums:
            await target.forward_backward_async([d], "ppo", {"clip_low": 0.8, "clip_high": 1.28})
        return [p.grad.detach().clone() for p in client.trainable_parameters()]

    class DropsOnce:
        """The real client; the second forward_backward is applied, then its answer is lost."""

        def __init__(self) -> None:
            self.calls = 0

        async def forward_backward_async(self, *args: Any) -> ForwardBackwardResult:
            self.calls += 1
            result = await client.forward_backward_async(*args)
            if self.calls == 2:
                raise ConnectionResetError("answer lost after the gradient was accumulated")
            return result

        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

    try:
        clean = asyncio.run(accumulate(client))
        asyncio.run(client.zero_grad_async())
        assert all(p.grad is None for p in client.trainable_parameters())
        guarded = GuardedTrainingClient(DropsOnce(), policy=POLICY)
        assert guarded.guard == "replay"
        replayed = asyncio.run(accumulate(guarded))
        assert guarded.replays == 1
        assert all(torch.equal(a, b) for a, b in zip(clean, replayed, strict=True))
    finally:
        client.close()
