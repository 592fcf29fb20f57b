"""Twin of `csrc/proposal_dp.cpp`: the tables of Hydraulis's strategy-proposal DP (seed
hydraulis.txt §7, Eq. 4) by array operations, as `dynapipe_planner.strategy.proposal` fills
them on the C++ core."""

from __future__ import annotations

import math

import numpy as np

from ..strategy.proposal import IntervalWork


def proposal_dp_tables_reference(
    iw: IntervalWork, units: int, step: float
) -> tuple[np.ndarray, np.ndarray]:
    """`proposal_dp`'s tables by array operations: t, shaped (units + 1, L + 1), and per state
    the choice (scheme, pipelines in steps, block start; -1 where t[n][l] = t[n - 1][l]). The
    best d of each block is found by bisection for every (start, l) at once: O(K (N / step)
    L^2 log(N / step)) array work; memory O(L^2) per scheme."""
    num_intervals, num_schemes = iw.work.shape
    feasible = np.isfinite(iw.work)
    prefix = np.vstack([np.zeros(num_schemes), np.cumsum(np.where(feasible, iw.work, 0.0), axis=0)])
    gpus = [p.scheme.num_gpus for p in iw.profiles]
    ells = np.arange(1, num_intervals + 1)
    starts = np.arange(num_intervals)
    below = starts[:, None] < ells[None, :]  # (start, l): a block (start, l] is non-empty
    blocks = [  # W_k(start, l] where scheme k holds interval l, else nan
        np.where(below & feasible[None, :, k], prefix[None, 1:, k] - prefix[:-1, None, k], np.nan)
        for k in range(num_schemes)
    ]
    t = np.full((units + 1, num_intervals + 1), math.inf)
    t[:, 0] = 0.0
    choice = np.full((units + 1, num_intervals + 1, 3), -1, dtype=np.int64)  # k, d, start
    columns = np.broadcast_to(starts[:, None], below.shape)
    for n in range(1, units + 1):
        best = np.full(below.shape, math.inf)
        best_k = np.full(below.shape, -1)
        best_d = np.zeros(below.shape, dtype=np.int64)
        for k in range(num_schemes):
            most = n // gpus[k]  # d in step units: 1..most
            if most == 0:
                continue
            rest = t[n - gpus[k] * np.arange(1, most + 1), :-1]  # row i: d = i + 1 units
            work = blocks[k]
            lo = np.zeros(below.shape, dtype=np.int64)
            hi = np.full(below.shape, most)
            while True:  # first d index whose leftover latency reaches W / d
                open_ = lo < hi
                if not open_.any():
                    break
                mid = np.minimum((lo + hi) // 2, most - 1)
                reached = rest[mid, columns] >= work / ((mid + 1) * step)
                hi = np.where(open_ & reached, mid, hi)
                lo = np.where(open_ & ~reached, mid + 1, lo)
            for i in (lo, lo - 1):  # the crossing and the step before it
                valid = (i >= 0) & (i < most)
                i = np.clip(i, 0, most - 1)
                value = np.maximum(rest[i, columns], work / ((i + 1) * step))
                better = valid & (value < best)  # nan (infeasible) is never better
                best = np.where(better, value, best)
                best_k = np.where(better, k, best_k)
                best_d = np.where(better, i + 1, best_d)
        start = np.argmin(best, axis=0)  # first start on ties
        value = best[start, ells - 1]
        take = value < t[n - 1, 1:]
        t[n, 1:] = np.where(take, value, t[n - 1, 1:])
        choice[n, 1:] = np.where(
            take[:, None],
            np.stack([best_k[start, ells - 1], best_d[start, ells - 1], start], axis=1),
            -1,
        )
    return t, choice
