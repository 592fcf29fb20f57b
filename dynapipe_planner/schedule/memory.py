"""Activation memory of a schedule: DynaPipe (seed dynapipe.txt) §5, Fig. 11.

A forward stores the micro-batch's activation on its stage until the backward frees it, so the
order of a stage decides its peak; this is what the memory-aware schedule keeps under the limit
and what 1F1B's warm-up depth drives up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import _core
from .ops import core_errors, cost_matrix, working_memory


def peak_activation(
    orders: Sequence[Sequence[int]], activation: np.ndarray, transient: np.ndarray | None = None
) -> np.ndarray:
    """Most bytes each stage uses at once (stored activations plus the running op's working
    memory), computed by the C++ core; `_reference.schedules.peak_activation_reference` is
    its readable twin (same arithmetic, same errors)."""
    act = cost_matrix("activation", activation)
    with core_errors():  # the core checks the orders as `check_orders` does
        return _core.peak_activation(orders, act, working_memory(transient, act.shape))
