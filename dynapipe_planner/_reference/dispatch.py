"""Twin of `csrc/dispatch.cpp`: Hydraulis's randomised greedy dispatch of sequences across
pipelines (seed hydraulis.txt §6.2, Eq. 2-3, Appendix D.2 Alg. 1)."""

from __future__ import annotations

import math

import numpy as np

from ..strategy.dispatch import Dispatch, _costs, _orders, _pipelines
from ..strategy.proposal import Strategy
from ..strategy.schemes import SchemeProfile


def dispatch_reference(
    lengths: np.ndarray,
    strategy: Strategy,
    profiles: list[SchemeProfile],
    *,
    trials: int = 100,
    seed: int = 0,
    pricing: str = "full",
) -> Dispatch:
    """Alg. 1 in plain Python, step for step what the C++ core does."""
    pipelines = _pipelines(strategy, profiles)
    cost, column = _costs(lengths, pipelines, pricing)
    best = None
    for order in _orders(len(cost), trials, seed):
        work = [0.0] * len(pipelines)
        longest = [0.0] * len(pipelines)
        assignment = np.full(len(cost), -1, dtype=np.int64)
        for i in order:
            bounds = []
            for j, p in enumerate(pipelines):
                t = cost[i, column[j]]
                if math.isfinite(t):
                    bounds.append((work[j] + t + (p.scheme.pp - 1) * max(longest[j], t), j))
            _, j = min(bounds)  # smallest bound, first pipeline on ties
            t = cost[i, column[j]]
            work[j] += t
            longest[j] = max(longest[j], t)
            assignment[i] = j
        objective = max(
            w + (p.scheme.pp - 1) * m for w, m, p in zip(work, longest, pipelines, strict=True)
        )
        if best is None or objective < best[1]:
            best = (assignment, objective)
    return Dispatch(tuple(p.scheme for p in pipelines), best[0], best[1])
