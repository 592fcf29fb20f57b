"""Schedule search: DynaPipe (seed dynapipe.txt) §5, Algorithm 1 plus "Micro-batch ordering".

For the adaptive schedule the paper tries the permutations of the micro-batch clusters and keeps
the order with the shortest predicted iteration; we also try a few injection caps (max_inflight),
since how many micro-batches enter early trades safety stock against memory and warm-up. Each
candidate costs one C++ schedule and one C++ timeline (inputs are validated once, up front); the
candidate loop itself runs in the C++ core (`_core.adaptive_search`, held to
`_reference.schedules.adaptive_candidates_reference`), so no candidate's op codes cross into
Python but the winner's, and the whole search takes milliseconds and can run every iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import _core
from ..errors import PlanningError
from .memory import peak_activation
from .one_f_one_b import one_f_one_b
from .ops import check_max_inflight, cost_matrix, format_bytes, memory_limits, working_memory
from .ordering import cluster_permutations
from .timeline import Timeline, checked_costs, timeline


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen schedule, in the caller's micro-batch indices.

    `order` is the injection order, `orders` the per-stage op codes (2*m forward, 2*m+1
    backward of original micro-batch m), `timeline` the predicted timeline indexed by original
    micro-batch, `peak` the most bytes per stage of stored activations plus the running op's
    working memory (`peak_activation`) and `max_inflight` the injection
    cap that won (None: only memory limited injection, and always for 1F1B).
    """

    order: list[int]
    orders: list[list[int]]
    timeline: Timeline
    peak: np.ndarray
    max_inflight: int | None


def search_schedule(
    forward: np.ndarray,
    backward: np.ndarray,
    activation: np.ndarray,
    limit: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
    *,
    kind: str = "adaptive",
    num_clusters: int = 4,
    inflight_options: Sequence[int | None] | None = None,
    transient: np.ndarray | None = None,
) -> ScheduleChoice:
    """Best schedule of kind "adaptive" (searched) or "1f1b" (given order) by makespan.

    `limit` bounds, per stage, the stored activations plus the working memory (`transient`,
    (M, C) bytes, default none) of the op that runs, as the runtime meets them.

    Adaptive candidates are every cluster permutation of the injection order times every
    max_inflight option (default None, C, 2C), and 1F1B in the given order when it fits (so
    the adaptive schedule is never slower than 1F1B); the first candidate with the smallest
    makespan wins. Candidates that cannot fit in memory are skipped; if none fits, the error of the
    first candidate (identity order, so it names original micro-batch indices) is raised.
    A 1F1B schedule whose peak exceeds the limit raises PlanningError as well.
    """
    fwd, bwd, act_comm, grad_comm = checked_costs(forward, backward, act_comm, grad_comm)
    num_mb, num_stages = fwd.shape
    act = cost_matrix("activation", activation, (num_mb, num_stages))
    tra = working_memory(transient, (num_mb, num_stages))
    lim = memory_limits(limit, num_stages)
    if kind == "1f1b":
        return _one_f_one_b_choice(fwd, bwd, act, tra, lim, act_comm, grad_comm)
    if kind != "adaptive":
        raise PlanningError(f"unknown schedule kind {kind!r}; use 'adaptive' or '1f1b'")
    options = [None, num_stages, 2 * num_stages] if inflight_options is None else inflight_options
    for option in options:
        check_max_inflight(option)

    injection = cluster_permutations(fwd.sum(axis=1) + bwd.sum(axis=1), num_clusters)
    args = (injection, list(options), act, tra, lim, fwd, bwd, act_comm, grad_comm)
    k, i, local, start_local, end_local, first_error = _core.adaptive_search(*args)
    try:  # 1F1B in the given order, when it fits
        one_f_one_b = _one_f_one_b_choice(fwd, bwd, act, tra, lim, act_comm, grad_comm)
    except PlanningError:
        one_f_one_b = None
    if k < 0:
        if one_f_one_b is None:
            raise PlanningError(first_error)
        return one_f_one_b
    order, max_inflight = injection[k], options[i]
    adaptive_makespan = Timeline.from_times(start_local, end_local).makespan
    if one_f_one_b is not None and one_f_one_b.timeline.makespan < adaptive_makespan:
        return one_f_one_b  # memory-driven injection lost to plain 1F1B on these micro-batches

    orders = [[2 * order[code // 2] + code % 2 for code in stage] for stage in local]
    start = np.empty_like(start_local)
    end = np.empty_like(end_local)
    start[order] = start_local
    end[order] = end_local
    return ScheduleChoice(
        order,
        orders,
        Timeline.from_times(start, end),
        peak_activation(orders, act, tra),
        max_inflight,
    )


def _one_f_one_b_choice(
    fwd: np.ndarray,
    bwd: np.ndarray,
    act: np.ndarray,
    tra: np.ndarray,
    lim: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
) -> ScheduleChoice:
    """1F1B in the given order; it has no memory control, so exceeding the limit is an error."""
    num_mb, num_stages = fwd.shape
    orders = one_f_one_b(num_stages, num_mb)
    peak = peak_activation(orders, act, tra)
    for stage in range(num_stages):
        if peak[stage] > lim[stage]:
            raise PlanningError(
                f"1F1B stores up to {format_bytes(peak[stage])} bytes of activations (with the "
                f"running op's working memory) on stage {stage}, more than its limit of "
                f"{format_bytes(lim[stage])} bytes"
            )
    tl = timeline(orders, fwd, bwd, act_comm, grad_comm)
    return ScheduleChoice(list(range(num_mb)), orders, tl, peak, None)
