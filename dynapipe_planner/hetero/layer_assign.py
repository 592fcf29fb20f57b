"""Layers to stages and micro-batches to pipelines (seed hexiscale.txt §4.3: "strategically
assigning transformer layers to balance computation across pipeline stages", §3.2: each
pipeline "can be assigned with a different batch size").

Layers: minimise the slowest stage's time per micro-batch (what 1F1B's steady state runs at,
App. A Eq. 9) subject to each stage's memory, by bisection on that time; then hand back the
layers the bisection over-assigned, from the slowest stages first.

Micro-batches: each pipeline's time is fill + (m - 1) x bottleneck (Eq. 9), increasing in m, so
giving every next micro-batch to the pipeline that would finish it earliest minimises the
slowest pipeline: the pipelines finish together as far as whole micro-batches allow.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .cost import HeteroCostModel


@dataclass(frozen=True)
class StageShape:
    """What layer assignment needs to know of a stage, per micro-batch."""

    devices: tuple[int, ...]
    per_layer_s: float
    fixed_s: float  # embedding / output layer and the stage's sends
    capacity: int  # most layers its memory holds


def stage_shapes(
    cost: HeteroCostModel,
    stages: list[tuple[int, ...]],
    num_pipelines: int,
    sharing: dict[int, float] | None = None,
) -> list[StageShape]:
    """Times and layer capacities of ordered stages. Capacity assumes 1F1B's worst case of
    `depth - j` micro-batches in flight at stage j. `sharing[machine]`: how many pipelines'
    transfers are expected to share that machine's network link (none: this one alone)."""
    depth = len(stages)
    out = []

    def hop(a: tuple[int, ...], b: tuple[int, ...]) -> float:
        pair = cost.leader_machines(a, b) if sharing else None
        flows = max(sharing.get(pair[0], 1.0), sharing.get(pair[1], 1.0)) if pair else 1.0
        return cost.hop_s(a, b, flows)

    for j, devs in enumerate(stages):
        first, last = j == 0, j == depth - 1
        sends = 0.0
        if not last:
            sends += hop(devs, stages[j + 1]) / 2
        if not first:
            sends += hop(stages[j - 1], devs) / 2
        per_layer_s, extra_s, capacity = cost.stage_terms(
            devs, first, last, depth - j, num_pipelines
        )
        out.append(StageShape(devs, per_layer_s, extra_s + sends, capacity))
    return out


def assign_layers(shapes: list[StageShape], num_layers: int) -> list[int] | None:
    """Layers per stage (each at least one) minimising the slowest stage; None if memory
    cannot hold the model on these stages."""
    if len(shapes) > num_layers or any(s.capacity < 1 for s in shapes):
        return None
    if sum(s.capacity for s in shapes) < num_layers:
        return None

    fixed = np.array([s.fixed_s for s in shapes])
    per_layer = np.array([s.per_layer_s for s in shapes])
    cap = np.array([s.capacity for s in shapes])

    def counts(limit: float) -> list[int]:
        n = np.floor((limit - fixed) / per_layer + 1e-9)
        return np.clip(n, 0, cap).astype(int).tolist()

    lo = max(s.fixed_s + s.per_layer_s for s in shapes)
    hi = max(s.fixed_s + s.per_layer_s * min(s.capacity, num_layers) for s in shapes)
    if sum(counts(lo)) < num_layers:
        for _ in range(60):
            mid = (lo + hi) / 2
            if sum(counts(mid)) >= num_layers:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-9 * hi:
                break
        n = counts(hi)
    else:
        n = counts(lo)
    n = [max(1, x) for x in n]
    while sum(n) > num_layers:
        j = max(
            (j for j in range(len(n)) if n[j] > 1),
            key=lambda j: (shapes[j].fixed_s + n[j] * shapes[j].per_layer_s, shapes[j].per_layer_s),
        )
        n[j] -= 1
    return n


def pipeline_profile(shapes: list[StageShape], layers: list[int]) -> tuple[float, float]:
    """(fill, bottleneck) of Eq. 9: time = fill + (m - 1) x bottleneck."""
    busy = [s.fixed_s + n * s.per_layer_s for s, n in zip(shapes, layers, strict=True)]
    return sum(busy), max(busy)


def assign_micro_batches(profiles: list[tuple[float, float]], total: int) -> list[int] | None:
    """Micro-batches per pipeline (each at least one) minimising the slowest pipeline."""
    k = len(profiles)
    if total < k:
        return None
    m = [1] * k
    heap = [(fill + bottleneck, i) for i, (fill, bottleneck) in enumerate(profiles)]
    heapq.heapify(heap)
    for _ in range(total - k):
        _, i = heapq.heappop(heap)
        m[i] += 1
        fill, bottleneck = profiles[i]
        heapq.heappush(heap, (fill + m[i] * bottleneck, i))
    return m
