"""Sequence dispatch across the pipelines of a heterogeneous strategy: Hydraulis (seed
hydraulis.txt) §6.2, Eq. 2-3 and Appendix D.

A pipeline of scheme P that receives sequences l_1..l_U needs at least
    sum_i T(l_i, P) + T(max_i l_i, P) * (PP(P) - 1)                                   (Eq. 2)
(its busiest stage's work plus the fill and drain of its longest sequence), and the iteration
waits for the slowest pipeline, so dispatching minimises the largest Eq. 2 bound (Eq. 3). The
randomised greedy of Appendix D.2 (Alg. 1) sends sequences, in a random order, each to the
pipeline whose bound stays lowest, and keeps the best of `trials` orders; it runs in C++
(`_core.dispatch_greedy`), with `_reference.dispatch.dispatch_reference` as its readable twin.
`dispatch_exact` solves Eq. 3 with CP-SAT for small cases, to measure the greedy's gap.

How a sequence is priced (`pricing`, one of `DISPATCH_PRICINGS`):
- "full": T(l) = a l^2 + b l + c, as the paper's Eq. 2 writes it;
- "constant_free": a l^2 + b l, each sequence's constant term left out, as Hydraulis' public
  code does: packed sequences share one kernel launch per micro-batch, so c is paid per
  micro-batch, not per sequence;
- "packed" (our extension): `SchemeProfile.packed_time`, a short sequence costs its share of
  a packed UtilLen row, which is what it costs once Eq. 1 packs the pipeline. T(l) prices it
  alone, as small and slow kernels, and so overloads the schemes that hold only short
  sequences least: at LLaMA-32B on 32 GPUs their pipelines finished 20-25% before the rest
  while all Eq. 2 bounds were equal.
`benchmarks/hydraulis_quality.py` measures the three on the same strategies (the planner
core's predicted iteration time after dispatch and Eq. 1 packing); the selection's default is
the one measured best there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _core
from ..errors import PlanningError
from .proposal import Strategy
from .schemes import ParallelScheme, SchemeProfile


@dataclass(frozen=True)
class Dispatch:
    """Pipeline index of every sequence and the slowest pipeline's Eq. 2 bound (seconds)."""

    pipelines: tuple[ParallelScheme, ...]
    assignment: np.ndarray
    objective: float


def pipeline_bound(times: np.ndarray, pp: int) -> float:
    """Eq. 2 for one pipeline: its sequences' stage times, summed, plus the longest's fill/drain."""
    return float(times.sum() + times.max() * (pp - 1)) if len(times) else 0.0


def _pipelines(strategy: Strategy, profiles: list[SchemeProfile]) -> list[SchemeProfile]:
    """One profile per pipeline, largest MaxLen first (the order Alg. 1's J_i assumes)."""
    by_scheme = {p.scheme: p for p in profiles}
    missing = [str(s) for s, _ in strategy.pipelines if s not in by_scheme]
    if missing:
        raise PlanningError(f"strategy {strategy} uses unprofiled schemes {missing}")
    expanded = [by_scheme[s] for s in strategy.schemes]
    return sorted(expanded, key=lambda p: (-p.max_len, p.scheme))


DISPATCH_PRICINGS = ("full", "constant_free", "packed")


def sequence_times(profile: SchemeProfile, lengths: np.ndarray, pricing: str) -> np.ndarray:
    """T(l, P) of each sequence as dispatch prices it (`pricing`, module docstring)."""
    if pricing == "packed":
        return profile.packed_time(lengths)
    if pricing == "constant_free":  # the fit's constant c (App. B.2) left out, never below 0
        return np.maximum(profile.time(lengths) - profile.coef[2], 0.0)
    if pricing == "full":
        return profile.time(lengths)
    raise PlanningError(f"dispatch pricing must be one of {DISPATCH_PRICINGS}, got {pricing!r}")


