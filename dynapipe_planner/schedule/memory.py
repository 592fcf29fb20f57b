"""Activation memory of a schedule: DynaPipe (seed dynapipe.txt) §5, Fig. 11.

A forward stores the micro-batch's activation on its stage until the backward frees it, so the
order of a stage decides its peak; this is what the memory-aware schedule keeps under the limit
and what 1F1B's warm-up depth drives up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _core
from .ops import check_orders, core_errors, cost_matrix, working_memory


def peak_activation(
    orders: Sequence[Sequence[int]], activation: np.ndarray, transient: np.ndarray | None = None
) -> np.ndarray:
    """`peak_activation_reference` computed by the C++ core (same arithmetic, same errors)."""
    act = cost_matrix("activation", activation)
    with core_errors():  # the core checks the orders as `check_orders` does
        return _core.peak_activation(orders, act, working_memory(transient, act.shape))


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
