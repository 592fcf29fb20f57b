"""Twins of `csrc/schedule_sim.cpp`: DynaPipe's (seed dynapipe.txt §5) 1F1B orders, memory-aware
adaptive schedule (Algorithm 1), activation peak, timeline and the schedule search's candidate
loop, as `dynapipe_planner.schedule` runs them on the C++ core."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from .. import _core
from ..errors import PlanningError
from ..schedule.adaptive import _checked, _never_fits
from ..schedule.one_f_one_b import _check_sizes
from ..schedule.ops import check_orders, cost_matrix, describe_op, working_memory
from ..schedule.timeline import Timeline, checked_costs


def one_f_one_b_reference(num_stages: int, num_microbatches: int) -> list[list[int]]:
    """Readable 1F1B: per stage, op codes (2*m forward, 2*m+1 backward of micro-batch m)."""
    _check_sizes(num_stages, num_microbatches)
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        order = [2 * m for m in range(warmup)]
        for step in range(num_microbatches - warmup):
            order += [2 * (warmup + step), 2 * step + 1]
        order += [2 * m + 1 for m in range(num_microbatches - warmup, num_microbatches)]
        orders.append(order)
    return orders


def adaptive_schedule_reference(
    activation: np.ndarray,
    limit: np.ndarray,
    max_inflight: int | None = None,
    transient: np.ndarray | None = None,
) -> list[list[int]]:
    """Readable Algorithm 1; `activation` and `transient` are (M, C) bytes, `limit` (C,) bytes
    per stage for stored activations plus the running op's working memory."""
    act, lim, tra = _checked(activation, limit, max_inflight, transient)
    num_mb, num_stages = act.shape
    forward_ready = [deque() for _ in range(num_stages)]
    backward_ready = [deque() for _ in range(num_stages)]
    forward_ready[0].extend(range(num_mb))
    memory = [0.0] * num_stages
    # Micro-batches whose activation each stage stores (stage 0's: those in flight).
    held: list[set[int]] = [set() for _ in range(num_stages)]
    orders: list[list[int]] = [[] for _ in range(num_stages)]

    while any(forward_ready) or any(backward_ready):
        unlocked_forward: list[list[int]] = [[] for _ in range(num_stages)]
        unlocked_backward: list[list[int]] = [[] for _ in range(num_stages)]
        progressed = False
        for stage in range(num_stages):
            if backward_ready[stage]:
                m = backward_ready[stage].popleft()
                held[stage].remove(m)
                memory[stage] = memory[stage] - act[m, stage] if held[stage] else 0.0
                orders[stage].append(2 * m + 1)
                if stage > 0:
                    unlocked_backward[stage - 1].append(m)
                progressed = True
            if forward_ready[stage]:
                m = forward_ready[stage][0]
                capped = stage == 0 and max_inflight is not None and len(held[0]) >= max_inflight
                worst = max([tra[m, stage], *(tra[k, stage] for k in held[stage])])
                if not capped and memory[stage] + act[m, stage] + worst <= lim[stage]:
                    forward_ready[stage].popleft()
                    held[stage].add(m)
                    memory[stage] += act[m, stage]
                    orders[stage].append(2 * m)
                    if stage + 1 < num_stages:
                        unlocked_forward[stage + 1].append(m)
                    else:
                        unlocked_backward[stage].append(m)
                    progressed = True
        if not progressed:
            # Stages past the deepest waiting forward have drained, so that stage holds no
            # activation (and stage 0 then has none in flight): its head can never fit.
            stage = max(j for j in range(num_stages) if forward_ready[j])
            m = forward_ready[stage][0]
            raise PlanningError(_never_fits(m, stage, act, tra, lim))
        for stage in range(num_stages):
            forward_ready[stage].extend(unlocked_forward[stage])
            backward_ready[stage].extend(unlocked_backward[stage])
    return orders


def peak_activation_reference(
    orders: Sequence[Sequence[int]], activation: np.ndarray, transient: np.ndarray | None = None
) -> np.ndarray:
    """Most bytes each stage uses at once when running its order, shape (C,): the activations
    it stores, plus, given `transient` (M, C), the working memory of the op that runs (an op of
    micro-batch m needs transient[m] on top of what is stored, its own activation included, as
    the simulator counts it).

    Memory is counted with the same arithmetic as adaptive_schedule (including the reset to 0
    when a stage holds nothing), so an adaptive schedule's peak never exceeds its limit.
    """
    act = cost_matrix("activation", activation)
    num_mb, num_stages = act.shape
    check_orders(orders, num_mb, num_stages)
    tra = working_memory(transient, act.shape)
    peak = [0.0] * num_stages
    for stage, order in enumerate(orders):
        stored = act[:, stage].tolist()  # Python floats: same doubles, far cheaper to index
        working = tra[:, stage].tolist()
        memory, held = 0.0, 0
        for code in order:
            m = code // 2
            if code % 2:
                peak[stage] = max(peak[stage], memory + working[m])
                held -= 1
                memory = memory - stored[m] if held else 0.0
            else:
                held += 1
                memory += stored[m]
                peak[stage] = max(peak[stage], memory + working[m])
    return np.array(peak)


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


def adaptive_candidates_reference(
    injection: list[list[int]],
    options: Sequence[int | None],
    act: np.ndarray,
    tra: np.ndarray,
    lim: np.ndarray,
    fwd: np.ndarray,
    bwd: np.ndarray,
    act_comm: np.ndarray,
    grad_comm: np.ndarray,
) -> tuple[int, int, list[list[int]] | None, np.ndarray | None, np.ndarray | None, str]:
    """The adaptive candidates of `search_schedule` in Python, as `_core.adaptive_search`
    runs them: every injection order (rows of the validated (M, C) inputs taken in that order)
    times every max_inflight option; the first with the least makespan wins. Returns its
    order and option indices, op codes and (M, C, 2) start/end times in injection order (-1
    and None when no candidate fits), and the first candidate's error that did not fit."""
    best, first_error = None, ""
    for k, order in enumerate(injection):
        idx = np.asarray(order, dtype=np.int64)
        costs = (fwd[idx], bwd[idx], act_comm[idx], grad_comm[idx])
        for i, max_inflight in enumerate(options):
            try:
                local = _core.adaptive_schedule(act[idx], lim, max_inflight, tra[idx])
            except ValueError as err:
                first_error = first_error or str(err)
                continue
            start, end = _core.schedule_timeline(local, *costs)
            makespan = float(end.max()) if end.size else 0.0
            if best is None or makespan < best[0]:
                best = (makespan, k, i, local, start, end)
    if best is None:
        return -1, -1, None, None, None, first_error
    return (*best[1:], first_error)
