"""Twin of `csrc/layer_dp.cpp`: the layer DP of Galvatron-BMW (seed `galvatron_bmw.txt` §IV-A2,
Eq. 4, App. A, Algorithm 3), as `dynapipe_planner.search.layer_dp` runs it on the C++ core."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..search.estimator import StageTables, stage_fwd_bytes
from ..search.layer_dp import (
    INF,
    TIE_REL,
    StagePlan,
    _budget_bins,
    _peak,
    _unchecked_bins,
    memory_weights,
)

Matrix = Sequence[Sequence[float]]


def _row_classes(rows) -> list[list[int]]:
    """Previous strategies with identical transformation rows R(l, p, .), lowest member first."""
    classes: list[list[int]] = []
    for p, row in enumerate(rows):
        for members in classes:
            if list(rows[members[0]]) == list(row):
                members.append(p)
                break
        else:
            classes.append([p])
    return classes


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
        tr = transform[layer]
        classes = _row_classes(tr)
        # least C(l - 1, e, p) of each class, lowest index among equal values
        gmin, garg = [], []
        for e in range(budget + 1):
            mins, args = [], []
            for members in classes:
                value, arg = INF, -1
                for p in members:
                    if best[e][p] < value:
                        value, arg = best[e][p], p
                mins.append(value)
                args.append(arg)
            gmin.append(mins)
            garg.append(args)
        cur = [[INF] * strategies for _ in range(budget + 1)]
        ptr = [[-1] * strategies for _ in range(budget + 1)]
        for e in range(budget + 1):
            for s in range(strategies):
                w = weight[layer][s]
                if not objective[layer][s] < INF or w > e:
                    continue
                src = e - w
                value, arg = INF, -1
                for g, members in enumerate(classes):
                    v = gmin[src][g] + tr[members[0]][s]
                    if v < value:
                        value, arg = v, garg[src][g]
                if arg < 0:
                    continue
                if arg != s:
                    own = best[src][s] + tr[s][s]
                    if own < INF and own - value <= TIE_REL * abs(value):
                        value, arg = own, s
                cur[e][s] = value + objective[layer][s]
                ptr[e][s] = arg
        best = cur
        back.append(ptr)
    return best, back


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


def solve_stage_reference(
    tables: StageTables, memory_budget: float, granularity: float
) -> StagePlan | None:
    """`layer_dp.solve_stage` with the DP run by `layer_dp_reference` (plain Python)."""
    limit = memory_budget - tables.extra_bytes
    if limit < 0:
        return None
    layers = len(tables.objective)
    budget = _budget_bins(limit, memory_budget, granularity)
    weight = memory_weights(tables, granularity)
    finite = np.isfinite(tables.objective)
    b_up = float(np.max(np.where(finite, tables.bwd_bytes, 0.0)))
    unchecked = _unchecked_bins(limit, b_up, layers, granularity)
    objective = np.where(finite, tables.objective, INF)
    fwd_bytes = stage_fwd_bytes(tables)
    cost, chosen, e = layer_dp_reference(
        objective.tolist(),
        weight.tolist(),
        tables.transform.tolist(),
        fwd_bytes.tolist(),
        tables.bwd_bytes.tolist(),
        tables.state_bytes.tolist(),
        budget,
        limit,
        unchecked,
    )
    if not chosen or not cost < INF:
        return None
    peak = _peak(fwd_bytes, tables.bwd_bytes, tables.state_bytes, chosen)
    return StagePlan(cost, list(chosen), e, peak + tables.extra_bytes)
