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
from .ops import core_errors, cost_matrix


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
