"""Galvatron-Base and Galvatron-BMW optimisation (seed `galvatron_bmw.txt` §IV-A1 Algorithm 1,
§IV-B2 Algorithm 2, App. B).

For each global batch size B, PP degree P and micro-batch count m (every m dividing B, 1 to
B: Init_Microbatch_Num of Algorithm 1 left open), the model is split into P stages
(memory-balanced partition p_m under an initial strategy), every stage's layers get their
strategies from the layer DP under the memory budget, and Eq. 9 prices the pipeline.
Galvatron-Base stops there. Galvatron-BMW then adjusts the partition of every configuration
that fits from memory- towards time-balanced (starting from the even split where p_m does not
fit) and searches the batch sizes around the best one found. B is explored by doubling until
nothing fits (or `max_batch_size`), then by bisection up to the largest batch that fits,
instead of Algorithm 1's B = 1, 2, 3, ...

The adjustment follows Algorithm 2: a boundary layer leaves the slowest stage for a neighbour
when (1) no stage becomes slower than the old slowest, (2) every stage fits the budget and
(3) no stage needs more memory than the time-balanced partition p_t. Algorithm 2 runs
Galvatron_Search on each candidate partition, so the rules are checked with the affected
stages' strategies re-solved by the layer DP, not with each layer keeping the strategy it had:
a layer moving to a stage short of memory can make that stage checkpoint instead of
invalidating the move. The search space the paper argues for lies between p_m and p_t (Eq. 7,
App. B) and its ablation (Table V) prices p_t itself, so besides p_m the queue also starts
from p_t and from the even split (p_t of identical layers on one strategy) when they fit: the
greedy moves off the slowest stage cannot always walk from p_m to p_t.

Within a partition every stage minimises its own time, (m - 1) micro-batches plus the last
one; Eq. 9 charges the (m - 1) only to the slowest stage, so the others then take the plan with
the quickest last micro-batch if it keeps them no slower than the slowest (`evaluate`).
(P, m) configurations are priced in order of an Eq. 9 lower bound and skipped once a
memory-balanced plan found for the same batch beats the bound (exact for both answers): this is
the only pruning of micro-batch counts, and it is safe because no plan of a skipped (P, m),
whatever its partition or strategies, can be faster than its bound. Stage
plans are cached by the layer types of the stage, and one prefix layer DP
(`layer_dp.StageSolver`) serves every stage length at a pipeline position, so moving
boundaries costs little.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanningError
from ..model_spec import ModelSpec
from .cost_inputs import CostInputs
from .estimator import (
    Estimator,
    StageTables,
    peak_memory,
    pipeline_time,
    shared_host_time,
    shares_cores,
    stage_sync_idle_s,
    stage_times,
    stage_work,
)
from .layer_dp import StagePlan, StageSolver
from .partition import (
    StageCost,
    adjustment_moves,
    balanced_partition,
    max_stage,
    prefix_cost,
)
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
        self._full: dict[tuple, StageTables] = {}
        self._solvers: dict[tuple, StageSolver] = {}
        self._uniform = len(set(inputs.layer_kinds)) == 1
        self._kinds = (
            bytes(np.asarray(inputs.layer_kinds, dtype=np.uint8))
            if max(inputs.layer_kinds, default=0) < 256
            else tuple(inputs.layer_kinds)
        )
        self._plans: dict[tuple, tuple[StagePlan, float, float, float] | None] = {}

    def tables(self, stage: int, a: int, b: int, mb: int, m: int) -> StageTables:
        """Stage tables of layers [a, b): rows of the whole model's tables for that stage
        (a layer's costs depend on its stage only through the micro-batches in flight)."""
        key = (stage, mb, m)
        full = self._full.get(key)
        if full is None:
            if len(self._full) > 256:
                self._full.clear()
            full = self._full[key] = self.est.stage_tables(
                range(self.inputs.num_layers), stage, mb, m
            )
        if a == 0 and b == self.inputs.num_layers:
            return full
        return dataclasses.replace(
            full,
            nosync=full.nosync[a:b],
            sync=full.sync[a:b],
            objective=full.objective[a:b],
            fwd_bytes=full.fwd_bytes[a:b],
            state_bytes=full.state_bytes[a:b],
            bwd_bytes=full.bwd_bytes[a:b],
            input_bytes=full.input_bytes[a:b],
            transform=full.transform[a:b],
            transform_once=full.transform_once[a:b],
            forward=full.forward[a:b],
            cpu_forward=full.cpu_forward[a:b],
            cpu_nosync=full.cpu_nosync[a:b],
            cpu_sync=full.cpu_sync[a:b],
            sync_idle=full.sync_idle[a:b],
        )

    def time_bound(self, mb: int, m: int) -> float:
        """A lower bound on Eq. 9 for any partition and strategies: every layer at its
        fastest strategy, the (m - 1) slowest micro-batches at least the average stage's."""
        t = self.tables(0, 0, self.inputs.num_layers, mb, m)
        nosync = float(t.nosync.min(axis=1).sum())
        sync = float(t.sync.min(axis=1).sum())
        return (m - 1) * nosync / self.pp + sync

    def solved(self, stage: int, a: int, b: int, mb: int, m: int, sync_only: bool = False):
        """(layer-DP plan, one micro-batch without sync, the last one with sync, peak bytes)
        of layers [a, b) on `stage`, or None when nothing fits. Cached by the layer types of
        the range rather than its position: a stage's costs depend only on which layers it
        holds, so in a model of identical layers every stage of n layers at one pipeline
        position is solved once, whatever the partition or adjustment step. The DP
        minimises the stage's own time, (m - 1) x one micro-batch + the last one, or with
        `sync_only` the last micro-batch alone (see `evaluate`)."""
        key = (stage, self._kinds[a:b], mb, m, sync_only)
        if key not in self._plans:
            if len(self._plans) > 16384:
                self._plans.clear()
            plan = self._solver(stage, a, mb, m, sync_only).solve(b - a)
            if plan is None:
                self._plans[key] = None
            else:
                ns, sy = stage_times(self.tables(stage, a, b, mb, m), plan.chosen)
                self._plans[key] = (plan, ns, sy, plan.peak_bytes)
        return self._plans[key]

    def _solver(self, stage: int, a: int, mb: int, m: int, sync_only: bool) -> StageSolver:
        """The prefix layer DP of the layers from `a` on `stage` (from layer 0 when all
        layers are alike: every range of n layers then has the same costs)."""
        anchor = 0 if self._uniform else a
        key = (stage, anchor, mb, m, sync_only)
        solver = self._solvers.get(key)
        if solver is None:
            if len(self._solvers) > 512:
                self._solvers.clear()
            t = self.tables(stage, anchor, self.inputs.num_layers, mb, m)
            if sync_only:
                objective = np.where(np.isfinite(t.objective), t.sync, np.inf)
                t = dataclasses.replace(t, objective=objective, transform=t.transform_once)
            solver = self._solvers[key] = StageSolver(t, self.budget, self.granularity)
        return solver

    def stage_plan(self, stage: int, a: int, b: int, mb: int, m: int) -> StagePlan | None:
        got = self.solved(stage, a, b, mb, m)
        return None if got is None else got[0]

    def initial_partitions(self, mb: int, m: int) -> list[list[int]]:
        """p_m: memory-balanced partitions under an initial strategy for every layer (§IV-B:
        Strategy_Init, PP_Partition_Init). Which strategy decides how much activations weigh
        against model states, so two are tried: the non-CKPT strategies with the least and
        the most memory. The second is the partition a DP+PP-only space would start from, so
        the full space never starts from a worse one than that limited space."""
        L = self.inputs.num_layers
        if self.pp == 1:
            return [[L]]
        probe = self.tables(0, 0, L, mb, m)
        per_layer = probe.fwd_bytes / min(self.pp, m) + probe.state_bytes
        usable = [j for j in range(len(self.strategies)) if math.isfinite(probe.objective[0, j])]
        candidates = [j for j in usable if not self.strategies[j].ckpt] or usable
        if not candidates:
            return [even_split(L, self.pp)]
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

    def opening(self, mb: int, m: int, even: bool, bmw: bool) -> tuple[_Evaluated | None, bool]:
        """The first plan of (P, m) and whether it is memory-balanced (Galvatron-Base's answer):
        the even split when `even`, else the best memory-balanced partition. Under BMW
        (`bmw`), where no memory-balanced partition fits, the even split: p_m balances memory
        under one assumed strategy per layer, so the even split (inside the space between p_m
        and p_t, Eq. 7) can fit where p_m does not once the layer DP picks the strategies."""
        L = self.inputs.num_layers
        if even:
            return self.evaluate(even_split(L, self.pp), mb, m), True
        ev = self.best_of(self.initial_partitions(mb, m), mb, m)
        if ev is None and bmw and self.pp > 1:
            return self.evaluate(even_split(L, self.pp), mb, m), False
        return ev, True

    def best_of(self, partitions, mb: int, m: int) -> _Evaluated | None:
        best = None
        for partition in partitions:
            ev = self.evaluate(partition, mb, m)
            if ev is not None and (best is None or ev.time < best.time):
                best = ev
        return best

    def evaluate(self, partition: Sequence[int], mb: int, m: int) -> _Evaluated | None:
        """Eq. 9 of `partition` with every stage's strategies from the layer DP.

        Each stage first minimises its own time. Eq. 9 only charges (m - 1) micro-batches of
        the slowest stage, so a faster stage then takes the plan with the quickest last
        micro-batch instead (e.g. SDP rather than DP: no gradient all-reduce to wait for)
        when that keeps its micro-batch within the slowest one's: the bottleneck stays,
        the sum of last micro-batches shrinks."""
        bounds, start = [], 0
        for n in partition:
            bounds.append((start, start + n))
            start += n
        got = [self.solved(stage, a, b, mb, m) for stage, (a, b) in enumerate(bounds)]
        if any(g is None for g in got):
            return None
        slowest = max(g[1] for g in got)
        for stage, (a, b) in enumerate(bounds):
            # sync >= nosync layer by layer, so a plan without gradient sync already has the
            # least last micro-batch its stage time allows
            if m > 1 and got[stage][1] < slowest and got[stage][2] > got[stage][1]:
                alt = self.solved(stage, a, b, mb, m, sync_only=True)
                if alt is not None and alt[1] <= slowest and alt[2] < got[stage][2]:
                    got[stage] = alt
        plans = [g[0] for g in got]
        nosync = [g[1] for g in got]
        sync = [g[2] for g in got]
        memory = [float(g[3]) for g in got]
        per_stage = [float((m - 1) * a + b) for a, b in zip(nosync, sync, strict=True)]
        total = pipeline_time(nosync, sync, m)
        if shares_cores(self.inputs, self.est.group * self.pp):
            works, idle = [], []
            for stage, ((a, b), p) in enumerate(zip(bounds, plans, strict=True)):
                tables = self.tables(stage, a, b, mb, m)
                works.append(stage_work(tables, p.chosen))
                idle.append(stage_sync_idle_s(tables, p.chosen, m))
            total = max(total, shared_host_time(self.inputs, works, self.est.group, m, idle))
        return _Evaluated(float(total), list(partition), plans, memory, per_stage)

    def _stage_time(self, mb: int, m: int) -> StageCost:
        """A stage's time with its layers' strategies re-solved by the layer DP (inf: none fit)."""

        def cost(stage: int, a: int, b: int) -> float:
            got = self.solved(stage, a, b, mb, m)
            return math.inf if got is None else (m - 1) * got[1] + got[2]

        return cost

    def _stage_memory(self, mb: int, m: int) -> StageCost:
        def cost(stage: int, a: int, b: int) -> float:
            got = self.solved(stage, a, b, mb, m)
            return math.inf if got is None else got[3]

        return cost

    def time_balanced(self, ev: _Evaluated, mb: int, m: int) -> list[int]:
        """p_t: the partition balancing stage times, each layer priced with the strategy it
        has in `ev` (for identical layers on one strategy, the even split)."""
        layer_time = np.concatenate(
            [
                (m - 1) * t.nosync[np.arange(len(p.chosen)), p.chosen]
                + t.sync[np.arange(len(p.chosen)), p.chosen]
                for t, p in zip(self._stage_tables(ev.partition, mb, m), ev.plans, strict=True)
            ]
        )
        return balanced_partition(
            len(layer_time), self.pp, prefix_cost(layer_time, [1.0] * self.pp)
        )

    def _stage_tables(self, partition: Sequence[int], mb: int, m: int) -> list[StageTables]:
        out, start = [], 0
        for stage, n in enumerate(partition):
            out.append(self.tables(stage, start, start + n, mb, m))
            start += n
        return out

    def starts(self, base: _Evaluated, mb: int, m: int) -> list[_Evaluated]:
        """Starting points of the adjustment: the memory-balanced plan `base`, and the
        time-balanced p_t and the even split when they fit (with re-solved strategies)."""
        out = [base]
        for p in (self.time_balanced(base, mb, m), even_split(self.inputs.num_layers, self.pp)):
            if all(p != ev.partition for ev in out):
                ev = self.evaluate(p, mb, m)
                if ev is not None:
                    out.append(ev)
        return out

    def adjust(
        self, starts: list[_Evaluated], mb: int, m: int, max_steps: int
    ) -> tuple[_Evaluated, int]:
        """Algorithm 2's queue: partitions move towards time balance while rules 1-3 hold.

        Every candidate partition is priced with its stages' strategies re-solved by the
        layer DP (Algorithm 2 runs Galvatron_Search on each new partition), so a layer that
        moves to a stage short of memory may make that stage checkpoint instead of being
        rejected for the memory its old strategy needed there.
        """
        best = min(starts, key=lambda ev: ev.time)
        queue = deque(starts)
        seen = {tuple(ev.partition) for ev in starts}
        steps = 0
        stage_time, stage_memory = self._stage_time(mb, m), self._stage_memory(mb, m)
        while queue and steps < max_steps:
            cur = queue.popleft()
            # Rule 3 caps memory at p_t's peak; never below the current partition's own peak.
            cap = max(max_stage(self.time_balanced(cur, mb, m), stage_memory), max(cur.memory))
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


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers split as evenly as possible; the last stages take the remainder (they keep the
    fewest micro-batches in flight under 1F1B)."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (i >= num_stages - extra) for i in range(num_stages)]


def _microbatch_counts(batch: int, pp: int, counts: tuple[int | None, int | None]) -> list[int]:
    """The micro-batch counts m tried for a global batch at PP degree P.

    By default every m dividing the batch, 1 to B: the whole range Eq. 9 can price (§IV-A1,
    Init_Microbatch_Num). Fewer micro-batches than stages keep fewer activations in flight,
    many small ones let wide TP run micro-batches of one sample with a small bubble; the
    doubling P, 2P, 4P, 8P of earlier versions reached neither (e.g. TP8 with 64 micro-batches
    of 1 at B = 64). `counts[0]` = k keeps only the first k of P, 2P, 4P, ... (the narrow range,
    for the paper's baseline rows); `counts[1]` fixes m."""
    limit, fixed = counts
    if fixed is not None:
        return [fixed] if batch % fixed == 0 else []
    if limit is None:
        return [m for m in range(1, batch + 1) if batch % m == 0]
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
    microbatch_counts: int | None = None,
    batch_window: int = 2,
    max_adjust_steps: int | None = None,
    stop_after_misses: int = 2,
    num_microbatches: int | None = None,
    even_partition: bool = False,
    progress: Progress | None = None,
) -> SearchResult:
    """Galvatron-BMW (or, with `bi_objective=False`, Galvatron-Base) search.

    `memory_budget` is bytes per GPU. Batch sizes: `global_batch_size` alone, an explicit
    `batch_sizes` list (tried in increasing order until `stop_after_misses` in a row fit
    nothing), or a search (doubling from `num_gpus`, then bisection to the largest
    batch that fits, then +-`batch_window` steps around the best). For each B and PP degree,
    every micro-batch count m dividing B is tried (1 to B), or with `microbatch_counts` = k
    only the first k of m = P, 2P, 4P, ... dividing B, or exactly `num_microbatches`.
    `even_partition=True` splits the layers evenly over the stages and skips the partition
    search (the layer DP still picks every layer's strategy): the space of engines without
    a partition search. `strategy_filter` restricts the layer strategies (the limited spaces
    of Table II). Raises PlanningError naming the smallest budget that fits when nothing
    does.
    """
    started = time.perf_counter()
    if cost_inputs.num_layers != len(model.layer_kinds()):
        raise PlanningError(
            f"cost inputs describe {cost_inputs.num_layers} layers but {model.name} has "
            f"{len(model.layer_kinds())}"
        )
    if memory_budget <= 0:
        raise PlanningError(
            f"memory budget must be positive, got {memory_budget / GiB:.3g} GiB per GPU"
        )
    if num_microbatches is not None and num_microbatches < 1:
        raise PlanningError(f"num_microbatches must be >= 1, got {num_microbatches}")
    counts = (microbatch_counts, num_microbatches)
    even = even_partition
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
        # Most promising first; a configuration whose Eq. 9 lower bound is no better than a
        # memory-balanced plan already found for this batch cannot win, nor change the
        # Galvatron-Base answer, and is skipped.
        bounds = [ps.time_bound(batch // m, m) for ps, m in configs]
        order = sorted(range(len(configs)), key=lambda i: bounds[i])
        found: list[tuple[float, _PipelineSearch, list[_Evaluated], int, int]] = []
        base_here = 0.0
        for i in order:
            ps, m = configs[i]
            mb = batch // m
            if batch / bounds[i] <= base_here:
                state["evaluated"] += 1
                tick()
                continue
            ev, balanced = ps.opening(mb, m, even, bi_objective)
            state["evaluated"] += 1
            tick()
            if ev is None:
                continue
            if balanced:
                base_here = max(base_here, batch / ev.time)
                best_base[0] = max(best_base[0], base_here)
            starts = [ev]
            if bi_objective and not even and ps.pp > 1:
                starts = ps.starts(ev, mb, m)
                state["evaluated"] += len(starts) - 1
            top = min(starts, key=lambda e: e.time)
            found.append((batch / top.time, ps, starts, mb, m))
        if not found:
            return False
        if bi_objective and not even:
            # Algorithm 2 on every (P, m) that fits, not only the best few starts: with every
            # micro-batch count in play the best starts crowd around one degree's counts while
            # another degree's partition moves win more, and the stage plans it re-solves are
            # cached, so this costs little.
            for i, (_, ps, starts, mb, m) in enumerate(found):
                if ps.pp > 1:
                    adjusted, steps = ps.adjust(starts, mb, m, steps_limit)
                    state["evaluated"] += steps
                    found[i] = (batch / adjusted.time, ps, [adjusted], mb, m)
        tput, ps, starts, mb, m = max(found, key=lambda f: f[0])
        ev = min(starts, key=lambda e: e.time)
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
            _infeasible_message(
                model,
                searches,
                smallest,
                memory_budget,
                counts,
                memory_bins,
                even,
                bi_objective,
            )
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


def _least_memory_guess(
    searches: list[_PipelineSearch], batch: int, counts: tuple[int | None, int | None]
) -> float:
    """Where the bisection of `smallest_budget` starts: the least Eq. 2 peak any (P, m)
    reaches at `batch` with each layer on its own least-memory strategy and the first
    memory-balanced partition (inf: no strategy splits the batch). Only a guess: Eq. 2's
    backward term is a maximum over layers and the layer DP may pick another partition, so
    plans needing less can exist; it is never reported as the least."""
    best = math.inf
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
            best = min(best, peak)
    return best


def _fitting_config(
    searches: list[_PipelineSearch],
    batch: int,
    budget: float,
    counts: tuple[int | None, int | None],
    bins: int,
    modes: tuple[bool, bool],
) -> str | None:
    """The first (P, m) whose opening plan of `batch` (`_PipelineSearch.opening` with
    `modes` = (even, bmw)) fits `budget`, in words, or None when none does. The search fits at
    this budget exactly when this finds one (it prices these plans first and its other steps
    only start from plans that fit)."""
    for template in searches:
        ps = _PipelineSearch(template.inputs, template.strategies, budget, bins)
        for m in _microbatch_counts(batch, ps.pp, counts):
            mb = batch // m
            if ps.opening(mb, m, *modes)[0] is not None:
                return f"PP={ps.pp}, {m} micro-batches of {mb}"
    return None


def smallest_budget(
    searches: list[_PipelineSearch],
    batch: int,
    counts: tuple[int | None, int | None],
    bins: int,
    modes: tuple[bool, bool] = (False, True),
) -> tuple[float, str] | None:
    """The least memory budget (to 0.01 GiB) at which some plan of `batch` fits and that
    plan's (P, m) in words, found by bisection from `_least_memory_guess`; None when no
    strategy can split the batch at all."""
    guess = _least_memory_guess(searches, batch, counts)
    if not math.isfinite(guess):
        return None
    step = 0.01 * GiB

    def fits(k: int) -> str | None:
        return _fitting_config(searches, batch, k * step, counts, bins, modes)

    # In steps of 0.01 GiB; lo always fails and hi always fits, so the answer is minimal on
    # that grid even where rounding memory into budget-sized bins is not monotone.
    lo = math.floor(guess / step)
    while lo > 0 and fits(lo):
        lo //= 2
    hi = max(lo + 1, math.ceil(guess * 1.25 / step))
    where = fits(hi)
    while where is None:
        lo, hi = hi, hi * 2
        if hi * step > 1e6 * GiB:
            return None
        where = fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = fits(mid)
        if got is not None:
            hi, where = mid, got
        else:
            lo = mid
    return hi * step, where


def _infeasible_message(
    model: ModelSpec,
    searches: list[_PipelineSearch],
    batch: int,
    budget: float,
    counts: tuple[int | None, int | None],
    bins: int,
    even: bool,
    bmw: bool,
) -> str:
    smallest = smallest_budget(searches, batch, counts, bins, (even, bmw))
    if smallest is None:
        return (
            f"{model.name}: no strategy can split a global batch of {batch} "
            f"(each layer's micro-batch must divide by its data-parallel degree)"
        )
    need, where = smallest
    return (
        f"{model.name} does not fit in {budget / GiB:.2f} GiB per GPU at global batch {batch}: "
        f"the smallest budget that works is {need / GiB:.2f} GiB ({where}; "
        f"--memory-limit-gib {need / GiB:.2f})"
    )


@dataclass
class PlanPrice:
    """A given plan priced by the estimator (§V, Eq. 2 and Eq. 9)."""

    throughput: float  # samples / s
    iteration_time_s: float
    stage_time_s: list[float]  # per stage: (m - 1) * one micro-batch + the last one
    stage_memory_bytes: list[float]  # Eq. 2 peak per stage, end layers included

    def fits(self, memory_budget: float) -> bool:
        return max(self.stage_memory_bytes) <= memory_budget


def price_plan(
    cost_inputs: CostInputs,
    strategies: Sequence[LayerStrategy],
    partition: Sequence[int],
    num_microbatches: int,
    global_batch_size: int,
) -> PlanPrice:
    """Price a plan (a strategy per layer, layers per stage, micro-batch count, global batch)
    with the same estimator the search uses: a plan the search returns prices to its
    reported throughput, and another engine's plan can be compared on equal terms. Raises
    PlanningError when the plan does not describe the model or cannot run (a micro-batch
    not divisible by a layer's data-parallel degree, a strategy the inputs do not support)."""
    L = cost_inputs.num_layers
    if len(strategies) != L or sum(partition) != L or min(partition, default=0) < 1:
        raise PlanningError(
            f"plan does not describe {L} layers: {len(strategies)} strategies, partition "
            f"{list(partition)}"
        )
    pps = {s.pp for s in strategies}
    if pps != {len(partition)}:
        raise PlanningError(f"strategies of PP {sorted(pps)} for {len(partition)} stages")
    m = num_microbatches
    if m < 1 or global_batch_size % m:
        raise PlanningError(f"{m} micro-batches do not split a global batch of {global_batch_size}")
    mb = global_batch_size // m
    unique = list(dict.fromkeys(strategies))
    bad = [str(s) for s in unique if not cost_inputs.supports(s) or mb % s.data_degree]
    if bad:
        raise PlanningError(f"strategies {bad} cannot run micro-batches of {mb} on these inputs")
    index = {s: j for j, s in enumerate(unique)}
    est = Estimator(cost_inputs, unique)
    nosync, sync, memory, works, idle, start = [], [], [], [], [], 0
    for stage, n in enumerate(partition):
        tables = est.stage_tables(range(start, start + n), stage, mb, m)
        chosen = [index[s] for s in strategies[start : start + n]]
        a, b = stage_times(tables, chosen)
        nosync.append(a)
        sync.append(b)
        memory.append(float(peak_memory(tables, chosen)))
        works.append(stage_work(tables, chosen))
        idle.append(stage_sync_idle_s(tables, chosen, m))
        start += n
    per_stage = [float((m - 1) * a + b) for a, b in zip(nosync, sync, strict=True)]
    total = max(
        float(pipeline_time(nosync, sync, m)),
        shared_host_time(cost_inputs, works, est.group, m, idle),
    )
    return PlanPrice(global_batch_size / total, total, per_stage, memory)


def balance_partitions(
    cost_inputs: CostInputs,
    strategies: Sequence[LayerStrategy],
    global_batch_size: int,
    num_microbatches: int,
) -> tuple[list[int], list[int]]:
    """(p_m, p_t) of §IV-B for one PP degree, without a memory budget: the memory-balanced
    partition Algorithm 2 starts from (PP_Partition_Init, the first of `initial_partitions`)
    and the time-balanced partition of its plan (rule 3's reference), the layers free to take
    any of `strategies` (all of one PP degree). Shows what the bi-objective search trades
    between (Fig. 4)."""
    m = num_microbatches
    if m < 1 or global_batch_size % m:
        raise PlanningError(f"{m} micro-batches do not split a global batch of {global_batch_size}")
    mb = global_batch_size // m
    ps = _PipelineSearch(cost_inputs, list(strategies), float(2**62), 256)
    p_m = ps.initial_partitions(mb, m)[0]
    ev = ps.evaluate(p_m, mb, m)
    if ev is None:
        raise PlanningError(f"no strategy runs micro-batches of {mb} on these inputs")
    return p_m, ps.time_balanced(ev, mb, m)
