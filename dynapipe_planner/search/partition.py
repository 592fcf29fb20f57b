"""Pipeline partitions for Galvatron-BMW (seed `galvatron_bmw.txt` §IV-B, Algorithm 2, App. B).

A partition is the number of layers of each stage. `balanced_partition` minimises the largest
stage cost for any per-stage cost that grows with the stage's layers (memory-balanced p_m with
a memory cost, time-balanced p_t with a time cost). `adjustment_moves` is one step of the
bi-objective adjustment: move a boundary layer off the slowest stage to a neighbour and keep
the result only if (1) no stage gets slower than the old slowest, (2) no stage exceeds the
memory budget and (3) no stage exceeds the peak memory of the time-balanced partition; App. B
shows such a move keeps alpha_t(p_m) <= alpha_t(p') and improves time balance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import PlanningError

# stage index, first layer, end layer (exclusive) -> cost
StageCost = Callable[[int, int, int], float]


def _bounds(partition: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in partition:
        out.append((start, start + n))
        start += n
    return out


def _greedy(num_layers: int, num_stages: int, cost: StageCost, limit: float) -> list[int] | None:
    """Fill each stage with as many layers as fit under `limit` (leaving one per later stage)."""
    partition, start = [], 0
    for stage in range(num_stages):
        last_allowed = num_layers - (num_stages - stage - 1)
        if stage == num_stages - 1:
            end = num_layers
            if cost(stage, start, end) > limit:
                return None
        else:
            end = start + 1
            if cost(stage, start, end) > limit:
                return None
            while end < last_allowed and cost(stage, start, end + 1) <= limit:
                end += 1
        partition.append(end - start)
        start = end
    return partition


def balanced_partition(num_layers: int, num_stages: int, cost: StageCost) -> list[int]:
    """Contiguous partition minimising max over stages of `cost` (each stage >= 1 layer).

    Greedy filling is optimal for a given limit when a stage's cost only grows with its
    layers, so a bisection over the limit finds the min-max partition (to float precision).
    """
    if not 1 <= num_stages <= num_layers:
        raise PlanningError(f"cannot split {num_layers} layers into {num_stages} stages")
    even = [num_layers // num_stages + (i < num_layers % num_stages) for i in range(num_stages)]
    hi = max(cost(i, a, b) for i, (a, b) in enumerate(_bounds(even)))
    lo = 0.0
    best = even
    for _ in range(60):
        mid = (lo + hi) / 2
        found = _greedy(num_layers, num_stages, cost, mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
    return best


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
