"""Exact reference for tiny clusters: a mixed-integer program (OR-Tools CP-SAT) over every
pipeline layout, to measure how far the HexiScale heuristic is from the optimum (seed
hexiscale.txt App. D, Table 6).

Devices of one machine are interchangeable, so a pipeline is an ordered sequence of stages
(machine, TP degree). Every such sequence that fits the machines is enumerated; its layers are
assigned by `layer_assign.assign_layers` (the bottleneck-optimal split the planner uses too),
which gives its time for m micro-batches, fill + (m - 1) x bottleneck (App. A Eq. 9). For every
pipeline count D, CP-SAT finds the choice of D pipelines (a sequence may repeat) within each
machine's GPU count with the smallest slowest-pipeline time; that choice is priced in full
(`HeteroCostModel.estimate`, gradient sync of Eq. 7 included), excluded, and the search goes
on while the next choice's slowest pipeline alone is still cheaper than the best full price
(lazy branch and bound). The result is the optimum of the cost model over this plan space:
stages of one TP group inside one machine, layers split bottleneck-optimally per pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import PlanningError
from .cost import Estimate, HeteroCostModel
from .layer_assign import assign_layers, assign_micro_batches, pipeline_profile, stage_shapes
from .layout import HeteroPipeline, HeteroPlan, HeteroStage

MAX_DEVICES = 12


@dataclass(frozen=True)
class _Candidate:
    stages: tuple[tuple[int, int], ...]  # (machine, tp)
    usage: tuple[int, ...]
    layers: tuple[int, ...]
    fill_s: float
    bottleneck_s: float


def _sequences(counts: list[int], tps: list[int], max_len: int):
    """Ordered stage sequences (machine, tp) using at most `counts` GPUs of each machine."""
    kinds = [(m, t) for m in range(len(counts)) for t in tps if t <= counts[m]]

    def grow(seq, used):
        if seq:
            yield tuple(seq)
        if len(seq) == max_len:
            return
        for m, t in kinds:
            if used[m] + t <= counts[m]:
                used[m] += t
                seq.append((m, t))
                yield from grow(seq, used)
                seq.pop()
                used[m] -= t

    yield from grow([], [0] * len(counts))


def _devices(cost: HeteroCostModel, seq, taken: list[int]) -> list[tuple[int, ...]]:
    """Concrete devices for a stage sequence, after `taken[m]` devices of each machine."""
    used = list(taken)
    out = []
    for m, t in seq:
        first = cost.cluster.machines[m].first_device + used[m]
        out.append(tuple(range(first, first + t)))
        used[m] += t
    return out


def _candidates(cost: HeteroCostModel, num_pipelines: int) -> list[_Candidate]:
    counts = [m.count for m in cost.cluster.machines]
    tps = [t for t in (1, 2, 4, 8) if cost.valid_tp(t)]
    layers_total = cost.job.model.num_layers
    best: dict[tuple, list[_Candidate]] = {}
    for seq in _sequences(counts, tps, layers_total):
        stages = _devices(cost, seq, [0] * len(counts))
        shapes = stage_shapes(cost, stages, num_pipelines)
        layers = assign_layers(shapes, layers_total)
        if layers is None:
            continue
        fill, bottleneck = pipeline_profile(shapes, layers)
        usage = tuple(sum(t for m, t in seq if m == k) for k in range(len(counts)))
        cand = _Candidate(seq, usage, tuple(layers), fill, bottleneck)
        # Keep, per GPU usage, only candidates no other beats on fill, bottleneck and depth.
        group = best.setdefault(usage, [])
        if any(
            o.fill_s <= fill and o.bottleneck_s <= bottleneck and len(o.stages) <= len(seq)
            for o in group
        ):
            continue
        group[:] = [
            o
            for o in group
            if not (fill <= o.fill_s and bottleneck <= o.bottleneck_s and len(seq) <= len(o.stages))
        ]
        group.append(cand)
    return [c for g in best.values() for c in g]


def _choose(
    cands: list[_Candidate],
    counts: list[int],
    d: int,
    total: int,
    below: float,
    excluded: list[dict[int, int]],
) -> dict[int, int] | None:
    """CP-SAT: the D pipelines (repeats allowed) within the machines' GPUs, other than the
    `excluded` choices, whose slowest pipeline is fastest, if it is faster than `below`.

    Pipeline time is fill + (m - 1) x bottleneck (Eq. 9), so within a time limit T candidate c
    runs at most floor((T - fill) / bottleneck) + 1 micro-batches, and at least its depth; the
    chosen copies' micro-batches must cover the global batch."""
    from ortools.sat.python import cp_model

    scale = 1e6 / max(c.fill_s + total * c.bottleneck_s for c in cands)  # integer time units
    horizon = 1_000_001
    limit = horizon if math.isinf(below) else min(horizon, math.ceil(below * scale))
    model = cp_model.CpModel()
    t_max = model.NewIntVar(0, limit, "t_max")
    x, work = {}, []
    for i, c in enumerate(cands):
        depth, fill, step = len(c.stages), c.fill_s * scale, c.bottleneck_s * scale
        if fill + (depth - 1) * step >= limit:
            continue  # cannot run even its depth in time
        x[i] = model.NewIntVar(0, d, f"x{i}")
        used = model.NewBoolVar(f"used{i}")
        model.Add(x[i] >= 1).OnlyEnforceIf(used)
        model.Add(x[i] == 0).OnlyEnforceIf(used.Not())
        m = model.NewIntVar(0, total, f"m{i}")  # micro-batches per copy
        model.Add(m >= depth).OnlyEnforceIf(used)
        # fill + (m - 1) * step <= t_max, in integers (rounded up: never optimistic)
        model.Add(math.ceil(step) * (m - 1) + math.ceil(fill) <= t_max).OnlyEnforceIf(used)
        w = model.NewIntVar(0, total * d, f"w{i}")
        model.AddMultiplicationEquality(w, [x[i], m])
        work.append(w)
    if not x:
        return None
    model.Add(sum(x.values()) == d)
    for k, cap in enumerate(counts):
        model.Add(sum(cands[i].usage[k] * x[i] for i in x if cands[i].usage[k]) <= cap)
    model.Add(sum(work) >= total)
    for n, old in enumerate(excluded):  # no-good: differ from an already priced choice
        if any(i not in x for i in old):
            continue  # uses a candidate too slow for this limit: excluded already
        differs = []
        for i in x:
            same = model.NewBoolVar(f"same{n}_{i}")
            model.Add(x[i] == old.get(i, 0)).OnlyEnforceIf(same)
            model.Add(x[i] != old.get(i, 0)).OnlyEnforceIf(same.Not())
            differs.append(same.Not())
        model.AddBoolOr(differs)
    model.Minimize(t_max)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 30.0
    if solver.Solve(model) != cp_model.OPTIMAL:
        return None
    return {i: solver.Value(x[i]) for i in x if solver.Value(x[i])}


