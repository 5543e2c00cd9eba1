"""The parts one run talks to, assembled from a ``Config`` in exactly one place.

``build_components(config)`` returns ``Components``: the training / sampling ``backend`` (local,
PyTRIO or Tinker), the chat ``protocol`` bound to the backend's tokenizer, the sandbox ``executor``
(only when the tool is on) and the answer ``verifier``. ``retool train``, ``retool eval``, ``retool sft``
and ``retool demo`` all build their parts here, so a setting means the same thing in every command.

Ownership is simple: whoever builds a ``Components`` closes it (``close`` / ``aclose`` / ``with``);
the trainer and the evaluator never close parts they are given. ``for_mode`` gives a view of the same
parts with the tool switched on or off (an eval's two modes), which is never closed itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass
from types import TracebackType

from retool.backends import make_training_client
from retool.backends.interface.clients import SamplingClient, TrainingClient
from retool.backends.remote.guarded import guard_training_client
from retool.config import Config
from retool.protocol import ChatProtocol
from retool.reward import Verifier
from retool.sandbox import Executor, make_executor

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """A backend, its chat protocol, a verifier and (tool on) an executor; ``sampler`` once refreshed."""

    backend: TrainingClient
    protocol: ChatProtocol
    verifier: Verifier
    executor: Executor | None = None
    sampler: SamplingClient | None = None

    async def refresh_sampler(self) -> SamplingClient:
        """A sampler over the backend's current weights (on-policy: call it at the start of every step)."""
        self.sampler = await self.backend.sampling_client_async()
        return self.sampler

    def for_mode(self, use_tools: bool) -> Components:
        """The same parts with the tool on (``retool`` mode) or off (``text-only``: no executor)."""
        return dataclasses.replace(
            self,
            protocol=self.protocol.with_tools(use_tools),
            executor=self.executor if use_tools else None,
        )

    async def aclose(self) -> None:
        """Close every part; a part that fails to close is logged, so it cannot hide the run's own error."""
        for part in (self.executor, self.verifier):
            if part is not None:
                try:
                    await asyncio.to_thread(part.close)
                except Exception:
                    logger.exception("closing %s failed", type(part).__name__)
        try:
            await self.backend.close_async()
        except Exception:
            logger.exception("closing the training client failed")

    def close(self) -> None:
        """``aclose`` from synchronous code (inside an event loop, await ``aclose`` instead)."""
        asyncio.run(self.aclose())

    def __enter__(self) -> Components:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def build_components(config: Config, *, tools: bool = True) -> Components:
    """Build every part ``config`` describes. ``tools=False`` (text-only evaluation) builds no executor.

    The backend comes first (it is the slowest and the likeliest to fail); if a later part fails, the
    parts already built are closed before the error propagates.
    """
    # Behind the retry guard as ``[retry]`` says (remote backends by default): evaluation and SFT get the
    # same timeouts and retries as training.
    backend = guard_training_client(make_training_client(config), config)
    executor: Executor | None = None
    try:
        protocol = ChatProtocol.from_config(backend.tokenizer, config, use_tools=tools)
        executor = make_executor(config.sandbox) if tools else None
        verifier = Verifier.from_config(config.reward)
    except BaseException:
        if executor is not None:
            executor.close()
        _close_backend_now(backend)
        raise
    return Components(backend=backend, protocol=protocol, verifier=verifier, executor=executor)


def _close_backend_now(backend: TrainingClient) -> None:
    """Close a backend from synchronous code, also when an event loop runs in this thread (a trainer
    builds its parts inside ``run_async``), where the synchronous wrapper refuses to block the loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        backend.close()
        return
    worker = threading.Thread(target=backend.close, name="retool-close-backend")
    worker.start()
    worker.join()
