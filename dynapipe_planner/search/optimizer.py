"""Galvatron-Base and Galvatron-BMW optimisation (seed `galvatron_bmw.txt` §IV-A1 Algorithm 1,
§IV-B2 Algorithm 2).

For each global batch size B, PP degree P and micro-batch count m, the model is split into P
stages (memory-balanced partition p_m under an initial strategy), every stage's layers get
their strategies from the layer DP under the memory budget, and Eq. 9 prices the pipeline.
Galvatron-Base stops there. Galvatron-BMW then adjusts the partition of the best
configurations from memory- towards time-balanced (boundary layers leave the slowest stage
under the three validity rules, the layer DP re-runs on every new partition) and searches the
batch sizes around the best one found. B is explored by doubling until nothing fits, then by
bisection up to the largest batch that fits, instead of Algorithm 1's B = 1, 2, 3, ...
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanningError
from ..model_spec import ModelSpec
from .cost_inputs import CostInputs
from .estimator import Estimator, StageTables, peak_memory, pipeline_time, stage_times
from .layer_dp import StagePlan, solve_stage
from .partition import adjustment_moves, balanced_partition, max_stage, prefix_cost
from .space import LayerStrategy, strategy_space

GiB = 1024**3
Progress = Callable[[int, int], None]


@dataclass
class SearchResult:
    """The best plan found: per-layer strategies, pipeline partition, batch and predictions."""

    throughput: float  # samples / s
    iteration_time_s: float
    global_batch_size: int
    num_microbatches: int
    pp: int
    partition: list[int]
    strategies: list[LayerStrategy]  # one per layer
    stage_memory_bytes: list[float]
    stage_time_s: list[float]  # per stage: (m - 1) * one micro-batch + the last one
    memory_budget_bytes: float
    bi_objective: bool
    base_throughput: float = 0.0  # best memory-balanced (Galvatron-Base) plan seen
    evaluated: int = 0  # (B, P, m, partition) configurations priced
    search_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def microbatch_size(self) -> int:
        return self.global_batch_size // self.num_microbatches

    def stage_strategies(self) -> list[list[LayerStrategy]]:
        out, start = [], 0
        for n in self.partition:
            out.append(self.strategies[start : start + n])
            start += n
        return out


@dataclass
class _Evaluated:
    time: float
    partition: list[int]
    plans: list[StagePlan]
    memory: list[float]
    stage_time: list[float]


class _PipelineSearch:
    """The searches of one PP degree, caching stage tables and stage DPs by layer range."""

    def __init__(
        self, inputs: CostInputs, strategies: list[LayerStrategy], budget: float, bins: int
    ):
        self.inputs = inputs
        self.strategies = strategies
        self.pp = strategies[0].pp
        self.est = Estimator(inputs, strategies)
        self.budget = budget
        self.granularity = budget / bins
        self._tables: dict[tuple, StageTables] = {}
        self._plans: dict[tuple, StagePlan | None] = {}

    def tables(self, stage: int, a: int, b: int, mb: int, m: int) -> StageTables:
        key = (stage, a, b, mb, m)
        t = self._tables.get(key)
        if t is None:
            if len(self._tables) > 4096:
                self._tables.clear()
            t = self._tables[key] = self.est.stage_tables(range(a, b), stage, mb, m)
        return t

    def stage_plan(self, stage: int, a: int, b: int, mb: int, m: int) -> StagePlan | None:
        key = (stage, a, b, mb, m)
        if key not in self._plans:
            if len(self._plans) > 4096:
                self._plans.clear()
            t = self.tables(stage, a, b, mb, m)
            self._plans[key] = solve_stage(t, self.budget, self.granularity)
        return self._plans[key]

    def initial_partitions(self, mb: int, m: int) -> list[list[int]]:
        """p_m: memory-balanced partitions under an initial strategy for every layer (§IV-B:
        Strategy_Init, PP_Partition_Init). Which strategy decides how much activations weigh
        against model states, so two are tried: the non-CKPT strategies with the least and
        the most memory. The second is the partition a DP+PP-only space would start from, so
        the full space never starts from a worse one than that limited space."""
        L = self.inputs.num_layers
        if self.pp == 1:
            return [[L]]
        probe = self.est.stage_tables(range(L), 0, mb, m)
        per_layer = probe.fwd_bytes / min(self.pp, m) + probe.state_bytes
        usable = [j for j in range(len(self.strategies)) if math.isfinite(probe.objective[0, j])]
        candidates = [j for j in usable if not self.strategies[j].ckpt] or usable
        if not candidates:
            return [[L // self.pp + (i < L % self.pp) for i in range(self.pp)]]
        in_flight = [min(self.pp - stage, m) for stage in range(self.pp)]
        out: list[list[int]] = []
        for pick in (min, max):
            j0 = pick(candidates, key=lambda j: per_layer[0, j])
            act = probe.fwd_bytes[:, j0] / min(self.pp, m)
            memory = prefix_cost(act, in_flight, probe.state_bytes[:, j0])
            partition = balanced_partition(L, self.pp, memory)
            if partition not in out:
                out.append(partition)
        return out

    def evaluate_initial(self, mb: int, m: int) -> _Evaluated | None:
        """The best of the memory-balanced starting partitions (Galvatron-Base's answer)."""
        best = None
        for partition in self.initial_partitions(mb, m):
            ev = self.evaluate(partition, mb, m)
            if ev is not None and (best is None or ev.time < best.time):
                best = ev
        return best

    def _stage_tables(self, partition: Sequence[int], mb: int, m: int) -> list[StageTables]:
        out, start = [], 0
        for stage, n in enumerate(partition):
            out.append(self.tables(stage, start, start + n, mb, m))
            start += n
        return out

    def evaluate(self, partition: Sequence[int], mb: int, m: int) -> _Evaluated | None:
        plans, memory, nosync, sync = [], [], [], []
        start = 0
        for stage, n in enumerate(partition):
            plan = self.stage_plan(stage, start, start + n, mb, m)
            if plan is None:
                return None
            t = self.tables(stage, start, start + n, mb, m)
            ns, sy = stage_times(t, plan.chosen)
            plans.append(plan)
            memory.append(plan.peak_bytes)
            nosync.append(ns)
            sync.append(sy)
            start += n
        total = pipeline_time(nosync, sync, m)
        per_stage = [float((m - 1) * a + b) for a, b in zip(nosync, sync, strict=True)]
        memory = [float(x) for x in memory]
        return _Evaluated(float(total), list(partition), plans, memory, per_stage)

    def adjust(self, start: _Evaluated, mb: int, m: int, max_steps: int) -> tuple[_Evaluated, int]:
        """Algorithm 2's queue: partitions move towards time balance while rules 1-3 hold."""
        best = start
        queue = deque([start])
        seen = {tuple(start.partition)}
        steps = 0
        while queue and steps < max_steps:
            cur = queue.popleft()
            # Each layer keeps its strategy when it moves; price stages with those strategies.
            chosen = [j for plan in cur.plans for j in plan.chosen]

            def stage_time(stage: int, a: int, b: int, chosen=chosen) -> float:
                t = self.tables(stage, a, b, mb, m)
                ns, sy = stage_times(t, chosen[a:b])
                return (m - 1) * ns + sy

            def stage_memory(stage: int, a: int, b: int, chosen=chosen) -> float:
                return peak_memory(self.tables(stage, a, b, mb, m), chosen[a:b])

            layer_time = np.concatenate(
                [
                    (m - 1) * t.nosync[np.arange(len(p.chosen)), p.chosen]
                    + t.sync[np.arange(len(p.chosen)), p.chosen]
                    for t, p in zip(
                        self._stage_tables(cur.partition, mb, m), cur.plans, strict=True
                    )
                ]
            )
            p_time = balanced_partition(
                len(chosen), self.pp, prefix_cost(layer_time, [1.0] * self.pp)
            )
            # Rule 3 caps memory at p_t's peak; never below the current partition's own peak.
            cap = max(max_stage(p_time, stage_memory), max(cur.memory))
            for p in adjustment_moves(cur.partition, stage_time, stage_memory, self.budget, cap):
                if tuple(p) in seen:
                    continue
                seen.add(tuple(p))
                steps += 1
                found = self.evaluate(p, mb, m)
                if found is None:
                    continue
                queue.append(found)
                if found.time < best.time:
                    best = found
        return best, steps


def _microbatch_counts(batch: int, pp: int, counts: tuple[int, int | None]) -> list[int]:
    """m = P, 2P, 4P, ... dividing `batch` (at most `counts[0]` of them), or the fixed
    `counts[1]` when given."""
    limit, fixed = counts
    if fixed is not None:
        return [fixed] if batch % fixed == 0 else []
    out = []
    m = pp
    while m <= batch and len(out) < limit:
        if batch % m == 0:
            out.append(m)
        m *= 2
    return out


def search(
    model: ModelSpec,
    cost_inputs: CostInputs,
    num_gpus: int,
    memory_budget: float,
    *,
    global_batch_size: int | None = None,
    batch_sizes: Sequence[int] | None = None,
    max_batch_size: int = 8192,
    pp_degrees: Sequence[int] | None = None,
    max_tp: int | None = None,
    strategy_filter: Callable[[LayerStrategy], bool] | None = None,
    bi_objective: bool = True,
    prune: bool = True,
    memory_bins: int = 256,
    microbatch_counts: int = 4,
    batch_window: int = 2,
    max_adjust_steps: int | None = None,
    stop_after_misses: int = 2,
    num_microbatches: int | None = None,
    progress: Progress | None = None,
) -> SearchResult:
    """Galvatron-BMW (or, with `bi_objective=False`, Galvatron-Base) search.

    `memory_budget` is bytes per GPU. Batch sizes: `global_batch_size` alone, an explicit
    `batch_sizes` list (tried in increasing order until `stop_after_misses` in a row fit
    nothing), or a search (doubling from `num_gpus`, then bisection to the largest
    batch that fits, then +-`batch_window` steps around the best). For each B and PP degree,
    `microbatch_counts` counts m = P, 2P, 4P, ... dividing B are tried (or exactly
    `num_microbatches`, for every P, when given). `strategy_filter`
    restricts the layer strategies (the limited spaces of Table II). Raises PlanningError
    naming the smallest budget that fits when nothing does.
    """
    started = time.perf_counter()
    if cost_inputs.num_layers != len(model.layer_kinds()):
        raise PlanningError(
            f"cost inputs describe {cost_inputs.num_layers} layers but {model.name} has "
            f"{len(model.layer_kinds())}"
        )
    if memory_budget <= 0:
        raise PlanningError(f"memory budget must be positive, got {memory_budget}")
    if num_microbatches is not None and num_microbatches < 1:
        raise PlanningError(f"num_microbatches must be >= 1, got {num_microbatches}")
    counts = (microbatch_counts, num_microbatches)
    searches = _pipeline_searches(
        cost_inputs, num_gpus, memory_budget, memory_bins, pp_degrees, max_tp, strategy_filter,
        prune,
    )  # fmt: skip
    if not searches:
        raise PlanningError(
            f"no strategy of {num_gpus} GPUs is usable for {model.name} (PP degrees "
            f"{list(pp_degrees) if pp_degrees else 'all'}, max TP {max_tp})"
        )
    L = cost_inputs.num_layers
    steps_limit = max_adjust_steps if max_adjust_steps is not None else 2 * L
    state = {"evaluated": 0, "total": 0}

    def tick(extra_total: int = 0) -> None:
        state["total"] += extra_total
        if progress is not None:
            progress(state["evaluated"], max(state["total"], state["evaluated"]))

    best: list[tuple[float, int, _PipelineSearch, _Evaluated, int, int] | None] = [None]
    best_base = [0.0]

    def try_batch(batch: int) -> bool:
        """Price every (P, m) for this batch; True when something fits."""
        configs = [(ps, m) for ps in searches for m in _microbatch_counts(batch, ps.pp, counts)]
        tick(len(configs))
        found: list[tuple[float, _PipelineSearch, _Evaluated, int, int]] = []
        for ps, m in configs:
            mb = batch // m
            ev = ps.evaluate_initial(mb, m)
            state["evaluated"] += 1
            tick()
            if ev is not None:
                found.append((batch / ev.time, ps, ev, mb, m))
        if not found:
            return False
        found.sort(key=lambda f: -f[0])
        best_base[0] = max(best_base[0], found[0][0])
        if bi_objective:
            for i, (_, ps, ev, mb, m) in enumerate(found[:3]):
                if ps.pp > 1:
                    adjusted, steps = ps.adjust(ev, mb, m, steps_limit)
                    state["evaluated"] += steps
                    found[i] = (batch / adjusted.time, ps, adjusted, mb, m)
            found.sort(key=lambda f: -f[0])
        tput, ps, ev, mb, m = found[0]
        if best[0] is None or tput > best[0][0]:
            best[0] = (tput, batch, ps, ev, mb, m)
        return True

    if global_batch_size is not None or batch_sizes is not None:
        listed = [global_batch_size] if global_batch_size is not None else sorted(batch_sizes)
        misses = 0
        for batch in listed:
            if batch < 1:
                raise PlanningError(f"global batch size must be >= 1, got {batch}")
            misses = 0 if try_batch(batch) else misses + 1
            if misses >= stop_after_misses:
                break
    else:
        step = num_gpus
        batch, last_ok, first_bad = step, 0, 0
        while batch <= max_batch_size:
            if try_batch(batch):
                last_ok = batch
                batch *= 2
            else:
                first_bad = batch
                break
        if last_ok and first_bad:
            lo, hi = last_ok // step, first_bad // step  # in units of `step`
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if try_batch(mid * step):
                    lo = mid
                else:
                    hi = mid
        if best[0] is not None and bi_objective:
            center = best[0][1] // step
            tried = set()
            for k in range(center - batch_window, center + batch_window + 1):
                if k >= 1 and k * step <= max_batch_size and k not in tried:
                    tried.add(k)
                    try_batch(k * step)
    if best[0] is None:
        smallest = global_batch_size or (min(batch_sizes) if batch_sizes else num_gpus)
        raise PlanningError(
            _infeasible_message(model, searches, smallest, memory_budget, counts, memory_bins)
        )
    tput, batch, ps, ev, _mb, m = best[0]
    strategies = [ps.strategies[j] for plan in ev.plans for j in plan.chosen]
    return SearchResult(
        throughput=tput,
        iteration_time_s=ev.time,
        global_batch_size=batch,
        num_microbatches=m,
        pp=ps.pp,
        partition=ev.partition,
        strategies=strategies,
        stage_memory_bytes=ev.memory,
        stage_time_s=ev.stage_time,
        memory_budget_bytes=memory_budget,
        bi_objective=bi_objective,
        base_throughput=best_base[0],
        evaluated=state["evaluated"],
        search_time_s=time.perf_counter() - started,
    )


def _pipeline_searches(
    inputs: CostInputs,
    num_gpus: int,
    budget: float,
    bins: int,
    pp_degrees: Sequence[int] | None,
    max_tp: int | None,
    strategy_filter: Callable[[LayerStrategy], bool] | None,
    prune: bool,
) -> list[_PipelineSearch]:
    if bins < 1:
        raise PlanningError(f"memory_bins must be >= 1, got {bins}")
    space = strategy_space(num_gpus, prune=prune)
    if pp_degrees is not None:
        unknown = [p for p in pp_degrees if p not in space]
        if unknown:
            raise PlanningError(
                f"PP degree(s) {unknown} do not split {num_gpus} GPUs into equal groups"
            )
    out = []
    for pp, strategies in space.items():
        if pp > inputs.num_layers or (pp_degrees is not None and pp not in pp_degrees):
            continue
        usable = [
            s
            for s in strategies
            if inputs.supports(s)
            and (max_tp is None or s.tp <= max_tp)
            and (strategy_filter is None or strategy_filter(s))
        ]
        if usable:
            out.append(_PipelineSearch(inputs, usable, budget, bins))
    return out


def minimum_memory(
    inputs: CostInputs, searches: list[_PipelineSearch], batch: int, counts: tuple[int, int | None]
) -> tuple[float, str]:
    """The least Eq. 2 peak any (P, m) reaches at `batch` with each layer on its least-memory
    strategy and the memory-balanced partition, and where."""
    best, where = math.inf, ""
    for ps in searches:
        for m in _microbatch_counts(batch, ps.pp, counts):
            mb = batch // m
            partition = ps.initial_partitions(mb, m)[0]
            peak, start = 0.0, 0
            for stage, n in enumerate(partition):
                t = ps.tables(stage, start, start + n, mb, m)
                total = t.fwd_bytes + t.state_bytes + t.bwd_bytes
                total[~(t.objective < math.inf)] = math.inf
                chosen = [int(j) for j in total.argmin(axis=1)]
                if any(not math.isfinite(total[i, j]) for i, j in enumerate(chosen)):
                    peak = math.inf
                    break
                peak = max(peak, peak_memory(t, chosen))
                start += n
            if peak < best:
                best, where = peak, f"PP={ps.pp}, {m} micro-batches of {mb}"
    return best, where


def _fits(
    searches: list[_PipelineSearch],
    batch: int,
    budget: float,
    counts: tuple[int, int | None],
    bins: int,
):
    """Whether any (P, m) plan of `batch` fits `budget` (memory-balanced partition)."""
    for template in searches:
        ps = _PipelineSearch(template.inputs, template.strategies, budget, bins)
        for m in _microbatch_counts(batch, ps.pp, counts):
            mb = batch // m
            if ps.evaluate_initial(mb, m) is not None:
                return True
    return False


def smallest_budget(
    searches: list[_PipelineSearch], batch: int, counts: tuple[int, int | None], bins: int
) -> float | None:
    """The least memory budget (to 0.01 GiB) at which some plan of `batch` fits, found by
    bisection around the least-memory assignment's Eq. 2 peak; None when no strategy can
    split the batch at all. The search at `global_batch_size=batch` fits exactly when
    `_fits` does (the bi-objective step only starts from plans that fit)."""
    need, _ = minimum_memory(searches[0].inputs, searches, batch, counts)
    if not math.isfinite(need):
        return None
    step = 0.01 * GiB
    # In steps of 0.01 GiB; lo always fails and hi always fits, so the answer is minimal on
    # that grid even where rounding memory into budget-sized bins is not monotone.
    lo = math.floor(need / step)
    while lo > 0 and _fits(searches, batch, lo * step, counts, bins):
        lo //= 2
    hi = max(lo + 1, math.ceil(need * 1.25 / step))
    while not _fits(searches, batch, hi * step, counts, bins):
        lo, hi = hi, hi * 2
        if hi * step > 1e6 * GiB:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(searches, batch, mid * step, counts, bins):
            hi = mid
        else:
            lo = mid
    return hi * step


def _infeasible_message(
    model: ModelSpec,
    searches: list[_PipelineSearch],
    batch: int,
    budget: float,
    counts: tuple[int, int | None],
    bins: int,
) -> str:
    need, where = minimum_memory(searches[0].inputs, searches, batch, counts)
    smallest = smallest_budget(searches, batch, counts, bins)
    if smallest is None:
        return (
            f"{model.name}: no strategy can split a global batch of {batch} "
            f"(each layer's micro-batch must divide by its data-parallel degree)"
        )
    return (
        f"{model.name} does not fit in {budget / GiB:.2f} GiB per GPU at global batch {batch}: "
        f"the least-memory plan needs {need / GiB:.2f} GiB ({where}); the smallest budget "
        f"that works is {smallest / GiB:.2f} GiB (--memory-budget-gb {smallest / GiB:.2f})"
    )
