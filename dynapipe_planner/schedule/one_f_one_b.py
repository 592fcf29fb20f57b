"""Non-interleaved 1F1B, the baseline schedule of DynaPipe (seed dynapipe.txt) §5, Fig. 11a.

Stage j first runs min(C-j-1, M) warm-up forwards, so the deeper stages have work as soon as the
first activations arrive, then alternates one forward and one backward (steady state, which
bounds stored activations to the warm-up depth plus one), then drains the remaining backwards.
"""

from __future__ import annotations

from .. import _core
from ..errors import PlanningError


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 0:
        raise PlanningError(
            f"1F1B needs at least one stage and no negative micro-batch count, got "
            f"{num_stages} stages and {num_microbatches} micro-batches"
        )


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[int]]:
    """1F1B op orders per stage, computed by the C++ core (same result as the reference)."""
    _check_sizes(num_stages, num_microbatches)
    return _core.one_f_one_b(num_stages, num_microbatches)


def one_f_one_b_passes(num_stages: int, num_microbatches: int) -> list[list[tuple[str, int]]]:
    """`one_f_one_b` per stage as ("F" | "B", micro-batch) pairs."""
    return [
        [("B" if code % 2 else "F", code // 2) for code in order]
        for order in one_f_one_b(num_stages, num_microbatches)
    ]
