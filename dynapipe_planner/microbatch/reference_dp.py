"""Readable pure-Python twin of `csrc/microbatch_dp.cpp` (DynaPipe seed dynapipe.txt §4, Eq. 2).

It exists for tests: the C++ core must return the same partition and objective, bit for bit,
so every arithmetic step here is in the same order as there. Too slow for production use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..cost.table import interp3, locate


@dataclass
class DPResult:
    """What the DP returns (same keys as the C++ dict)."""

    ends: list[int]
    objective: float
    max_time: float
    sum_time: float
    passes: int
    budget_exhausted: bool = False
    infeasible_position: int = -1
    extra: dict = field(default_factory=dict)


class _Problem:
    def __init__(self, src, tgt, grids, time_table, mem_table):
        self.src = [int(x) for x in src]
        self.tgt = [int(x) for x in tgt] if len(tgt) == len(src) else [0] * len(src)
        self.grids = [list(map(float, g)) for g in grids]
        self.time, self.mem = time_table, mem_table

    def range_cost(self, b: int, s: int, t: int) -> float:
        cells = [locate(g, float(x)) for g, x in zip(self.grids, (b, s, t), strict=True)]
        if any(c is None for c in cells):
            return math.inf
        if interp3(self.mem, *cells) > 1.0:
            return math.inf
        return interp3(self.time, *cells)


def _band(p: _Problem, j: int) -> list[float]:
    """All feasible range costs ending at sample j, growing leftwards."""
    costs, smax, tmax = [], 0, 0
    for i in range(j, -1, -1):
        smax, tmax = max(smax, p.src[i]), max(tmax, p.tgt[i])
        c = p.range_cost(j - i + 1, smax, tmax)
        if math.isinf(c):
            break
        costs.append(c)
    return costs


def _lower_bound_total(p: _Problem) -> float:
    bmax_grid = int(p.grids[0][-1])
    total, share, last = 0.0, 0.0, None
    for s, t in zip(p.src, p.tgt, strict=True):
        if (s, t) != last:
            last = (s, t)
            lo, hi = 1, min(len(p.src), bmax_grid)
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                if math.isinf(p.range_cost(mid, s, t)):
                    hi = mid - 1
                else:
                    lo = mid
            share = p.range_cost(lo, s, t) / float(lo)
            for gb in p.grids[0]:
                b = int(gb)
                if b > lo:
                    break
                share = min(share, p.range_cost(b, s, t) / float(b))
        total += share
    return total


def _pass(bands: list[list[float]], threshold: float):
    n = len(bands)
    f = [0.0] * (n + 1)
    take = [-1] * (n + 1)
    nxt = math.inf
    for j in range(n):
        best, best_k = math.inf, -1
        for k, c in enumerate(bands[j]):
            if c > threshold:
                nxt = min(nxt, c)
                break
            v = f[j - k] + c
            if v < best:
                best, best_k = v, k
        f[j + 1], take[j + 1] = best, best_k
    ends, max_cost, end = [], 0.0, n
    if not math.isinf(f[n]):
        while end > 0:
            ends.append(end)
            max_cost = max(max_cost, bands[end - 1][take[end]])
            end -= take[end] + 1
    return f[n], max_cost, nxt, ends[::-1]


def microbatch_dp_reference(
    src: np.ndarray,
    tgt: np.ndarray,
    b_grid: np.ndarray,
    s_grid: np.ndarray,
    t_grid: np.ndarray,
    time_table: np.ndarray,
    mem_table: np.ndarray,
    num_stages: int,
    num_replicas: int,
    bucket_abs: float,
    bucket_rel: float,
    time_budget_s: float,
) -> DPResult:
    """Same contract as `_core.microbatch_dp` (tables shaped (nb, ns, nt))."""
    start = time.perf_counter()
    p = _Problem(src, tgt, (b_grid, s_grid, t_grid), time_table, mem_table)
    bands = [_band(p, j) for j in range(len(p.src))]
    for j, band in enumerate(bands):
        if not band:
            return DPResult([], math.inf, 0.0, math.inf, 0, infeasible_position=j)
    bubble, replicas = float(num_stages - 1), float(num_replicas)
    threshold = max(band[0] for band in bands)
    bound = _lower_bound_total(p) / replicas
    width = max(bucket_abs, bucket_rel * (bubble * threshold + bound) / max(1.0, bubble))
    if num_stages == 1:
        threshold = math.inf
    objective, best, passes, exhausted = math.inf, None, 0, False
    while True:
        total, max_cost, nxt, ends = _pass(bands, threshold)
        passes += 1
        obj = bubble * max_cost + total / replicas
        if obj < objective:
            objective, best = obj, (ends, max_cost, total)
        if math.isinf(nxt) or bubble * nxt + bound >= objective:
            break
        if time_budget_s > 0 and time.perf_counter() - start > time_budget_s:
            exhausted = True
            break
        threshold = max(nxt, threshold + width)
    ends, max_cost, total = best
    return DPResult(ends, objective, max_cost, total, passes, exhausted)
