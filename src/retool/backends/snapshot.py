"""Frozen samplers for the local backend: sample from version v of the weights while version v+1 trains.

The local backend's own sampler is a live view of the trainer's weights (``retool.backends.local``), which
is right for synchronous RL and wrong for off-policy pipelining (``train.max_steps_off_policy``): a batch
sampled while the trainer takes an optimizer step would mix two policy versions and carry the wrong tag.
``LocalTrainingClient.frozen_sampling_client_async`` returns a ``FrozenSamplingClient`` instead:

- ``frozen_copy(model)`` copies every tensor training can change (all parameters in full fine-tuning, the
  LoRA matrices with an adapter) and shares the rest with the trainer (frozen base weights, buffers),
  which training never writes. It runs on the trainer's worker thread, queued behind every training call
  made before it, so the copy holds exactly the weights after the last ``optim_step``.
- Generation on the copy runs on a sampling thread of its own (one per client, shared by its frozen
  samplers), so a batch generates while the worker thread trains: on CPU the two run on two cores (torch
  releases the GIL inside its kernels); on one GPU they share it.

Requests are gathered and seeded exactly as by the live sampler, so a frozen sampler of version v returns
what the live sampler returned before any later update (same tokens, logprobs equal to float rounding).
"""

from __future__ import annotations

import copy
from concurrent.futures import Executor
from typing import Any

import torch

from retool.backends.generation import GenRequest
from retool.backends.local import LocalSamplingClient, LocalTrainingClient
from retool.backends.types import Sample


def frozen_copy(model: Any) -> Any:
    """A copy of ``model`` in eval mode that owns a copy of every trainable tensor and shares the rest."""
    memo: dict[int, Any] = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    with torch.no_grad():
        frozen = copy.deepcopy(model, memo)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


class FrozenSamplingClient(LocalSamplingClient):
    """Batched sampler of ``owner`` over one frozen copy of its weights, generating on ``worker``.

    ``policy_step``: the owner's optimizer steps when the copy was taken (which version it samples).
    """

    def __init__(self, owner: LocalTrainingClient, model: Any, worker: Executor, gather_ms: float) -> None:
        super().__init__(owner, gather_ms=gather_ms)
        self._worker = worker
        self.model = model
        self.policy_step = owner.step

    def _run_batch(self, requests: list[GenRequest]) -> list[Sample]:
        return self._owner.generate_on(self.model, requests)