def _plan(cost: HeteroCostModel, cands: list[_Candidate], choice: dict[int, int]) -> HeteroPlan:
    """Devices, layer ranges and micro-batches for a chosen multiset of candidates."""
    total = cost.job.num_micro_batches
    chosen = [cands[i] for i, n in sorted(choice.items()) for _ in range(n)]
    micro = assign_micro_batches([(c.fill_s, c.bottleneck_s) for c in chosen], total)
    assert micro is not None  # the choice covers the batch
    taken = [0] * len(cost.cluster.machines)
    pipes = []
    for c, m in zip(chosen, micro, strict=True):
        devs = _devices(cost, c.stages, taken)
        for k, t in c.stages:
            taken[k] += t
        start, stages = 0, []
        for s, n in zip(devs, c.layers, strict=True):
            stages.append(HeteroStage(s, (start, start + n)))
            start += n
        pipes.append(HeteroPipeline(tuple(stages), m))
    return HeteroPlan(
        pipes, cost.job.micro_batch_size, cost.job.seqlen, cost.job.model.name, cost.cluster.name
    )


def _solve(cost: HeteroCostModel, d: int, bound: float) -> tuple[HeteroPlan, Estimate] | None:
    """Best plan with D pipelines, or None if none beats `bound` seconds.

    Lazy branch and bound: find the choice with the smallest slowest-pipeline time, price it in
    full, exclude it, and repeat while the next choice's slowest pipeline is below the best
    full price: a plan never costs less than its slowest pipeline."""
    counts = [m.count for m in cost.cluster.machines]
    cands = _candidates(cost, d)
    if not cands:
        return None
    best: tuple[HeteroPlan, Estimate] | None = None
    excluded: list[dict[int, int]] = []
    while True:
        limit = min(bound, best[1].iteration_s if best else math.inf)
        choice = _choose(cands, counts, d, cost.job.num_micro_batches, limit, excluded)
        if choice is None:
            return best
        excluded.append(choice)
        plan = _plan(cost, cands, choice)
        est = cost.estimate(plan)
        if est.fits and est.iteration_s < limit:
            plan.stats = est.as_stats()
            best = (plan, est)


def milp_reference(cost: HeteroCostModel) -> tuple[HeteroPlan, Estimate]:
    """The best plan over every pipeline count, each solved exactly (see module docstring)."""
    n = cost.cluster.num_devices
    if n > MAX_DEVICES:
        raise PlanningError(
            f"the exact MILP is for tiny clusters (at most {MAX_DEVICES} GPUs); "
            f"cluster {cost.cluster.name!r} has {n}"
        )
    best: tuple[HeteroPlan, Estimate] | None = None
    for d in range(1, min(n, cost.job.num_micro_batches) + 1):
        found = _solve(cost, d, best[1].iteration_s if best else math.inf)
        if found is not None:
            best = found
    if best is None:
        raise PlanningError(f"no plan fits the memory of cluster {cost.cluster.name!r}")
    return best
