"""Test helper: the plain packing ``retool.backends.training.packing.pack_micro_batches`` is measured against (its
tests and ``bench/backend.py``)."""

from __future__ import annotations

from collections.abc import Sequence


def greedy_micro_batches(lengths: Sequence[int], max_padded_area: int) -> list[list[int]]:
    """The plain baseline ``pack_micro_batches`` is measured against: sort longest first and fill each
    micro-batch until the next row would exceed the area (same batch count, more padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_padded_area:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
