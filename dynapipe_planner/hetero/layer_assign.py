"""Layers to stages and micro-batches to pipelines (seed hexiscale.txt §4.3: "strategically
assigning transformer layers to balance computation across pipeline stages", §3.2: each
pipeline "can be assigned with a different batch size").

Layers: minimise the slowest stage's time per micro-batch (what 1F1B's steady state runs at,
App. A Eq. 9) subject to each stage's memory, by bisection on that time; then hand back the
layers the bisection over-assigned, from the slowest stages first. A stage that may choose its
recomputation mode (`TrainingJob(recompute="auto")`) runs the fastest one that holds its layers.

Micro-batches: each pipeline's time is fill + (m - 1) x bottleneck (Eq. 9), increasing in m, so
giving every next micro-batch to the pipeline that would finish it earliest minimises the
slowest pipeline: the pipelines finish together as far as whole micro-batches allow.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from .cost import HeteroCostModel, StageOption, fastest_holding


@dataclass(frozen=True)
class StageShape:
    """What layer assignment needs to know of a stage, per micro-batch: its options, one per
    recomputation mode it may run (`fixed_s` includes the stage's sends)."""

    devices: tuple[int, ...]
    options: tuple[StageOption, ...]

    @classmethod
    def sending(
        cls, devices: tuple[int, ...], options: tuple[StageOption, ...], sends_s: float
    ) -> StageShape:
        """The stage's options (`HeteroCostModel.stage_options`) plus its sends per
        micro-batch, which no mode changes."""
        return cls(devices, tuple(replace(o, fixed_s=o.fixed_s + sends_s) for o in options))

    @property
    def capacity(self) -> int:
        """Most layers memory holds under any mode."""
        return max(o.capacity for o in self.options)

    def time_s(self, layers: int) -> float:
        """Busy time with `layers` layers in the fastest mode that holds them."""
        o = fastest_holding(self.options, layers)
        return o.fixed_s + layers * o.per_layer_s if o.capacity >= layers else math.inf


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
        options = cost.stage_options(devs, first, last, depth - j, num_pipelines)
        out.append(StageShape.sending(devs, options, sends))
    return out


def assign_layers(shapes: list[StageShape], num_layers: int) -> list[int] | None:
    """Layers per stage (each at least one) minimising the slowest stage, each stage in its
    fastest mode that holds its layers; None if memory cannot hold the model on these stages.

    Exact: a stage's most layers within a time limit is the best over its modes, so the
    smallest limit under which the stages hold `num_layers` is found by bisection; handing
    back layers never slows a stage (its time is monotone in its layers)."""
    if len(shapes) > num_layers or any(s.capacity < 1 for s in shapes):
        return None
    if sum(s.capacity for s in shapes) < num_layers:
        return None

    k = max(len(s.options) for s in shapes)
    fixed = np.full((k, len(shapes)), np.inf)
    per_layer = np.ones((k, len(shapes)))
    cap = np.zeros((k, len(shapes)), dtype=int)
    for j, s in enumerate(shapes):
        for i, o in enumerate(s.options):
            fixed[i, j], per_layer[i, j], cap[i, j] = o.fixed_s, o.per_layer_s, o.capacity

    def counts(limit: float) -> list[int]:
        n = np.floor((limit - fixed) / per_layer + 1e-9)
        return np.clip(n, 0, cap).max(axis=0).astype(int).tolist()

    lo = max(s.time_s(1) for s in shapes)
    hi = max(s.time_s(min(s.capacity, num_layers)) for s in shapes)
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
            key=lambda j: (
                shapes[j].time_s(n[j]),
                fastest_holding(shapes[j].options, n[j]).per_layer_s,
            ),
        )
        n[j] -= 1
    return n


def pipeline_profile(shapes: list[StageShape], layers: list[int]) -> tuple[float, float]:
    """(fill, bottleneck) of Eq. 9: time = fill + (m - 1) x bottleneck."""
    busy = [s.time_s(n) for s, n in zip(shapes, layers, strict=True)]
    return sum(busy), max(busy)


def assign_micro_batches(profiles: list[tuple[float, float]], total: int) -> list[int] | None:
    """Micro-batches per pipeline (each at least one) minimising the slowest pipeline.

    Each further micro-batch goes to the pipeline that finishes first (ties to the lower
    index). The greedy steps below a threshold are taken at once, so a global batch of 10**15
    micro-batches costs as little as one of ten (a step at a time, it never ended)."""
    k = len(profiles)
    if total < k:
        return None
    m = [1] * k
    steps = total - k
    if steps > 4 * k and all(b > 0 and math.isfinite(b) for _, b in profiles):
        lo = min(f + b for f, b in profiles)  # nothing lies below it
        hi = max(f + b for f, b in profiles) + steps * max(b for _, b in profiles)
        for _ in range(200):  # the largest threshold whose steps below it do not overshoot
            mid = lo + (hi - lo) / 2
            if mid in (lo, hi):
                break
            if sum(_steps_below(f, b, mid) for f, b in profiles) <= steps:
                lo = mid
            else:
                hi = mid
        taken = [_steps_below(f, b, lo) for f, b in profiles]
        m = [1 + c for c in taken]
        steps -= sum(taken)
    heap = [(fill + m[i] * bottleneck, i) for i, (fill, bottleneck) in enumerate(profiles)]
    heapq.heapify(heap)
    for _ in range(steps):
        _, i = heapq.heappop(heap)
        m[i] += 1
        fill, bottleneck = profiles[i]
        heapq.heappush(heap, (fill + m[i] * bottleneck, i))
    return m


def _steps_below(fill: float, bottleneck: float, limit: float) -> int:
    """How many of fill + n * bottleneck (n = 1, 2, ...; as the greedy loop rounds them) lie
    below `limit`."""
    n = max(0, math.floor((limit - fill) / bottleneck))
    while n > 0 and fill + n * bottleneck >= limit:
        n -= 1
    while fill + (n + 1) * bottleneck < limit:
        n += 1
    return n
