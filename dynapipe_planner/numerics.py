"""Floating-point helpers that keep Python references bit-identical to the C++ core."""

from __future__ import annotations

from collections.abc import Iterable


def ordered_sum(values: Iterable[float]) -> float:
    """Left-to-right float addition, the order the C++ core adds in.

    Python 3.12's `sum()` compensates rounding errors (Neumaier), so on floats it can differ
    from a plain loop in the last bit; a reference that must equal C++ bit for bit adds here.
    """
    total = 0.0
    for value in values:
        total += value
    return total
