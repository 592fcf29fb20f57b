"""Dynamic micro-batching: order samples, then split them by the C++ DP (DynaPipe seed
dynapipe.txt §4, Eq. 2 with t_max enumeration and the |D| replica term).

The DP's memory test depends on the pipeline schedule: `inflight[j]` is how many micro-batches'
activations stage j may hold at once (1F1B: C - j; the memory-aware adaptive schedule needs only
each micro-batch alone to fit, §4 "Limit memory consumption").

Packed rows (issue 21): with `packed_rows` each contiguous group of the sorted samples may run
padded (one sample per row, padded to its longest) or packed: its samples first-fit-decreasing
into rows of L tokens, L its own longest sample or the batch's longest, attention only within
each sample (varlen; the packed micro-batch of Hydraulis seed hydraulis.txt §6.1, whose Eq. 1
prices a micro-batch as the sum of its sequences' latencies under a row-length bound).
`baselines.packed_group` builds exactly these rows for a group and a row length. A group packed
into r rows of L is priced on each stage by the first of the planner's two prices of packed
rows (`PipelineCosts.packed_times`), its table time at (r, L) less the attention skipped
(`attention_coef`), so at or above the plan's final price, and needs the memory of r rows of L. Per
group the DP takes the cheapest of the three while it partitions; padding never wins on its
monotone tables (the argument is in `csrc/microbatch_dp.cpp`), so every micro-batch it returns
runs packed, at the row length in `MicroBatching.row_lengths`. A group's price is raised to that
of the group one sample shorter at its left where it would fall below it (a new row may cost
less than the attention it saves): the DP's scan needs monotone prices.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cost.table import PipelineCosts
from ..errors import PlanningError
from .ordering import order_samples

# Ranges the DP may price before it keeps the best partition found so far: a count of work,
# never a clock, so a plan does not depend on the machine's load. At the default bucket_rel
# the planner-speed batches stay far below it (N=8,000: 2.5e7, N=16,000: 4.7e7); it stops an
# exact (bucket_rel=0) sweep of thousands of samples (N=8,000 prices 4.8e10 ranges, 65 s), after
# 1.3-6 s of one core here (150-780 million ranges a second).
DEFAULT_WORK_BUDGET = 10**9


@dataclass
class MicroBatching:
    """Micro-batches as arrays of sample indices, with the DP's own accounting."""

    microbatches: list[np.ndarray]
    objective: float
    max_time: float
    sum_time: float
    passes: int = 0
    budget_exhausted: bool = False
    row_lengths: list[int] = field(default_factory=list)  # packed: each micro-batch's rows
    work: int = 0  # ranges the DP priced over all its passes


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


def packing_inputs(costs: PipelineCosts) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage forward + backward tables made monotone like `dp_inputs`' (their maximum over
    stages is its time table) and attention coefficients, for packed groups. A stage whose table
    never exceeds another's and whose coefficient is no smaller can never be the slowest on
    packed rows (it saves at least as much attention), so it is left out: the DP then
    interpolates fewer tables for the same maximum (one for GPT stages of equal layers)."""
    time = costs.forward + costs.backward
    for axis in range(1, 4):
        time = np.maximum.accumulate(time, axis=axis)
    coef = np.asarray(costs.attention_coef, dtype=np.float64)

    def covers(k: int, j: int) -> bool:
        return bool(np.all(time[k] >= time[j]) and coef[k] <= coef[j])

    stages = range(len(coef))
    keep = [
        j
        for j in stages
        if not any(covers(k, j) and (k < j or not covers(j, k)) for k in stages if k != j)
    ]
    return np.ascontiguousarray(time[keep]), np.ascontiguousarray(coef[keep])


def dynamic_microbatches(
    lengths: np.ndarray,
    costs: PipelineCosts,
    *,
    inflight: np.ndarray,
    num_replicas: int = 1,
    order: str | np.ndarray = "sort",
    bucket_rel: float = 1e-3,
    bucket_abs: float = 0.0,
    work_budget: int = DEFAULT_WORK_BUDGET,
    kernel: Callable[..., dict] | None = None,
    sample_ids: np.ndarray | None = None,
    packed_rows: bool = False,
) -> MicroBatching:
    """Split one global batch into micro-batches minimising (C-1) max t + sum t / |D|.

    `order` is a method of `order_samples` or a permutation already computed with one.
    `sample_ids` (dataset ids of the samples) only serve error messages.
    `bucket_rel` spaces the t_max thresholds so the objective is within that fraction of the
    optimum over contiguous partitions (0 with bucket_abs 0: exact); `work_budget` (ranges
    priced, 0: none) stops the enumeration early and keeps the best partition found: a count,
    not seconds, so a busy machine plans exactly what an idle one does. `packed_rows`: each
    group may run as packed rows (module docstring); decoder-only lengths ordered by length
    only. `kernel` runs the DP on the arguments built here (None: the C++ core); the tests
    pass its Python twin, `dynapipe_planner._reference.microbatch_dp.microbatch_dp_kernel`.
    """
    lengths = validate_lengths(lengths, sample_ids)
    perm = order if isinstance(order, np.ndarray) else order_samples(lengths, order)
    ordered = lengths[perm]
    src = np.ascontiguousarray(ordered if ordered.ndim == 1 else ordered[:, 0])
    tgt = np.ascontiguousarray(ordered[:, 1] if ordered.ndim == 2 else np.zeros(0, np.int64))
    if ordered.ndim == 2 and not costs.encoder_decoder:
        raise PlanningError("target lengths given but the cost model is decoder-only")
    if packed_rows and (ordered.ndim == 2 or np.any(np.diff(src) < 0)):
        raise PlanningError("packed rows need decoder-only lengths sorted by length")
    if packed_rows and np.any(np.asarray(costs.attention_coef) < 0):
        raise PlanningError("packed rows need attention coefficients >= 0")
    time, mem = dp_inputs(costs, inflight)
    stage_time, coef = packing_inputs(costs) if packed_rows else (np.zeros(0), np.zeros(0))
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
        work_budget,
        stage_time,
        coef,
    )
    if kernel is None:
        from .. import _core

        kernel = _core.microbatch_dp
    out = kernel(*args)
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
        [int(x) for x in out["row_lengths"]],
        int(out["work"]),
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
