"""The one interface every backend implements, shaped like the Tinker / PyTRIO clients.

Async-first: every method has an ``*_async`` coroutine; the plain method is a synchronous wrapper.
A backend is built from the config by ``retool.backends.make_training_client`` (``retool.components`` calls it).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from retool.backends.interface.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossName,
    OptimStepResult,
    ReductionReport,
    Sample,
    SamplingParams,
)

T = TypeVar("T")


def run_sync(coro: Coroutine[object, object, T]) -> T:
    """Run a coroutine from synchronous code (refuses inside a running loop, where it would deadlock)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "called a synchronous backend method inside a running event loop; await the *_async one"
    )


class SamplingClient(abc.ABC):
    """Samples completions from a fixed snapshot of the policy weights."""

    @abc.abstractmethod
    async def sample_async(
        self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams
    ) -> list[Sample]: ...

    def sample(self, prompt_tokens: Sequence[int], num_samples: int, params: SamplingParams) -> list[Sample]:
        return run_sync(self.sample_async(prompt_tokens, num_samples, params))


class TrainingClient(abc.ABC):
    """Holds trainable weights and optimizer state; accumulates gradients until ``optim_step``."""

    tokenizer: Any

    @property
    def precision_mismatch(self) -> str | None:
        """Why this client's sampler computes in other numerics than its trainer *by design* (bf16
        sampling over fp32 master weights), so that sampled and trained logprobs differ on the same
        weights; ``None`` when they agree up to float rounding. ``loss.tis_cap = "auto"`` reads it."""
        return None

    @property
    def reference_kl_unavailable(self) -> str | None:
        """Why this client cannot compute logprobs under the policy training started from (the reference
        of ``policy/ref_kl`` and of the ``ref_kl_coef`` penalty, ``retool.backends.training.losses``);
        ``None`` when it can. A remote service returns no such logprobs."""
        return "the service computes no reference-policy logprobs"

    @abc.abstractmethod
    async def forward_backward_async(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult: ...

    @abc.abstractmethod
    async def optim_step_async(self, adam: AdamParams) -> OptimStepResult: ...

    @abc.abstractmethod
    async def save_state_async(self, name: str) -> str:
        """Save weights, optimizer and RNG state; return a path (or URI) that ``load_state`` accepts."""

    @abc.abstractmethod
    async def load_state_async(self, path: str) -> None: ...

    @abc.abstractmethod
    async def sampling_client_async(self) -> SamplingClient:
        """A sampler over the *current* weights (refresh at the start of every RL step)."""

    async def frozen_sampling_client_async(self) -> SamplingClient:
        """A sampler that keeps sampling from the weights as they are *now*, while training goes on.

        Off-policy pipelining (``train.max_steps_off_policy``) samples later steps while this client trains;
        every sample must come from the version it was asked of. The samplers of the remote services are
        such snapshots already (sampler weights saved on the service), so the default is
        ``sampling_client_async``; a backend whose sampler is a live view of its weights (the local one)
        overrides this with a frozen copy.
        """
        return await self.sampling_client_async()

    async def check_reduction_async(
        self, loss_fn: str, loss_config: dict[str, float] | None = None
    ) -> list[ReductionReport]:
        """Hook the trainer calls once per run, before training: a backend whose service normalises the
        loss its own way measures how (``retool.backends.training.reduction``) and adopts it, or raises. The loss
        is computed here by default, so there is nothing to check."""
        return []

    @property
    def one_call_per_step(self) -> bool:
        """True when an optimizer step must reach the backend as one ``forward_backward`` call (a service
        whose reduction divides the step's gradient by the datums it accumulated,
        ``retool.backends.training.reduction``); ``retool.train.step.train_step`` reads it."""
        return False

    def fault_counters(self) -> dict[str, float]:
        """Faults this client absorbed since it started (retries, replays), as ``faults/*`` metrics; none
        by default."""
        return {}

    async def close_async(self) -> None:  # noqa: B027 - optional hook
        """Release resources (sessions, threads)."""

    # -- synchronous wrappers ------------------------------------------------------------------
    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: LossName, loss_config: dict[str, float] | None = None
    ) -> ForwardBackwardResult:
        return run_sync(self.forward_backward_async(datums, loss_fn, loss_config))

    def optim_step(self, adam: AdamParams) -> OptimStepResult:
        return run_sync(self.optim_step_async(adam))

    def save_state(self, name: str) -> str:
        return run_sync(self.save_state_async(name))

    def load_state(self, path: str) -> None:
        run_sync(self.load_state_async(path))

    def sampling_client(self) -> SamplingClient:
        return run_sync(self.sampling_client_async())

    def close(self) -> None:
        run_sync(self.close_async())