def _costs(
    lengths: np.ndarray, pipelines: list[SchemeProfile], pricing: str
) -> tuple[np.ndarray, np.ndarray]:
    """T(l_i, P) per sequence and distinct scheme (inf beyond MaxLen), and each pipeline's
    column; a sequence no pipeline holds is an error naming it."""
    schemes = list(dict.fromkeys(p.scheme for p in pipelines))
    profile = {p.scheme: p for p in pipelines}
    lengths = np.asarray(lengths, dtype=np.float64)
    cost = np.empty((len(lengths), len(schemes)))
    for k, s in enumerate(schemes):
        times = sequence_times(profile[s], lengths, pricing)
        cost[:, k] = np.where(lengths <= profile[s].max_len, times, math.inf)
    homeless = np.flatnonzero(~np.isfinite(cost).any(axis=1)) if len(schemes) else []
    if len(homeless):
        i = int(homeless[0])
        longest = max(p.max_len for p in pipelines)
        raise PlanningError(
            f"sequence {i} (length {int(lengths[i])}) fits no pipeline of the strategy "
            f"(longest MaxLen {longest})"
        )
    column = np.array([schemes.index(p.scheme) for p in pipelines], dtype=np.int64)
    return cost, column


def _orders(num_seq: int, trials: int, seed: int) -> np.ndarray:
    if trials < 1:
        raise PlanningError(f"dispatch needs at least one trial, got {trials}")
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(num_seq) for _ in range(trials)]).astype(np.int64)


def dispatch(
    lengths: np.ndarray,
    strategy: Strategy,
    profiles: list[SchemeProfile],
    *,
    trials: int = 100,
    seed: int = 0,
    pricing: str = "full",
) -> Dispatch:
    """Alg. 1 (C++): the best of `trials` random-order greedy dispatches."""
    pipelines = _pipelines(strategy, profiles)
    cost, column = _costs(lengths, pipelines, pricing)
    pp = np.array([p.scheme.pp for p in pipelines], dtype=np.int64)
    assignment, objective = _core.dispatch_greedy(
        cost, column, pp, _orders(len(cost), trials, seed)
    )
    return Dispatch(tuple(p.scheme for p in pipelines), assignment, objective)


def dispatch_exact(
    lengths: np.ndarray,
    strategy: Strategy,
    profiles: list[SchemeProfile],
    *,
    work_limit: float = 10.0,
    resolution_s: float = 1e-6,
    pricing: str = "full",
) -> Dispatch:
    """Eq. 3 by CP-SAT (times in units of `resolution_s`); optimal when it finishes within
    `work_limit` (CP-SAT's deterministic time: a count of work, not a clock)."""
    from ortools.sat.python import cp_model

    pipelines = _pipelines(strategy, profiles)
    cost, column = _costs(lengths, pipelines, pricing)
    units = np.where(np.isfinite(cost), np.round(cost / resolution_s), -1).astype(np.int64)
    model = cp_model.CpModel()
    horizon = int(sum(units[i][units[i] >= 0].max() for i in range(len(units)))) * max(
        p.scheme.pp for p in pipelines
    )
    x = {}
    for i in range(len(units)):
        options = []
        for j in range(len(pipelines)):
            if units[i, column[j]] >= 0:
                x[i, j] = model.new_bool_var(f"x{i}_{j}")
                options.append(x[i, j])
        model.add_exactly_one(options)
    objective = model.new_int_var(0, horizon, "slowest")
    for j, p in enumerate(pipelines):
        mine = [(i, units[i, column[j]]) for i in range(len(units)) if (i, j) in x]
        longest = model.new_int_var(0, horizon, f"longest{j}")
        for i, t in mine:
            model.add(longest >= t).only_enforce_if(x[i, j])
        work = sum(int(t) * x[i, j] for i, t in mine)
        model.add(objective >= work + (p.scheme.pp - 1) * longest)
    model.minimize(objective)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = work_limit
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PlanningError(f"CP-SAT found no dispatch within {work_limit} units of work")
    assignment = np.array(
        [
            next(j for j in range(len(pipelines)) if (i, j) in x and solver.value(x[i, j]))
            for i in range(len(units))
        ],
        dtype=np.int64,
    )
    bounds = [
        pipeline_bound(cost[assignment == j, column[j]], p.scheme.pp)
        for j, p in enumerate(pipelines)
    ]
    return Dispatch(tuple(p.scheme for p in pipelines), assignment, max(bounds))
