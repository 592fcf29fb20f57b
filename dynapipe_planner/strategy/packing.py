"""Sequence packing within one pipeline: Hydraulis (seed hydraulis.txt) §6.1, Eq. 1 and
Appendix C.

A pipeline of scheme P packs its U sequences into V micro-batches (each at most MaxLen(P)
tokens, variable-length attention, so a micro-batch costs the sum of its sequences' T) and takes
about  max_j (micro-batch j's time) x (PP(P) - 1 + V)  (Eq. 1): the slowest micro-batch paces
every pipeline step. V is enumerated only over [sum l / MaxLen, sum l / UtilLen] (App. C):
fewer micro-batches would not fit, more would be too short to keep the GPUs busy.

Two methods solve each V (`PACKING_METHODS`):
- "exact" is the paper's: Eq. 1 as the ILP it states, solved by CP-SAT (`pack_exact`) under a
  time limit, the LPT packing of the same V given as its hint; `Packing.optimal` says whether
  CP-SAT proved every V optimal in time.
- "lpt" (our default, a heuristic): longest processing time first, in C++. It stays the
  default because `benchmarks/hydraulis_solve_time.py` measures its Eq. 1 objective within
  a stated bound of the exact one at a fraction of the time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .. import _core
from ..errors import PlanningError
from ..numerics import ordered_sum
from .schemes import SchemeProfile

PACKING_METHODS = ("lpt", "exact")


@dataclass(frozen=True)
class Packing:
    """Micro-batches (indices into the pipeline's sequences) and their Eq. 1 latency;
    `optimal`: CP-SAT proved it the best packing of every V in the range."""

    microbatches: tuple[tuple[int, ...], ...]
    objective: float
    optimal: bool = False


def micro_batch_range(lengths: np.ndarray, profile: SchemeProfile) -> range:
    """The V worth trying (App. C), never empty for sequences that each fit."""
    total = int(np.sum(lengths))
    low = max(math.ceil(total / profile.max_len), 1)
    high = min(total // max(profile.util_len, 1), len(lengths))
    return range(low, max(low, high) + 1)


def pack_lpt(times: Sequence[float], lengths: Sequence[int], max_len: int, count: int):
    """Longest processing time first into `count` micro-batches of at most `max_len` tokens:
    each sequence goes to the least loaded micro-batch with room. None when one does not fit."""
    bins: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    heap = [(0.0, j) for j in range(count)]
    for i in sorted(range(len(times)), key=lambda i: (-times[i], i)):
        waiting = []
        while heap and tokens[heap[0][1]] + lengths[i] > max_len:
            waiting.append(heapq.heappop(heap))
        if not heap:
            return None
        load, j = heapq.heappop(heap)
        bins[j].append(i)
        tokens[j] += int(lengths[i])
        heapq.heappush(heap, (load + times[i], j))
        for item in waiting:
            heapq.heappush(heap, item)
    return [sorted(b) for b in bins if b]


def pack_exact(
    times: np.ndarray,
    lengths: np.ndarray,
    max_len: int,
    count: int,
    work_limit: float,
    *,
    resolution_s: float = 1e-6,
) -> tuple[list[list[int]] | None, bool]:
    """Eq. 1 for a fixed V = `count` as the paper states it, solved by CP-SAT: binary o[i][j]
    (sequence i in micro-batch j), each sequence in exactly one micro-batch, each
    micro-batch's tokens within `max_len`, minimising the slowest micro-batch's time (the
    factor PP - 1 + V is a constant once V is fixed). Times are integers of `resolution_s`.
    The LPT packing of the same V is the solver's hint and the incumbent: when `work_limit`
    (CP-SAT's deterministic time: a count of its work, about seconds of one core, never a
    clock) stops CP-SAT with nothing better, the hint is returned. Returns the non-empty
    micro-batches (None: no packing fits, or none was found in time) and whether CP-SAT
    proved that answer (optimal, or infeasible) within `work_limit`. Empty micro-batches are
    allowed, as in Eq. 1; the caller prices the packing at the number it fills, which the V
    enumeration also tries."""
    from ortools.sat.python import cp_model

    units = np.round(np.asarray(times) / resolution_s).astype(np.int64)
    size = len(units)
    model = cp_model.CpModel()
    o = [[model.new_bool_var(f"o{i}_{j}") for j in range(count)] for i in range(size)]
    slowest = model.new_int_var(0, int(units.sum()), "slowest")
    for i in range(size):
        model.add_exactly_one(o[i])
    for j in range(count):
        model.add(sum(int(lengths[i]) * o[i][j] for i in range(size)) <= max_len)
        model.add(sum(int(units[i]) * o[i][j] for i in range(size)) <= slowest)
    for j in range(1, count):  # micro-batches are interchangeable: sequence 0 goes to the first
        model.add(o[0][j] == 0)
    hint = pack_lpt(list(times), [int(x) for x in lengths], max_len, count)
    if hint is not None:
        first = next(k for k, b in enumerate(hint) if 0 in b)
        hint = [hint[first], *hint[:first], *hint[first + 1 :]]  # sequence 0's first
        where = {i: j for j, b in enumerate(hint) for i in b}
        for i in range(size):
            for j in range(count):
                model.add_hint(o[i][j], where[i] == j)
    model.minimize(slowest)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = work_limit
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, status == cp_model.INFEASIBLE
    bins = [[i for i in range(size) if solver.value(o[i][j])] for j in range(count)]
    if (
        status == cp_model.FEASIBLE
        and hint is not None
        and solver.objective_value > max(int(units[b].sum()) for b in hint)
    ):
        return hint, False  # stopped before it took up its hint: the hint is the incumbent
    return [b for b in bins if b], status == cp_model.OPTIMAL


def pack_pipeline(
    lengths: np.ndarray,
    profile: SchemeProfile,
    *,
    method: str = "lpt",
    work_limit: float = 1.0,
) -> Packing:
    """Best packing of one pipeline's sequences over the pruned V range (Eq. 1); `exact` gives
    CP-SAT `work_limit` of deterministic time per V (`pack_exact`)."""
    if method not in PACKING_METHODS:
        raise PlanningError(f"packing method must be one of {PACKING_METHODS}, got {method!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return Packing((), 0.0)
    too_long = np.flatnonzero(lengths > profile.max_len)
    if len(too_long):
        i = int(too_long[0])
        raise PlanningError(
            f"sequence {i} (length {lengths[i]}) exceeds MaxLen {profile.max_len} of "
            f"{profile.scheme}"
        )
    times = profile.time(lengths.astype(np.float64))
    counts = micro_batch_range(lengths, profile)
    if method == "lpt":
        best = _packing_of(
            *_core.pack_lpt_best(
                times, lengths, profile.max_len, counts.start, counts.stop - 1, profile.scheme.pp
            )
        )
    else:
        proved = []

        def solve(count: int) -> list[list[int]] | None:
            bins, proof = pack_exact(times, lengths, profile.max_len, count, work_limit)
            proved.append(proof)
            return bins

        best = _best_over_counts(solve, times.tolist(), counts, profile.scheme.pp)
        if best is not None and all(proved):
            best = replace(best, optimal=True)
    if best is None:  # one sequence per micro-batch always fits
        bins = [[i] for i in range(len(lengths))]
        slowest = float(times.max())
        best = Packing(tuple(tuple(b) for b in bins), slowest * (profile.scheme.pp - 1 + len(bins)))
    return best


def _best_over_counts(pack, times: list[float], counts: range, pp: int) -> Packing | None:
    """The Eq. 1 best of `pack(count)` over `counts` (first on ties)."""
    best = None
    for count in counts:
        bins = pack(count)
        if bins is None:
            continue
        slowest = max(ordered_sum(times[i] for i in b) for b in bins)
        objective = slowest * (pp - 1 + len(bins))
        if best is None or objective < best.objective:
            best = Packing(tuple(tuple(b) for b in bins), objective)
    return best


def _packing_of(assignment: np.ndarray, objective: float) -> Packing | None:
    """The C++ result as micro-batches of sorted sequence indices (None: no count fits)."""
    if len(assignment) and assignment[0] < 0:
        return None
    bins = [[] for _ in range(int(assignment.max()) + 1)] if len(assignment) else []
    for i, j in enumerate(assignment.tolist()):
        bins[j].append(i)
    return Packing(tuple(tuple(b) for b in bins), float(objective))
