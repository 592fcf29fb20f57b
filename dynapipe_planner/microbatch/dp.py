"""Dynamic micro-batching: order samples, then split them by the C++ DP (DynaPipe seed
dynapipe.txt §4, Eq. 2 with t_max enumeration and the |D| replica term).

The DP's memory test depends on the pipeline schedule: `inflight[j]` is how many micro-batches'
activations stage j may hold at once (1F1B: C - j; the memory-aware adaptive schedule needs only
each micro-batch alone to fit, §4 "Limit memory consumption").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..cost.table import PipelineCosts
from ..errors import PlanningError
from .ordering import order_samples
from .reference_dp import microbatch_dp_reference


@dataclass
class MicroBatching:
    """Micro-batches as arrays of sample indices, with the DP's own accounting."""

    microbatches: list[np.ndarray]
    objective: float
    max_time: float
    sum_time: float
    passes: int = 0
    budget_exhausted: bool = False


def validate_lengths(lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> np.ndarray:
    """Lengths as int64 (N,) or (N, 2); names the first bad sample (by its id if given)."""
    arr = np.asarray(lengths)
    if arr.size == 0:
        raise PlanningError("empty batch: there are no samples to plan")
    if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] != 2):
        raise PlanningError(f"lengths must have shape (N,) or (N, 2), got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer) and (
        not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr))
    ):
        raise PlanningError("lengths must be whole numbers of tokens")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr.min(axis=1) <= 0 if arr.ndim == 2 else arr <= 0)
    if len(bad):
        name = bad[0] if sample_ids is None else sample_ids[bad[0]]
        raise PlanningError(
            f"sample {name} has length {arr[bad[0]].tolist()}; lengths must be positive"
        )
    return arr


def dp_inputs(costs: PipelineCosts, inflight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bottleneck time and memory-ratio tables, made monotone so range costs never shrink
    when a micro-batch grows (profiled tables carry measurement noise)."""
    time, mem = costs.dp_tables(inflight)
    for axis in range(3):
        time = np.maximum.accumulate(time, axis=axis)
        mem = np.maximum.accumulate(mem, axis=axis)
    return np.ascontiguousarray(time), np.ascontiguousarray(mem)


def dynamic_microbatches(
    lengths: np.ndarray,
    costs: PipelineCosts,
    *,
    inflight: np.ndarray,
    num_replicas: int = 1,
    order: str | np.ndarray = "sort",
    bucket_rel: float = 1e-3,
    bucket_abs: float = 0.0,
    time_budget_s: float = 2.0,
    backend: str = "cpp",
    sample_ids: np.ndarray | None = None,
) -> MicroBatching:
    """Split one global batch into micro-batches minimising (C-1) max t + sum t / |D|.

    `order` is a method of `order_samples` or a permutation already computed with one.
    `sample_ids` (dataset ids of the samples) only serve error messages.
    `bucket_rel` spaces the t_max thresholds so the objective is within that fraction of the
    optimum over contiguous partitions (0 with bucket_abs 0: exact); `time_budget_s` stops the
    enumeration early and keeps the best partition found.
    """
    lengths = validate_lengths(lengths, sample_ids)
    perm = order if isinstance(order, np.ndarray) else order_samples(lengths, order)
    ordered = lengths[perm]
    src = np.ascontiguousarray(ordered if ordered.ndim == 1 else ordered[:, 0])
    tgt = np.ascontiguousarray(ordered[:, 1] if ordered.ndim == 2 else np.zeros(0, np.int64))
    if ordered.ndim == 2 and not costs.encoder_decoder:
        raise PlanningError("target lengths given but the cost model is decoder-only")
    time, mem = dp_inputs(costs, inflight)
    args = (
        src,
        tgt,
        costs.b_grid,
        costs.s_grid,
        costs.t_grid,
        time,
        mem,
        costs.num_stages,
        num_replicas,
        bucket_abs,
        bucket_rel,
        time_budget_s,
    )
    if backend == "cpp":
        from .. import _core

        out = _core.microbatch_dp(*args)
    elif backend == "python":
        out = vars(microbatch_dp_reference(*args))
    else:
        raise PlanningError(f"unknown DP backend {backend!r}")
    if out["infeasible_position"] >= 0:
        sample = int(perm[out["infeasible_position"]])
        name = sample if sample_ids is None else int(sample_ids[sample])
        raise PlanningError(_infeasible_message(name, lengths[sample], costs, inflight))
    bounds = [0, *out["ends"]]
    return MicroBatching(
        [perm[a:b] for a, b in itertools.pairwise(bounds)],
        out["objective"],
        out["max_time"],
        out["sum_time"],
        int(out["passes"]),
        bool(out["budget_exhausted"]),
    )


def _infeasible_message(sample: int, length, costs: PipelineCosts, inflight: np.ndarray) -> str:
    length = np.atleast_1d(length).tolist()
    s, t = length[0], (length[1] if len(length) > 1 else 0)
    shape = f"length {s}" + (f", target length {t}" if len(length) > 1 else "")
    if costs.cells(1, s, t) is None:
        return (
            f"sample {sample} ({shape}) lies beyond the cost table (largest sequence length "
            f"{int(costs.s_grid[-1])}); profile longer sequences or truncate the data"
        )
    sc = costs.stage_costs(1, s, t)
    need = np.asarray(inflight) * sc.activation + sc.transient
    avail = costs.available_memory()
    j = int(np.argmax(need / avail))
    return (
        f"sample {sample} ({shape}) does not fit in any micro-batch: alone it needs "
        f"{need[j] / 2**30:.2f} GiB of activation memory on stage {j} "
        f"({int(inflight[j])} in flight) but only {avail[j] / 2**30:.2f} GiB is left after "
        f"weights and optimizer state (recompute={costs.recompute}); use recomputation, more "
        "stages, more TP, or truncate long samples"
    )
