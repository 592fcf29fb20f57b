"""Readable pure-Python twin of `csrc/microbatch_dp.cpp` (DynaPipe seed dynapipe.txt §4, Eq. 2;
ranges as packed rows for issue 21, see `dp.py`).

It exists for tests: the C++ core must return the same partition and objective, bit for bit,
so every arithmetic step here is in the same order as there. Too slow for production use.
"""

from __future__ import annotations

import itertools
import math
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
    work: int = 0  # ranges priced over all passes: the budget's unit
    row_lengths: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


class _Problem:
    def __init__(self, src, tgt, grids, time_table, mem_table, stage_time, coef):
        self.src = [int(x) for x in src]
        self.tgt = [int(x) for x in tgt] if len(tgt) == len(src) else [0] * len(src)
        self.grids = [list(map(float, g)) for g in grids]
        self.time, self.mem = time_table, mem_table
        self.pack = len(coef) > 0
        self.stage_time, self.coef = stage_time, [float(c) for c in coef]

    def range_cost(self, b: int, s: int, t: int) -> float:
        cells = [locate(g, float(x)) for g, x in zip(self.grids, (b, s, t), strict=True)]
        if any(c is None for c in cells):
            return math.inf
        if interp3(self.mem, *cells) > 1.0:
            return math.inf
        return interp3(self.time, *cells)


def _band(p: _Problem, j: int) -> tuple[list[float], list[int]]:
    """All feasible range costs ending at sample j, growing leftwards: padded, or packed rows
    with `p.pack` (`_packed_band`, which also gives each range's row length)."""
    if p.pack:
        return _packed_band(p, j)
    costs, smax, tmax = [], 0, 0
    for i in range(j, -1, -1):
        smax, tmax = max(smax, p.src[i]), max(tmax, p.tgt[i])
        c = p.range_cost(j - i + 1, smax, tmax)
        if math.isinf(c):
            break
        costs.append(c)
    return costs, []


class _Rows:
    """The C++ `Rows`: first-fit-decreasing rows of `length` tokens, grown with a range."""

    def __init__(self, p: _Problem, length: int, usable: bool):
        self.p, self.length, self.room = p, length, []
        self.cs = locate(p.grids[1], float(length))
        self.open = usable and self.cs is not None

    def cost(self, length: int, squares: int) -> float:
        """Price once a sample of `length` joins (`squares` counts it); inf once they stop
        fitting the grid or the memory."""
        if not self.open:
            return math.inf
        fits = [r for r, free in enumerate(self.room) if free >= length]
        if fits:
            self.room[fits[0]] -= length
        else:
            self.room.append(self.length - length)
        p, rows, ct = self.p, len(self.room), (0, 0.0)
        cr = locate(p.grids[0], float(rows))
        if cr is None or interp3(p.mem, cr, self.cs, ct) > 1.0:
            self.open = False
            return math.inf
        saved = float(rows * self.length * self.length - squares)
        worst = -math.inf
        for table, c in zip(p.stage_time, p.coef, strict=True):
            worst = max(worst, interp3(table, cr, self.cs, ct) - saved * c)
        return worst


def _packed_band(p: _Problem, j: int) -> tuple[list[float], list[int]]:
    """The C++ packed band: samples j, j-1, ... first-fit into rows of src[j] tokens and into
    rows of the batch's longest sample; each range at the cheaper (rows of src[j] on ties), never
    less than the range one shorter. Also each range's row length."""
    costs: list[float] = []
    row_lengths: list[int] = []
    longest = p.src[-1]
    own, full = _Rows(p, p.src[j], True), _Rows(p, longest, longest > p.src[j])
    squares = 0
    for i in range(j, -1, -1):
        squares += p.src[i] * p.src[i]
        a, b = own.cost(p.src[i], squares), full.cost(p.src[i], squares)
        if not own.open and not full.open:
            break
        cost = b if b < a else a
        costs.append(max(cost, costs[-1]) if costs else cost)
        row_lengths.append(longest if b < a else p.src[j])
    return costs, row_lengths


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


