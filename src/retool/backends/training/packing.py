"""Dynamic micro-batch packing by padded area (rows x longest row), the padding-waste figure, and how a
batch is dealt out to data-parallel processes.

Sequences are sorted by length (longest first) so that each micro-batch holds similar lengths, and cut
into the fewest micro-batches with ``rows * longest <= max_padded_area``, choosing the cut points that
waste the least padding. With a ``batch_cost`` (the fixed cost of one micro-batch's forward and
backward, in padded tokens) the cuts minimise padded area plus that cost per micro-batch instead: more,
tighter micro-batches where padding costs more than a micro-batch. A sequence longer than the area still
gets a batch of its own (it cannot be split without changing the loss).
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_micro_batches(
    lengths: Sequence[int], max_padded_area: int, batch_cost: int | None = None
) -> list[list[int]]:
    """Group indices of ``lengths`` into micro-batches whose padded area stays within ``max_padded_area``.

    Sequences are sorted longest first and cut into contiguous groups. Without ``batch_cost``: among the
    partitions with the fewest micro-batches (what greedy filling achieves), a dynamic programme picks the
    one with the least padded area, so a long sequence does not drag a crowd of short ones up to its
    length. With it: the partition of least ``padded area + batch_cost * micro-batches``.
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
            if choice is None or _better(cand, choice, batch_cost):
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


def _better(a: tuple[int, int, int], b: tuple[int, int, int], batch_cost: int | None) -> bool:
    if batch_cost is None:
        return a[:2] < b[:2]
    return a[1] + batch_cost * a[0] < b[1] + batch_cost * b[0]


def padding_efficiency(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Real tokens / padded tokens over all micro-batches (1.0 = no padding waste)."""
    real = sum(int(lengths[i]) for b in batches for i in b)
    padded = sum(len(b) * max((int(lengths[i]) for i in b), default=0) for b in batches)
    return real / padded if padded else 1.0


def padded_cost(lengths: Sequence[int], max_padded_area: int, batch_cost: int = 0) -> int:
    """The cost of running ``lengths`` in micro-batches packed by ``pack_micro_batches`` with
    ``batch_cost``: their padded area plus ``batch_cost`` per micro-batch."""
    if not lengths:
        return 0
    batches = pack_micro_batches(lengths, max_padded_area, batch_cost or None)
    area = sum(len(b) * max(int(lengths[i]) for i in b) for b in batches)
    return area + batch_cost * len(batches)


def split_for_workers(
    lengths: Sequence[int], workers: int, max_padded_area: int, batch_cost: int = 0, share_cost: int = 0
) -> list[list[int]]:
    """Indices of ``lengths`` dealt to ``workers`` processes that each run their share in micro-batches
    (``pack_micro_batches`` with ``batch_cost``), so that the slowest share costs the least.

    Shares are contiguous runs of the sequences sorted longest first: each holds similar lengths, so its
    micro-batches waste little padding. Every share but the last costs ``share_cost`` more (handing a
    share to another process and taking its result back). The cut after share ``k`` minimises the larger
    of that share's cost and the average cost of the shares after it (exact for two workers). A share
    may be empty.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))

    def cost(run: Sequence[int]) -> int:
        return padded_cost([lengths[i] for i in run], max_padded_area, batch_cost)

    shares: list[list[int]] = []
    rest = order
    for left in range(workers, 1, -1):

        def slowest(cut: int, left: int = left, rest: list[int] = rest) -> float:
            after = (cost(rest[cut:]) + share_cost * (left - 2)) / (left - 1)
            return max(cost(rest[:cut]) + share_cost, after)

        best = min(range(len(rest) + 1), key=lambda cut: (slowest(cut), -cut))
        shares.append(list(rest[:best]))
        rest = rest[best:]
    shares.append(list(rest))
    return shares
