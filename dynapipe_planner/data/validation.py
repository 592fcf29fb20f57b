"""Checks shared by every length source, so bad lengths read the same wherever they came from.

A lengths array is int64 with shape (N,) for decoder-only data or (N, 2) for encoder-decoder data
(input length, target length). Every length is a positive token count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import PlanningError


def check_shape(values: np.ndarray, origin: str) -> None:
    """Reject anything but a non-empty (N,) or (N, 2) array; `origin` names where it came from."""
    if values.ndim not in (1, 2) or (values.ndim == 2 and values.shape[1] != 2):
        raise PlanningError(
            f"{origin}: lengths must have shape (N,) or (N, 2) (input, target), got {values.shape}"
        )
    if values.shape[0] == 0:
        raise PlanningError(f"{origin}: no samples")


def check_positive(lengths: np.ndarray, locate: Callable[[int], str]) -> None:
    """Raise for the first sample with a length below 1; `locate(i)` names sample i's origin."""
    bad = lengths <= 0
    rows = np.flatnonzero(bad.any(axis=1) if lengths.ndim == 2 else bad)
    if rows.size == 0:
        return
    row = int(rows[0])
    if lengths.ndim == 2:
        column = 0 if bad[row, 0] else 1
        kind, value = ("length", "target length")[column], lengths[row, column]
    else:
        kind, value = "length", lengths[row]
    raise PlanningError(
        f"{locate(row)}: sample {row} has {kind} {int(value)}; lengths must be positive"
    )


def check_count(value: object, name: str, minimum: int) -> int:
    """An integer argument (not a bool) of at least `minimum`, e.g. a token budget or a seed."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise PlanningError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
