"""Pipeline partitions for Galvatron-BMW (seed `galvatron_bmw.txt` §IV-B, Algorithm 2, App. B).

A partition is the number of layers of each stage. `balanced_partition` minimises the largest
stage cost exactly (memory-balanced p_m with the 1F1B memory of each stage, time-balanced p_t
with its time). `adjustment_moves` is one step of the
bi-objective adjustment: move a boundary layer off the slowest stage to a neighbour and keep
the result only if (1) no stage gets slower than the old slowest, (2) no stage exceeds the
memory budget and (3) no stage exceeds the peak memory of the time-balanced partition; App. B
shows such a move keeps alpha_t(p_m) <= alpha_t(p') and improves time balance. The stage costs
are callables of (stage, first layer, end layer): the optimizer passes ones that re-solve the
stage's layer DP for that range (Algorithm 2), so a move is judged with the strategies the
receiving stage would pick, not the ones its layers had.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import PlanningError

# stage index, first layer, end layer (exclusive) -> cost
StageCost = Callable[[int, int, int], float]


def _bounds(partition: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in partition:
        out.append((start, start + n))
        start += n
    return out


def balanced_partition(num_layers: int, num_stages: int, cost: StageCost) -> list[int]:
    """Contiguous partition minimising max over stages of `cost` (each stage >= 1 layer).

    A DP over stage ends: best[e] is the least max cost of the stages so far covering layers
    [0, e). `cost(stage, starts, ends)` is called with numpy arrays (starts as a column, ends
    as a row) and must broadcast (prefix sums do, see `prefix_cost`). Exact for any stage
    cost, including the 1F1B memory of a stage, which depends on the stage's index as well
    as its layers. Ties go to the earliest start.
    """
    L, P = num_layers, num_stages
    if not 1 <= P <= L:
        raise PlanningError(f"cannot split {L} layers into {P} stages")
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    starts = np.zeros((P, L + 1), dtype=np.int64)
    for stage in range(P):
        last_end = L - (P - stage - 1)
        a = np.arange(stage, last_end)[:, None]  # this stage's first layer
        e = np.array([L]) if stage == P - 1 else np.arange(stage + 1, last_end + 1)
        e = e[None, :]
        values = np.maximum(best[a], np.asarray(cost(stage, a, e), dtype=np.float64))
        values = np.where(e > a, values, np.inf)  # at least one layer
        arg = values.argmin(axis=0)
        nxt = np.full(L + 1, np.inf)
        nxt[e[0]] = values[arg, np.arange(e.shape[1])]
        starts[stage, e[0]] = a[arg, 0]
        best = nxt
    partition, end = [], L
    for stage in range(P - 1, -1, -1):
        first = int(starts[stage, end])
        partition.append(end - first)
        end = first
    return partition[::-1]


def prefix_cost(
    per_layer: Sequence[float], per_stage_scale: Sequence[float], constant: Sequence[float] = ()
) -> StageCost:
    """cost(stage, a, b) = scale[stage] * sum(per_layer[a:b]) + sum(constant[a:b]); a and b
    may be integers or broadcasting numpy arrays (the 1F1B memory of a stage, or a stage's
    time when scale is all ones)."""
    scaled = np.concatenate([[0.0], np.cumsum(np.asarray(per_layer, dtype=np.float64))])
    fixed = np.zeros_like(scaled)
    if len(constant):
        fixed[1:] = np.cumsum(np.asarray(constant, dtype=np.float64))
    scale = list(per_stage_scale)

    def cost(stage: int, a: int, b):
        return scale[stage] * (scaled[b] - scaled[a]) + (fixed[b] - fixed[a])

    return cost


def max_stage(partition: Sequence[int], cost: StageCost) -> float:
    return max(cost(i, a, b) for i, (a, b) in enumerate(_bounds(partition)))


def adjustment_moves(
    partition: Sequence[int],
    stage_time: StageCost,
    stage_memory: StageCost,
    memory_budget: float,
    memory_cap: float,
) -> list[list[int]]:
    """Valid partitions one boundary-layer move away from `partition`, fastest first."""
    bounds = _bounds(partition)
    times = [stage_time(i, a, b) for i, (a, b) in enumerate(bounds)]
    slowest = max(range(len(times)), key=lambda i: times[i])
    c_max = times[slowest]
    if partition[slowest] < 2:
        return []
    moves = []
    for neighbour in (slowest - 1, slowest + 1):
        if not 0 <= neighbour < len(partition):
            continue
        p = list(partition)
        p[slowest] -= 1
        p[neighbour] += 1
        new_bounds = _bounds(p)
        new_times = [stage_time(i, a, b) for i, (a, b) in enumerate(new_bounds)]
        if max(new_times) > c_max:  # rule 1
            continue
        memory = [stage_memory(i, a, b) for i, (a, b) in enumerate(new_bounds)]
        if max(memory) > memory_budget or max(memory) > memory_cap:  # rules 2 and 3
            continue
        moves.append((max(new_times), p))
    moves.sort(key=lambda t: t[0])
    return [p for _, p in moves]
