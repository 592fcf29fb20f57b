"""Compute timeline of per-stage op orders: DynaPipe (seed dynapipe.txt) §5 and Fig. 12.

The schedule fixes only each stage's order; the timeline says when each op runs if every stage
works through its order as fast as its dependencies allow. This predicted timeline ranks
candidate schedules (the search) and later orders the communication (§6).

Dependencies: F(m, j) needs F(m, j-1) plus the activation transfer act_comm[m, j-1];
B(m, C-1) needs F(m, C-1); B(m, j) needs B(m, j+1) plus the gradient transfer grad_comm[m, j].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import _core
from ..errors import PlanningError
from .ops import check_orders, core_errors, cost_matrix, describe_op


@dataclass(frozen=True)
class Timeline:
    """When each op runs. start/end are (M, C, 2) seconds, last axis 0 forward, 1 backward.

    `makespan` is the time the last op ends (the pipeline starts at 0); `busy` the seconds each
    stage computes, so makespan - busy is that stage's bubble.
    """

    start: np.ndarray
    end: np.ndarray
    makespan: float
    busy: np.ndarray

    @classmethod
    def from_times(cls, start: np.ndarray, end: np.ndarray) -> Timeline:
        makespan = float(end.max()) if end.size else 0.0
        return cls(start, end, makespan, (end - start).sum(axis=(0, 2)))


def checked_costs(
    forward: np.ndarray,
    backward: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four time tables as validated float64 arrays of consistent shapes."""
    fwd = cost_matrix("forward", forward)
    num_mb, num_stages = fwd.shape
    bwd = cost_matrix("backward", backward, (num_mb, num_stages))
    act = cost_matrix("act_comm", act_comm, (num_mb, num_stages - 1))
    grad = cost_matrix("grad_comm", grad_comm, (num_mb, num_stages - 1))
    return fwd, bwd, act, grad


def timeline_reference(
    orders: Sequence[Sequence[int]],
    forward: np.ndarray,
    backward: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
) -> Timeline:
    """Readable timeline simulation; raises PlanningError for an order that cannot run."""
    fwd, bwd, act, grad = checked_costs(forward, backward, act_comm, grad_comm)
    num_mb, num_stages = fwd.shape
    check_orders(orders, num_mb, num_stages)
    start = np.zeros((num_mb, num_stages, 2))
    end = np.zeros((num_mb, num_stages, 2))
    done = np.zeros((num_mb, num_stages, 2), dtype=bool)
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    remaining = 2 * num_mb * num_stages
    while remaining:
        progressed = False
        # Each stage runs on until its next op waits for an op not yet simulated; sweeping
        # the stages until nothing moves reaches every op any valid order can reach.
        for stage in range(num_stages):
            while position[stage] < 2 * num_mb:
                m, kind = divmod(orders[stage][position[stage]], 2)
                if kind == 0:
                    if stage == 0:
                        ready = 0.0
                    elif done[m, stage - 1, 0]:
                        ready = end[m, stage - 1, 0] + act[m, stage - 1]
                    else:
                        break
                elif stage == num_stages - 1:
                    ready = end[m, stage, 0]  # check_orders put the forward earlier here
                elif done[m, stage + 1, 1]:
                    ready = end[m, stage + 1, 1] + grad[m, stage]
                else:
                    break
                start[m, stage, kind] = max(free_at[stage], ready)
                end[m, stage, kind] = start[m, stage, kind] + (bwd if kind else fwd)[m, stage]
                free_at[stage] = end[m, stage, kind]
                done[m, stage, kind] = True
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stage = next(j for j in range(num_stages) if position[j] < 2 * num_mb)
            code = orders[stage][position[stage]]
            # Only cross-stage waits can block: a forward waits upstream, a backward downstream.
            other = stage + 1 if code % 2 else stage - 1
            raise PlanningError(
                f"stage {stage}: order deadlocks at {describe_op(code)}, which waits for "
                f"{describe_op(code)} on stage {other}"
            )
    return Timeline.from_times(start, end)


def timeline(
    orders: Sequence[Sequence[int]],
    forward: np.ndarray,
    backward: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
) -> Timeline:
    """Timeline of per-stage orders computed by the C++ core (same values as the reference).

    forward/backward are (M, C) seconds; act_comm/grad_comm (M, C-1) seconds for the transfer
    across the boundary after stage j (activation down, gradient up).
    """
    fwd, bwd, act, grad = checked_costs(forward, backward, act_comm, grad_comm)
    with core_errors():
        start, end = _core.schedule_timeline(orders, fwd, bwd, act, grad)
    return Timeline.from_times(start, end)