def _packed_lower_bound_total(p: _Problem) -> float:
    """The C++ `packed_lower_bound_total`: per stage, phi = the least per-token time beyond the
    attention over the grid corners a feasible range can interpolate from, and
    sum_i phi * l_i + coef * l_i^2; the largest over the stages."""
    nb, ns = len(p.grids[0]), len(p.grids[1])

    def fits(ib: int, js: int) -> bool:
        return ib >= 0 and js >= 0 and float(p.mem[ib, js, 0]) <= 1.0

    best = 0.0
    for table, c in zip(p.stage_time, p.coef, strict=True):
        phi = math.inf
        for ib in range(nb):
            for js in range(ns):
                v = float(table[ib, js, 0])
                used = fits(ib, js) or fits(ib - 1, js) or fits(ib, js - 1) or fits(ib - 1, js - 1)
                if not used or math.isinf(v):
                    continue
                b, s = p.grids[0][ib], p.grids[1][js]
                phi = min(phi, (v - b * s * s * c) / (b * s))
        if not phi >= 0.0 or math.isinf(phi):
            continue
        total = 0.0
        for length in p.src:
            ell = float(length)
            total += phi * ell + c * (ell * ell)
        best = max(best, total)
    return best


def _pass(bands: list[tuple[list[float], list[int]]], threshold: float):
    n = len(bands)
    f = [0.0] * (n + 1)
    take = [-1] * (n + 1)
    nxt = math.inf
    work = 0
    for j in range(n):
        best, best_k = math.inf, -1
        for k, c in enumerate(bands[j][0]):
            if c > threshold:
                nxt = min(nxt, c)
                break
            work += 1
            v = f[j - k] + c
            if v < best:
                best, best_k = v, k
        f[j + 1], take[j + 1] = best, best_k
    ends, row_lengths, max_cost, end = [], [], 0.0, n
    if not math.isinf(f[n]):
        while end > 0:
            ends.append(end)
            costs, lengths = bands[end - 1]
            max_cost = max(max_cost, costs[take[end]])
            if lengths:
                row_lengths.append(lengths[take[end]])
            end -= take[end] + 1
    return f[n], max_cost, nxt, ends[::-1], row_lengths[::-1], work


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
    work_budget: int,
    stage_time: np.ndarray,
    coef: np.ndarray,
) -> DPResult:
    """Same contract as `_core.microbatch_dp` (tables shaped (nb, ns, nt); `stage_time`
    (num_stages, nb, ns, nt) or empty when ranges are never packed)."""
    p = _Problem(src, tgt, (b_grid, s_grid, t_grid), time_table, mem_table, stage_time, coef)
    if p.pack and (len(t_grid) != 1 or any(a > b for a, b in itertools.pairwise(p.src))):
        raise ValueError("microbatch_dp: packing needs decoder-only grids and sorted samples")
    bands = [_band(p, j) for j in range(len(p.src))]
    for j, band in enumerate(bands):
        if not band[0]:
            return DPResult([], math.inf, 0.0, math.inf, 0, infeasible_position=j)
    bubble, replicas = float(num_stages - 1), float(num_replicas)
    threshold = max(band[0][0] for band in bands)
    bound = (_packed_lower_bound_total(p) if p.pack else _lower_bound_total(p)) / replicas
    width = max(bucket_abs, bucket_rel * (bubble * threshold + bound) / max(1.0, bubble))
    if num_stages == 1:
        threshold = math.inf
    objective, best, passes, work, exhausted = math.inf, None, 0, 0, False
    while True:
        total, max_cost, nxt, ends, row_lengths, pass_work = _pass(bands, threshold)
        passes += 1
        work += pass_work
        obj = bubble * max_cost + total / replicas
        if obj < objective:
            objective, best = obj, (ends, max_cost, total, row_lengths)
        if math.isinf(nxt) or bubble * nxt + bound >= objective:
            break
        if work_budget > 0 and work > work_budget:
            exhausted = True
            break
        threshold = max(nxt, threshold + width)
    ends, max_cost, total, row_lengths = best
    return DPResult(
        ends, objective, max_cost, total, passes, exhausted, row_lengths=row_lengths, work=work
    )


def microbatch_dp_kernel(*args) -> dict:
    """`microbatch_dp_reference` as the `kernel` of `dp.dynamic_microbatches` (the C++ core's
    result keys)."""
    return vars(microbatch_dp_reference(*args))
