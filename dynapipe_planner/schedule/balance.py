"""Rebalance micro-batches across data-parallel replicas by their scheduled iteration time.

DynaPipe (seed dynapipe.txt §4, "Balance data parallel model replicas") splits micro-batches so
that every replica gets the same total execution time. A replica's iteration time is more than
its work, though: a replica that holds a very long micro-batch also waits for that micro-batch's
forward-and-back chain through every stage, and fills the chain's bubbles only partly (§5: the
pipeline bubbles grow with micro-batch size variance). With long-tailed data one replica then
ends up to 30% after the others, and the iteration waits for it. The gradient all-reduce makes
the iteration as slow as its slowest replica, so the objective is the largest makespan, which
only scheduling each replica can tell.

`rebalance_replicas` starts from the work-balanced split and moves micro-batches from the
slowest replica to the fastest while that lowers the slower of the two. Each round tries the
few micro-batches whose stage time is closest to half the gap (the move that would even the two
out if makespan were additive), so a round costs a handful of schedule searches; it runs only
while the makespans differ by more than `tolerance`, which they rarely do without long outliers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Makespan = Callable[[int, tuple[int, ...]], float]  # (replica, its members) -> seconds
TOLERANCE = 0.02


def unbalanced(spans: Sequence[float], tolerance: float = TOLERANCE) -> bool:
    """Whether the slowest replica ends more than `tolerance` (relative) after the fastest."""
    return max(spans) - min(spans) > tolerance * max(spans)


def rebalance_replicas(
    replicas: Sequence[Sequence[int]],
    makespan: Makespan,
    stage_time: np.ndarray,
    *,
    tolerance: float = TOLERANCE,
    candidates: int = 4,
    max_rounds: int = 8,
) -> list[tuple[int, ...]]:
    """Move micro-batches off the slowest replica while that lowers the largest makespan.

    `replicas` lists each replica's micro-batch indices; `makespan(r, members)` prices a
    sorted non-empty tuple of them on replica r (math.inf when they cannot run there; an empty
    replica takes 0), so replicas may differ (Hydraulis's heterogeneous pipelines); and
    `stage_time[i]` is micro-batch i's time on its busiest stage. No replica is ever emptied,
    the largest makespan never grows, and the result is deterministic. Returns each replica's
    members as a sorted tuple.
    """
    parts = [tuple(sorted(r)) for r in replicas]
    if len(parts) < 2:
        return parts
    spans = [makespan(r, p) if p else 0.0 for r, p in enumerate(parts)]
    for _ in range(max_rounds):
        slow = int(np.argmax(spans))
        fast = int(np.argmin(spans))
        gap = spans[slow] - spans[fast]
        if not unbalanced(spans, tolerance) or len(parts[slow]) < 2:
            break
        picks = sorted(parts[slow], key=lambda i: (abs(stage_time[i] - gap / 2), i))
        best = None
        for i in picks[:candidates]:
            shrunk = tuple(m for m in parts[slow] if m != i)
            grown = tuple(sorted((*parts[fast], i)))
            after = (makespan(slow, shrunk), makespan(fast, grown))
            if max(after) < spans[slow] and (best is None or max(after) < max(best[2])):
                best = (shrunk, grown, after)
        if best is None:
            break
        parts[slow], parts[fast] = best[0], best[1]
        spans[slow], spans[fast] = best[2]
    return parts
