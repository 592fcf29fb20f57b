"""Op codes and input checks shared by the schedule modules (DynaPipe, seed dynapipe.txt, §5).

A schedule is, per stage, a list of op codes over local micro-batch indices 0..M-1 (injection
order): `2*m` is the forward of micro-batch m and `2*m + 1` its backward. Plain integers keep the
orders cheap to hand to the C++ core and to compare in tests.

The input checks live here, in Python, so the C++ core and the pure-Python references see the
same validated float64 arrays and any bad input fails with one message whichever path runs.
Errors the C++ core finds while computing (an impossible micro-batch, a deadlocking order) come
out of pybind11 as ValueError; `core_errors` turns them into PlanningError with the same text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ..errors import PlanningError


def describe_op(code: int) -> str:
    """Human-readable name of an op code, as used in every schedule error message."""
    kind = "backward" if code % 2 else "forward"
    return f"{kind} of micro-batch {code // 2}"


def format_bytes(value: float) -> str:
    """Bytes as the C++ core prints them (`%.0f`), so both paths give identical messages."""
    return f"{value:.0f}"


def cost_matrix(name: str, values: np.ndarray, shape: tuple[int, int] | None = None) -> np.ndarray:
    """A finite, non-negative float64 (M, C) matrix; `shape` pins it to the pipeline's size."""
    arr = np.ascontiguousarray(values, dtype=np.float64)
    if (
        arr.ndim != 2
        or (shape is None and arr.shape[1] < 1)
        or (shape is not None and arr.shape != shape)
    ):
        want = f"{shape}" if shape is not None else "(micro-batches, stages >= 1)"
        raise PlanningError(f"{name}: shape {arr.shape}, expected {want}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PlanningError(f"{name}: values must be finite and non-negative")
    return arr


def working_memory(transient: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """Per-op working memory (M, C) bytes, validated; none given means none needed."""
    return np.zeros(shape) if transient is None else cost_matrix("transient", transient, shape)


def memory_limits(limit: np.ndarray, num_stages: int) -> np.ndarray:
    """Per-stage activation budgets; +inf is allowed and means unlimited."""
    arr = np.ascontiguousarray(limit, dtype=np.float64)
    if arr.shape != (num_stages,):
        raise PlanningError(f"limit: shape {arr.shape}, expected ({num_stages},)")
    if np.any(np.isnan(arr)) or np.any(arr < 0):
        raise PlanningError("limit: values must be non-negative (inf for unlimited)")
    return arr


def check_max_inflight(max_inflight: int | None) -> None:
    """Injection cap must let at least one micro-batch in, or nothing could ever run."""
    if max_inflight is not None and max_inflight < 1:
        raise PlanningError(f"max_inflight must be None or at least 1, got {max_inflight!r}")


def check_orders(orders: Sequence[Sequence[int]], num_microbatches: int, num_stages: int) -> None:
    """Every stage runs each op exactly once and each backward after its own forward.

    Cross-stage deadlocks are not visible here; `timeline` finds those while simulating.
    The C++ core runs the same checks in the same order with the same messages.
    """
    if len(orders) != num_stages:
        raise PlanningError(f"orders cover {len(orders)} stages, the costs {num_stages}")
    num_ops = 2 * num_microbatches
    for stage, order in enumerate(orders):
        seen = [False] * num_ops
        for code in order:
            if not 0 <= code < num_ops:
                raise PlanningError(
                    f"stage {stage}: op code {code} is not an op of {num_microbatches} "
                    "micro-batches"
                )
            if seen[code]:
                raise PlanningError(f"stage {stage}: {describe_op(code)} appears twice")
            if code % 2 and not seen[code - 1]:
                raise PlanningError(f"stage {stage}: {describe_op(code)} comes before its forward")
            seen[code] = True
        if len(order) != num_ops:
            missing = seen.index(False)
            raise PlanningError(f"stage {stage}: {describe_op(missing)} is missing")


@contextmanager
def core_errors() -> Iterator[None]:
    """Re-raise the C++ core's ValueError (from std::invalid_argument) as PlanningError."""
    try:
        yield
    except ValueError as err:
        raise PlanningError(str(err)) from None
