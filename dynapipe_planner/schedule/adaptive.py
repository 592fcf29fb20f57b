"""Memory-aware adaptive (cyclic) scheduling: DynaPipe (seed dynapipe.txt) §5, Algorithm 1.

1F1B keeps zero ready ops ("safety stock") on every stage in its steady state, so any slower
micro-batch idles the pipeline. The cyclic schedule instead injects micro-batches as early as
memory allows: every cycle each stage runs at most one backward, then at most one forward, taken
from the heads of its ready buffers. A forward whose activation would exceed the stage's budget
stays at the head and the stage skips forwards until backwards have freed enough memory; ops
unlocked in a cycle only become ready in the next one. So training proceeds without running out
of memory as long as each micro-batch fits on its own.

Choices the paper leaves open, fixed here:
- A forward fits when memory + activation <= limit (the paper writes <, which would reject a
  micro-batch that exactly fills the budget).
- `max_inflight` bounds how many micro-batches are between their stage-0 forward and stage-0
  backward, a second injection control besides memory (the search tries a few values).
- When a stage holds no activations its memory count is reset to exactly 0, so rounding in the
  running float sum can never turn a micro-batch that fits on its own into an impossible one.
- Working memory (`transient`, the extra bytes at the peak of a micro-batch's forward or
  backward) is counted per op, as the runtime meets it: an op of micro-batch k runs with the
  stored activations plus transient[k]. A forward of m is admitted when stored + act[m] +
  max(transient[m], transient of every micro-batch the stage holds) fits the limit. That keeps
  every later op within the limit too: stored memory only grows at admissions, each of which
  checked the transients of the micro-batches then held. (Subtracting one worst-case transient
  from the limit for every op, as before, left stage 0 a micro-batch short of 1F1B's depth and
  idled the pipeline: issue 21, plan_quality.py.)
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .. import _core
from ..errors import PlanningError
from .ops import (
    check_max_inflight,
    core_errors,
    cost_matrix,
    format_bytes,
    memory_limits,
    working_memory,
)


def _checked(
    activation: np.ndarray,
    limit: np.ndarray,
    max_inflight: int | None,
    transient: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    act = cost_matrix("activation", activation)
    lim = memory_limits(limit, act.shape[1])
    check_max_inflight(max_inflight)
    tra = working_memory(transient, act.shape)
    return act, lim, tra


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


def _never_fits(m: int, stage: int, act: np.ndarray, tra: np.ndarray, lim: np.ndarray) -> str:
    working = f" and {format_bytes(tra[m, stage])} bytes of working" if tra[m, stage] else ""
    return (
        f"micro-batch {m} needs {format_bytes(act[m, stage])} bytes of activation{working} "
        f"memory on stage {stage}, more than its limit of {format_bytes(lim[stage])} bytes"
    )


def adaptive_schedule(
    activation: np.ndarray,
    limit: np.ndarray,
    max_inflight: int | None = None,
    transient: np.ndarray | None = None,
) -> list[list[int]]:
    """Algorithm 1 computed by the C++ core (same orders and errors as the reference).

    Returns per stage op codes over local micro-batch indices (rows of `activation` in
    injection order). Raises PlanningError naming a micro-batch that can never fit.
    """
    act, lim, tra = _checked(activation, limit, max_inflight, transient)
    with core_errors():
        return _core.adaptive_schedule(act, lim, max_inflight, tra)
