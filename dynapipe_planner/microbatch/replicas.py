"""Spread micro-batches over data-parallel replicas (DynaPipe seed dynapipe.txt §4, "Balance
data parallel model replicas"): balance each replica's total time with the Karmarkar-Karp
largest-differencing method for k-way number partitioning.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np


def karmarkar_karp(times: np.ndarray, num_parts: int) -> list[list[int]]:
    """Indices of `times` split into `num_parts` lists with nearly equal sums.

    Each item starts as a k-tuple of subsets (itself in one, the others empty). The two tuples
    whose spread (max sum - min sum) is largest are merged, the heaviest subset of one joined
    with the lightest of the other, until one tuple is left. Lists come back in index order.
    """
    if num_parts == 1:
        return [list(range(len(times)))]
    counter = itertools.count()
    heap = []
    for i, t in enumerate(times):
        parts = [(float(t), [i])] + [(0.0, []) for _ in range(num_parts - 1)]
        heapq.heappush(heap, (-float(t), next(counter), parts))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda p: p[0], reverse=True)
        b.sort(key=lambda p: p[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b, strict=True)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), next(counter), merged))
    parts = heap[0][2] if heap else [(0.0, []) for _ in range(num_parts)]
    parts.sort(key=lambda p: (-p[0], p[1][:1]))
    return [sorted(ids) for _, ids in parts]
