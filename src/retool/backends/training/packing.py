"""Dynamic micro-batch packing by padded area (rows x longest row), and the padding-waste figure.

Sequences are sorted by length (longest first) so that each micro-batch holds similar lengths, and cut
into the fewest micro-batches with ``rows * longest <= max_padded_area``, choosing the cut points that
waste the least padding. A sequence longer than the area still gets a batch of its own (it cannot be
split without changing the loss).
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_micro_batches(lengths: Sequence[int], max_padded_area: int) -> list[list[int]]:
    """Group indices of ``lengths`` into micro-batches whose padded area stays within ``max_padded_area``.

    Sequences are sorted longest first and cut into contiguous groups. Among the partitions with the
    fewest micro-batches (what greedy filling achieves), a dynamic programme picks the one with the least
    padded area, so a long sequence does not drag a crowd of short ones up to its length.
    """
    if max_padded_area <= 0:
        raise ValueError(f"max_padded_area must be positive, got {max_padded_area}")
    for i, n in enumerate(lengths):
        if int(n) < 0:
            raise ValueError(f"negative length {n} at index {i}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    sizes = [int(lengths[i]) for i in order]
    n = len(sizes)
    # best[i] = (batches, padded area, end of the first group) for the suffix starting at i
    best: list[tuple[int, int, int]] = [(0, 0, n)] * (n + 1)
    for i in range(n - 1, -1, -1):
        longest = max(sizes[i], 1)
        rows_cap = max(1, max_padded_area // longest)
        choice: tuple[int, int, int] | None = None
        for j in range(i + 1, min(n, i + rows_cap) + 1):
            count, area, _ = best[j]
            cand = (count + 1, area + (j - i) * sizes[i], j)
            if choice is None or cand[:2] < choice[:2]:
                choice = cand
        assert choice is not None
        best[i] = choice
    batches: list[list[int]] = []
    i = 0
    while i < n:
        j = best[i][2]
        batches.append(order[i:j])
        i = j
    return batches


def padding_efficiency(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Real tokens / padded tokens over all micro-batches (1.0 = no padding waste)."""
    real = sum(int(lengths[i]) for b in batches for i in b)
    padded = sum(len(b) * max((int(lengths[i]) for i in b), default=0) for b in batches)
    return real / padded if padded else 1.0
