"""The local backend's samplers and the queue that batches their requests.

``LocalSamplingClient`` is a *live view* of the trainer's current weights, not a snapshot: the sampler
returned by ``sampling_client_async()`` always samples from whatever the weights are when its batch runs
(generation uses eval mode and ``no_grad``). The RL loop refreshes the sampler at the start of each step
and does not optimise while sampling, so this is on-policy; with LoRA dropout 0 the trainer's recomputed
logprobs match the sampler's to float precision (ratio 1).

Concurrent ``sample_async`` calls are gathered for a few milliseconds and handed together to the
continuous-batching engine of ``retool.backends.engine.generation``: up to ``sample_batch_size`` sequences
decode together, new ones join at step boundaries and finished ones leave at once.

Off-policy pipelining (``train.max_steps_off_policy``) samples from a ``FrozenSamplingClient``: a copy of
the weights of one version that generates on a thread of its own while the worker thread trains.

Seeds: sample ``i`` of a request with ``seed=s`` uses its own generator seeded from ``(s, i)``, so the
result does not depend on what else shares the batch; unseeded requests draw seeds from the owner's RNG.

A sampler names what it needs of the training client it samples for as ``SamplerOwner``
(``retool.backends.local.client.LocalTrainingClient`` is one), so this module does not import the client
that builds it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from retool.backends.engine.generation import ContinuousGenerator, GenRequest
from retool.backends.interface.clients import SamplingClient
from retool.backends.interface.types import Sample, SamplingParams
from retool.backends.local.stats import BackendStats

logger = logging.getLogger(__name__)


class SamplerOwner(Protocol):
    """What a local sampler uses of the training client it samples for (``LocalTrainingClient``)."""

    # Read-only here (properties), so the client's own attribute types need only be narrower.
    @property
    def sample_batch_size(self) -> int: ...

    @property
    def step(self) -> int:
        """Optimizer steps so far: the version a frozen copy samples."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def tokenizer(self) -> object: ...

    @property
    def _executor(self) -> Executor:
        """The worker thread every forward of the client runs on."""
        ...

    def sampling_model(self) -> torch.nn.Module:
        """The module generation runs on (a transformers / PEFT model)."""
        ...

    def make_engine(
        self,
        model_fn: Callable[[], torch.nn.Module],
        tag_fn: Callable[[], Hashable],
        executor: Executor,
        should_yield: Callable[[], bool] = ...,
        stats: BackendStats | None = None,
        select_adapters: Callable[[list[Hashable]], None] | None = None,
    ) -> ContinuousGenerator: ...

    def _sequence_seeds(self, seed: int | None, num_samples: int) -> list[int]: ...

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None: ...

    def _check_sample_request(self, prompt: list[int], num_samples: int, params: SamplingParams) -> None: ...


@dataclass
class _Pending:
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    seeds: list[int]
    future: asyncio.Future[list[Sample]]


@dataclass
class _LoopQueue:
    pending: collections.deque[_Pending] = field(default_factory=collections.deque)
    task: asyncio.Task[None] | None = None
    deliveries: set[asyncio.Task[None]] = field(default_factory=set)  # strong references while running


