"""Dynamic micro-batch packing by padded area (rows x longest row), and the padding-waste figure.

Sequences are sorted by length (longest first) so that each micro-batch holds similar lengths; a batch
grows while ``rows * longest <= max_padded_area``. A sequence longer than the area still gets a batch of
its own (it cannot be split without changing the loss).
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_micro_batches(lengths: Sequence[int], max_padded_area: int) -> list[list[int]]:
    """Group indices of ``lengths`` into micro-batches whose padded area stays within ``max_padded_area``."""
    if max_padded_area <= 0:
        raise ValueError(f"max_padded_area must be positive, got {max_padded_area}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = int(lengths[i])
        if n < 0:
            raise ValueError(f"negative length {n} at index {i}")
        new_longest = max(longest, n)
        if current and (len(current) + 1) * new_longest > max_padded_area:
            batches.append(current)
            current, new_longest = [], n
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def padding_efficiency(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Real tokens / padded tokens over all micro-batches (1.0 = no padding waste)."""
    real = sum(int(lengths[i]) for b in batches for i in b)
    padded = sum(len(b) * max((int(lengths[i]) for i in b), default=0) for b in batches)
    return real / padded if padded else 1.0
