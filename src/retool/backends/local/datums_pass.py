"""One forward(-backward) pass of the local trainer over datums, in micro-batches: the padded tensors of a
micro-batch (``micro_batch_tensors``) and what a pass measured (``DatumsPass``), which passes over shares
of one call's datums (``retool.backends.local.data_parallel``) merge back into.

Datums are padded on the right with an attention mask; a position past a datum's end has weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retool.backends.interface.types import Datum
from retool.backends.training.losses import LossTally


@dataclass
class DatumsPass:
    """A forward(-backward) pass over some datums, before it becomes a ``ForwardBackwardResult``: the loss
    tally, the sum of the trained tokens' logprobs, each datum's token logprobs and the micro-batches (as
    indices of the datums). Passes over disjoint shares of a call merge into the pass over the call."""

    tally: LossTally
    lp_sum: float
    token_logprobs: list[list[float]]
    batches: list[list[int]]
    seconds: float = 0.0  # CPU seconds the pass took in its process (the slowest share's, once merged)

    @classmethod
    def merge(cls, parts: Sequence[tuple[list[int], DatumsPass]], size: int) -> DatumsPass:
        """The pass over ``size`` datums from passes over shares of them: (the share's indices, its pass)."""
        whole = cls(LossTally(), 0.0, [[] for _ in range(size)], [])
        for rows, part in parts:
            whole.tally.merge(part.tally)
            whole.lp_sum += part.lp_sum
            for local, i in enumerate(rows):
                whole.token_logprobs[i] = part.token_logprobs[local]
            whole.batches += [[rows[k] for k in batch] for batch in part.batches]
            whole.seconds = max(whole.seconds, part.seconds)
        return whole


def micro_batch_tensors(
    datums: Sequence[Datum], rows: list[int], pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The datums ``rows`` as right-padded ``[rows, width]`` tensors on ``device``: input ids (``pad_id``
    past each end), targets, attention mask, weights, sampler logprobs, advantages and, when a row has
    one, the ratio mask."""
    width = max(len(datums[i]) for i in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    tgt = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    w = torch.zeros(shape, dtype=torch.float32)
    old = torch.zeros(shape, dtype=torch.float32)
    adv = torch.zeros(shape, dtype=torch.float32)
    ratio_mask: torch.Tensor | None = None
    if any(datums[i].ratio_mask for i in rows):
        # A row without a mask of its own averages over its trained positions (the loss's default).
        ratio_mask = torch.zeros(shape, dtype=torch.float32)
    for r, i in enumerate(rows):
        d = datums[i]
        n = len(d)
        ids[r, :n] = torch.tensor(d.input_tokens, dtype=torch.long)
        tgt[r, :n] = torch.tensor(d.target_tokens, dtype=torch.long)
        mask[r, :n] = 1
        w[r, :n] = torch.tensor(d.weights, dtype=torch.float32) if d.weights else 1.0
        if d.logprobs:
            old[r, :n] = torch.tensor(d.logprobs, dtype=torch.float32)
        if d.advantages:
            adv[r, :n] = torch.tensor(d.advantages, dtype=torch.float32)
        if ratio_mask is not None:
            ratio_mask[r, :n] = torch.tensor(d.ratio_mask, dtype=torch.float32) if d.ratio_mask else w[r, :n]
    out = {"ids": ids, "tgt": tgt, "mask": mask, "w": w, "old": old, "adv": adv}
    if ratio_mask is not None:
        out["ratio_mask"] = ratio_mask
    return {k: v.to(device) for k, v in out.items()}
