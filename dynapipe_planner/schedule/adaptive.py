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

import numpy as np

from .. import _core
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