class LocalSamplingClient(SamplingClient):
    """Batched sampler over the owning trainer's current weights (a live view; see the module docstring).

    Concurrent requests are gathered for ``gather_ms`` and handed to ``engine`` (continuous batching,
    ``retool.backends.engine.generation``) together; samplers without an engine (external engines: vLLM,
    llama.cpp) override ``_run_batch``, which runs each gathered batch on the worker thread.
    """

    adapter: Hashable = (
        None  # the adapter its rows name on a shared engine (``retool.backends.samplers.multi_lora``)
    )

    def __init__(
        self, owner: SamplerOwner, gather_ms: float = 5.0, engine: ContinuousGenerator | None = None
    ) -> None:
        self._owner = owner
        self.batch_limit = owner.sample_batch_size
        self._gather_s = gather_ms / 1000.0
        self._engine = engine
        self._worker: Executor = owner._executor  # the thread external engines' batches run on
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopQueue] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def tokenizer(self) -> Any:
        return self._owner.tokenizer

    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]:
        prompt = [int(t) for t in prompt_tokens]
        self._owner._check_sample_request(prompt, num_samples, params)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Sample]] = loop.create_future()
        seeds = self._owner._sequence_seeds(params.seed, num_samples)
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _LoopQueue()
        queue.pending.append(_Pending(prompt, num_samples, params, seeds, fut))
        if queue.task is None or queue.task.done():
            queue.task = loop.create_task(self._dispatch(queue))
        return await fut

    async def _dispatch(self, queue: _LoopQueue) -> None:
        limit = self.batch_limit
        while queue.pending:
            await asyncio.sleep(self._gather_s)  # let concurrent callers join this batch
            batch: list[_Pending] = []
            count = 0
            while queue.pending and (not batch or count + queue.pending[0].num_samples <= limit):
                item = queue.pending.popleft()
                if item.future.cancelled():
                    continue
                batch.append(item)
                count += item.num_samples
            if not batch:
                continue
            flat = [GenRequest(p.prompt, p.params, s, self.adapter) for p in batch for s in p.seeds]
            try:
                running = self._start_batch(flat)
            except Exception as exc:  # every waiter learns why; the queue keeps serving later requests
                logger.exception("local sampling batch failed")
                _fail_all(batch, exc)
                continue
            task = asyncio.get_running_loop().create_task(_deliver(batch, running))
            queue.deliveries.add(task)
            task.add_done_callback(queue.deliveries.discard)

    def _scoring_model(self) -> torch.nn.Module:
        """The module this sampler's weights live in (a frozen copy, or the trainer's current weights)."""
        return self._owner.sampling_model()

    async def prompt_logprobs_async(self, prompt_tokens: Sequence[int]) -> torch.Tensor:
        """The log-softmax of the next-token distribution after every prefix ``prompt[:i+1]``, ``i < n-1``:
        a float32 ``[len(prompt) - 1, vocab]`` tensor on the CPU (row ``i`` scores prompt position ``i+1``).
        It runs on the thread this sampler generates on, so it sees the weights its samples do."""
        prompt = [int(t) for t in prompt_tokens]
        if len(prompt) < 2:
            return torch.zeros((0, 0))
        self._owner._check_tokens(prompt, "prompt")

        def score() -> torch.Tensor:
            model = self._scoring_model()
            model.eval()  # as generation runs it (training sets train() again before each pass)
            ids = torch.tensor([prompt[:-1]], device=self._owner.device)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            return torch.log_softmax(logits, dim=-1).cpu()

        return await asyncio.get_running_loop().run_in_executor(self._worker, score)

    def _start_batch(self, requests: list[GenRequest]) -> Awaitable[list[Sample]]:
        """Start generating one gathered batch; its samples, in order, when awaited."""
        if self._engine is not None:
            return asyncio.wrap_future(self._engine.submit(requests))
        return asyncio.get_running_loop().run_in_executor(self._worker, self._run_batch, requests)

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        """Worker-thread body of one gathered batch, for samplers without an engine (vLLM, llama.cpp)."""
        raise NotImplementedError(f"{type(self).__name__} has neither an engine nor a _run_batch")


def _fail_all(batch: list[_Pending], exc: BaseException) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(exc)


async def _deliver(batch: list[_Pending], running: Awaitable[list[Sample]]) -> None:
    """Hand each request of a gathered batch its samples (or the batch's error)."""
    try:
        samples = await running
    except Exception as exc:
        logger.exception("local sampling batch failed")
        _fail_all(batch, exc)
        return
    start = 0
    for p in batch:
        if not p.future.done():
            p.future.set_result(samples[start : start + p.num_samples])
        start += p.num_samples


class FrozenSamplingClient(LocalSamplingClient):
    """Sampler of ``owner`` over one frozen copy of its weights (``retool.backends.local.sampling_views.frozen_copy``), for off-policy
    pipelining: version v samples while version v+1 trains.

    The copy is taken on the trainer's worker thread, queued behind every training call made before it,
    so it holds exactly the weights after the last ``optim_step``. Its engine generates on ``worker`` (one
    thread per training client, shared by its frozen samplers), so a batch generates while the worker
    thread trains: on CPU the two run on two cores (torch releases the GIL inside its kernels). Its
    prefix cache is its own (its weights never change). ``policy_step``: the owner's optimizer steps
    when the copy was taken (which version it samples).
    """

    def __init__(
        self, owner: SamplerOwner, model: torch.nn.Module, worker: Executor, gather_ms: float
    ) -> None:
        step = owner.step
        engine = owner.make_engine(lambda: model, lambda: ("frozen", step), worker)
        super().__init__(owner, gather_ms=gather_ms, engine=engine)
        self._worker = worker
        self.model = model
        self.policy_step = step

    def _scoring_model(self) -> torch.nn.Module:
        return self.model
