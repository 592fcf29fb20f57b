"""Twins of the packing kernels in `csrc/first_fit.cpp` and `csrc/packing.cpp`: first-fit
decreasing (the packing baseline, DynaPipe seed dynapipe.txt §8.4) and Hydraulis's LPT packing
of one pipeline (seed hydraulis.txt §6.1, Eq. 1, Appendix C)."""

from __future__ import annotations

import numpy as np

from ..strategy.packing import Packing, _best_over_counts, micro_batch_range, pack_lpt
from ..strategy.schemes import SchemeProfile


def first_fit_decreasing_reference(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Readable first-fit-decreasing: the largest sample first (stable for ties), each into the
    first bin with room for it, else a new bin."""
    order = np.argsort(-lengths, kind="stable")
    residual = np.empty(len(lengths), dtype=np.int64)
    bins: list[list[int]] = []
    for i in order:
        size = int(lengths[i])
        open_bins = residual[: len(bins)]
        fits = np.flatnonzero(open_bins >= size)
        if len(fits):
            k = int(fits[0])
            residual[k] -= size
            bins[k].append(int(i))
        else:
            residual[len(bins)] = capacity - size
            bins.append([int(i)])
    return bins


def pack_pipeline_reference(lengths: np.ndarray, profile: SchemeProfile) -> Packing | None:
    """`pack_pipeline`'s LPT search in plain Python, what the C++ core mirrors (None: no
    count fits)."""
    times = profile.time(np.asarray(lengths, dtype=np.float64)).tolist()
    tokens = np.asarray(lengths, dtype=np.int64).tolist()
    return _best_over_counts(
        lambda count: pack_lpt(times, tokens, profile.max_len, count),
        times,
        micro_batch_range(lengths, profile),
        profile.scheme.pp,
    )
