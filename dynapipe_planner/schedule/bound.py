"""A lower bound on the iteration time of given micro-batches under any pipeline schedule
(DynaPipe, seed dynapipe.txt §5: the schedule decides only the order of each stage's ops).

Memory is ignored, so no schedule the adaptive search or 1F1B can produce beats it. Why it
holds, for one pipeline: stage j runs its forward and backward ops one at a time, so it is
busy for sum_m (f_mj + b_mj). It cannot start before some micro-batch has gone forward
through stages 0..j-1 and across their boundaries (fill), and after its last op, a backward
of some micro-batch, that gradient still goes back through stages j-1..0 (drain); whichever
micro-batches these are, their fill and drain are at least the smallest over all
micro-batches. And each micro-batch alone goes forward through every stage and back (its
chain). Over R identical pipelines (data-parallel replicas) some pipeline gets at least 1/R
of stage j's work, whatever the split, and its fill, drain and every chain are bounded the
same way, so the bound holds for every split of the micro-batches over the replicas too.
"""

from __future__ import annotations

import numpy as np


def makespan_lower_bound(
    forward: np.ndarray,
    backward: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
    num_replicas: int = 1,
) -> float:
    """max( max_j min_m fill_mj + sum_m (f_mj + b_mj) / R + min_m drain_mj, max_m chain_m ).

    forward/backward are (M, C) seconds, act_comm/grad_comm (M, C-1) seconds across the
    boundary after each stage; R = `num_replicas` pipelines share the micro-batches.
    """
    fwd, bwd = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
    if fwd.shape[0] == 0:
        return 0.0
    num_stages = fwd.shape[1]
    to_stage = np.zeros_like(fwd)  # fill: forward through the stages before j and their sends
    from_stage = np.zeros_like(fwd)  # drain: backward through them
    to_stage[:, 1:] = np.cumsum(fwd[:, :-1] + act_comm, axis=1)
    from_stage[:, 1:] = np.cumsum(bwd[:, :-1] + grad_comm, axis=1)
    work = (fwd + bwd).sum(axis=0) / num_replicas
    stages = to_stage.min(axis=0) + work + from_stage.min(axis=0)
    last = num_stages - 1
    chain = to_stage[:, last] + fwd[:, last] + bwd[:, last] + from_stage[:, last]
    return float(max(stages.max(), chain.max()))


def memory_time_lower_bound(
    forward: np.ndarray,
    backward: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
    activation: np.ndarray,
    limit: np.ndarray,
    num_replicas: int = 1,
) -> float:
    """A lower bound for schedules within memory: max_j sum_m a_mj r_mj / (R L_j).

    Stage j stores micro-batch m's activation a_mj from the start of its forward to the end of
    its backward, at least r_mj: the forward and backward through stages j..C-1 and the sends
    between them, which run one after another. What a stage stores never exceeds its limit
    L_j (`limit`, bytes per stage), so over an iteration of length T, T L_j >= sum_m a_mj r_mj
    on each pipeline; some pipeline of R holds at least 1/R of the sum, whatever the split.
    Micro-batches too large to overlap thus cost their time even when the stages are idle.
    """
    fwd, bwd = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
    if fwd.shape[0] == 0:
        return 0.0
    ops = fwd + bwd
    ops[:, :-1] += np.asarray(act_comm) + np.asarray(grad_comm)
    held = np.cumsum(ops[:, ::-1], axis=1)[:, ::-1]  # r_mj: stage j onwards and back
    stored = (np.asarray(activation, dtype=np.float64) * held).sum(axis=0)
    return float((stored / (num_replicas * np.asarray(limit, dtype=np.float64))).max())
