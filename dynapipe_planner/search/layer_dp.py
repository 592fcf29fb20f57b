"""Layer DP of Galvatron-BMW (seed `galvatron_bmw.txt` §IV-A2, Eq. 4, App. A, Algorithm 3).

C(l, E_fwd) is the least time of the first l layers of a stage whose forward memory
(activations kept for backward, times micro-batches in flight, plus model states) fits in
E_fwd, with the transformation cost R between neighbouring layers' strategies; because R
depends on the previous layer's strategy, the state also carries it (|S|^2 per layer and
budget step). Memory is discretised into bins (weights rounded up, so a plan's real forward
memory never exceeds its bins). Algorithm 3 then takes the largest E_fwd whose plan also passes
the backward-peak check of Eq. 2; plans with E_fwd <= E - b_up pass by construction.

`layer_dp_reference` is the plain-Python statement of that algorithm; the C++ core
(`csrc/layer_dp.cpp`) does the same arithmetic in the same order and breaks ties the same way
(lowest strategy index), and the tests hold them to identical answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import _core
from .estimator import StageTables

INF = float("inf")


@dataclass(frozen=True)
class StagePlan:
    """The layer DP's answer for one stage: strategy index per layer, its objective, the
    forward budget (bins) it was found at and its Eq. 2 peak memory."""

    objective: float
    chosen: list[int]
    forward_bins: int
    peak_bytes: float


def _run_reference(objective, weight, transform, budget):
    layers, strategies = len(objective), len(objective[0])
    best = [
        [
            objective[0][s] if objective[0][s] < INF and weight[0][s] <= e else INF
            for s in range(strategies)
        ]
        for e in range(budget + 1)
    ]
    back = [None]
    for layer in range(1, layers):
        cur = [[INF] * strategies for _ in range(budget + 1)]
        ptr = [[-1] * strategies for _ in range(budget + 1)]
        for e in range(budget + 1):
            for s in range(strategies):
                w = weight[layer][s]
                if not objective[layer][s] < INF or w > e:
                    continue
                prev = best[e - w]
                value, arg = INF, -1
                for p in range(strategies):
                    v = prev[p] + transform[layer][p][s]
                    if v < value:
                        value, arg = v, p
                if arg >= 0:
                    cur[e][s] = value + objective[layer][s]
                    ptr[e][s] = arg
        best = cur
        back.append(ptr)
    return best, back


Matrix = Sequence[Sequence[float]]


def layer_dp_table_reference(
    objective: Matrix, weight: Matrix, transform: Sequence[Matrix], budget: int
) -> list[float]:
    """min over strategies of C(L, e) for e = 0..budget (plain Python)."""
    best, _ = _run_reference(objective, weight, transform, budget)
    return [min(row) for row in best]


def layer_dp_reference(
    objective: Matrix,
    weight: Matrix,
    transform: Sequence[Matrix],
    fwd: Matrix,
    bwd: Matrix,
    states: Matrix,
    budget: int,
    memory_limit: float,
    unchecked: int,
) -> tuple[float, list[int], int]:
    """Algorithm 3 in plain Python: (objective, strategy per layer, forward budget in bins)."""
    if budget < 0:
        return INF, [], -1
    best, back = _run_reference(objective, weight, transform, budget)
    layers = len(objective)
    for e_top in range(budget, -1, -1):
        row = best[e_top]
        cost, s = INF, -1
        for j, v in enumerate(row):
            if v < cost:
                cost, s = v, j
        if s < 0:
            break
        chosen = [0] * layers
        e = e_top
        for layer in range(layers - 1, -1, -1):
            chosen[layer] = s
            if layer == 0:
                break
            prev = back[layer][e][s]
            e -= weight[layer][s]
            s = prev
        if e_top <= unchecked or _peak(fwd, bwd, states, chosen) <= memory_limit:
            return cost, chosen, e_top
    return INF, [], -1


def _peak(fwd, bwd, states, chosen) -> float:
    running = peak = total = 0.0
    for layer, j in enumerate(chosen):
        running += fwd[layer][j]
        here = running + bwd[layer][j]
        if here > peak:
            peak = here
        total += states[layer][j]
    return peak + total


def memory_weights(tables: StageTables, granularity: float) -> np.ndarray:
    """Forward memory of each (layer, strategy) in bins, rounded up."""
    raw = np.ceil((tables.fwd_bytes + tables.state_bytes) / granularity)
    return np.where(np.isfinite(tables.objective), raw, 0).astype(np.int64)


def solve_stage(
    tables: StageTables, memory_budget: float, granularity: float, *, reference: bool = False
) -> StagePlan | None:
    """Best strategies of one stage's layers within `memory_budget` bytes (None: nothing fits)."""
    limit = memory_budget - tables.extra_bytes
    if limit < 0:
        return None
    budget = math.floor(limit / granularity)
    weight = memory_weights(tables, granularity)
    finite = np.isfinite(tables.objective)
    b_up = float(np.max(np.where(finite, tables.bwd_bytes, 0.0)))
    unchecked = math.floor((limit - b_up) / granularity) if limit >= b_up else -1
    objective = np.where(finite, tables.objective, INF)
    if reference:
        cost, chosen, e = layer_dp_reference(
            objective.tolist(),
            weight.tolist(),
            tables.transform.tolist(),
            tables.fwd_bytes.tolist(),
            tables.bwd_bytes.tolist(),
            tables.state_bytes.tolist(),
            budget,
            limit,
            unchecked,
        )
    else:
        cost, chosen, e = _core.layer_dp_search(
            objective,
            weight,
            tables.transform,
            tables.fwd_bytes,
            tables.bwd_bytes,
            tables.state_bytes,
            budget,
            limit,
            unchecked,
        )
    if not chosen or not cost < INF:
        return None
    peak = _peak(tables.fwd_bytes, tables.bwd_bytes, tables.state_bytes, chosen)
    return StagePlan(cost, list(chosen), e, peak + tables.extra_bytes)
