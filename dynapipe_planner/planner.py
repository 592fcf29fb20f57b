"""Plan one training iteration end to end (DynaPipe seed dynapipe.txt §3-§7).

lengths -> micro-batches (DP, or a baseline) -> replicas (Karmarkar-Karp, then rebalanced by
scheduled makespan) -> per-pipeline schedule (adaptive or 1F1B, with micro-batch ordering) ->
communication plan -> ExecutionPlan.
Dynamic recomputation (§7): recompute modes are tried from cheapest to most memory-saving. The
paper keeps the first mode that fits; we also try the next mode while the best plan so far is
memory-bound (peak above `memory_pressure` of the limit on some stage) and pipelines poorly
(bubble fraction above `bubble_tolerance`), since only then can cheaper activations buy time
back, and keep the fastest. Baselines get the grid search the paper gives
them (§8): every candidate micro-batch size or token budget is planned and the fastest kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, cached_property, partial
from typing import Any, NamedTuple, Protocol

import numpy as np

from .comm import plan_communication
from .cost.analytic import RECOMPUTE_CHOICES, RECOMPUTE_MODES
from .cost.table import PipelineCosts, mix_stages
from .errors import CostModelError, PlanningError
from .microbatch.baselines import (
    Group,
    groups_from_indices,
    packed_group,
    packed_rows_groups,
    packing_bins,
    padding_groups,
    rows_up_to,
    token_budget_groups,
    trimmed_rows_groups,
    trimmed_rows_shapes,
)
from .microbatch.dp import DEFAULT_WORK_BUDGET, dynamic_microbatches, validate_lengths
from .microbatch.ordering import order_samples
from .microbatch.replicas import karmarkar_karp
from .plan import ExecutionPlan, MicroBatch, RankPlan
from .schedule import (
    ScheduleChoice,
    makespan_lower_bound,
    memory_time_lower_bound,
    search_schedule,
)
from .schedule.balance import rebalance_replicas, unbalanced

BATCHING = ("dynamic", "packing", "padding", "token-budget")
# A candidate's replicas are rebalanced by makespan only while each holds at most this many
# micro-batches: beyond, the work split is fine-grained, gaps are a few percent, and each move
# costs full schedule searches over hundreds of micro-batches (planning time is the budget).
REBALANCE_MAX_MICROBATCHES = 64
SCHEDULES = ("adaptive", "1f1b")
RECOMPUTE = RECOMPUTE_CHOICES


class CostModel(Protocol):
    """What the planner needs from a cost model (analytic or profiled)."""

    def pipeline_costs(self, recompute: str = "none", **grid_hints: int) -> PipelineCosts: ...

    def recompute_modes(self) -> list[str]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PlannerConfig:
    """Choices a user makes once per job; everything else is decided per iteration."""

    batching: str = "dynamic"
    schedule: str = "adaptive"
    recompute: str = "auto"
    # Fixed modes per stage (a HexiScale plan's, `hetero.cost` recompute="auto"); when given
    # they replace `recompute` and every plan runs stage j in mode stage_recompute[j].
    stage_recompute: tuple[str, ...] = ()
    order: str = "sort"
    dtype: str = "bf16"
    num_replicas: int = 1
    bucket_rel: float = 1e-3
    dp_work_budget: int = DEFAULT_WORK_BUDGET
    num_clusters: int = 4
    micro_batch_size: int = 0
    token_budget: int = 0
    max_seqlen: int = 0
    memory_pressure: float = 0.9
    bubble_tolerance: float = 0.15
    # DynaPipe's micro-batches may be packed rows (THD on the runtime; issue 21); off for a
    # program whose forward step cannot take sample boundaries (`cu_seqlens`).
    packed_rows: bool = True
    # Also run the DP with packed rows in its search (issue 21: each group priced and run as
    # packed rows while it partitions) and keep the faster plan. Off by default: it costs a
    # second, slower DP per recomputation mode, and wins rarely and little, because on
    # DynaPipe's objective cheaper packed groups merge into fewer micro-batches, which
    # pipeline worse (benchmarks/plan_quality.py measures both).
    dp_packing: bool = False
    # Extra caps on micro-batches in flight for the adaptive schedule's search (None: memory
    # alone controls injection, Alg. 1). Caps rarely win and each multiplies the search.
    injection_caps: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("batching", self.batching, BATCHING),
            ("schedule", self.schedule, SCHEDULES),
            ("recompute", self.recompute, RECOMPUTE),
        ):
            if value not in allowed:
                raise PlanningError(f"{name} must be one of {allowed}, got {value!r}")
        for j, mode in enumerate(self.stage_recompute):
            if mode not in RECOMPUTE_MODES:
                raise PlanningError(
                    f"stage_recompute[{j}] must be one of {RECOMPUTE_MODES}, got {mode!r}"
                )


@dataclass
class Candidate:
    """Priced and scheduled micro-batches: one option the planner may pick."""

    groups: list[Group]
    costs: PipelineCosts
    replicas: list[list[int]]
    choices: list[ScheduleChoice]
    peak_memory: np.ndarray
    dp_passes: int = 0
    budget_exhausted: bool = False
    label: str = ""
    makespan: float = field(init=False)
    bubble: float = field(init=False)

    def __post_init__(self) -> None:
        self.makespan = max(c.timeline.makespan for c in self.choices)
        busy = sum(float(np.sum(c.timeline.busy)) for c in self.choices)
        idle = 1.0 - busy / (self.costs.num_stages * len(self.choices) * self.makespan)
        self.bubble = max(0.0, idle)  # a one-stage pipeline rounds to -1e-16


class _Shapes(NamedTuple):
    """What pricing reads of micro-batches: each one's rows, padded length, target length and
    the attention (tokens^2) its packed rows skip."""

    rows: np.ndarray
    seq: np.ndarray
    tgt: np.ndarray
    saved: np.ndarray


@dataclass
class _Made:
    """One candidate's micro-batches, their `_Shapes`, the DP's passes and whether its budget
    ran out. Candidate thunks are cached, so a candidate priced in every recompute mode is
    built and measured once; one made from its shapes (`_trimmed_rows`) builds its `Group`s
    only if its bounds get it scheduled."""

    build: Callable[[], list[Group]]
    shapes: _Shapes
    passes: int = 0
    exhausted: bool = False

    @classmethod
    def of(cls, groups: list[Group], passes: int = 0, exhausted: bool = False) -> _Made:
        return cls(lambda: groups, _group_shapes(groups), passes, exhausted)

    @cached_property
    def groups(self) -> list[Group]:
        return self.build()


class IterationPlanner:
    """Turns each global batch's sample lengths into an `ExecutionPlan`."""

    def __init__(self, cost_model: CostModel, num_stages: int, config: PlannerConfig) -> None:
        if config.stage_recompute and len(config.stage_recompute) != num_stages:
            raise PlanningError(
                f"stage_recompute lists {len(config.stage_recompute)} modes for {num_stages} stages"
            )
        self.cost_model = cost_model
        self.num_stages = num_stages
        self.config = config
        self._tables: dict[tuple, PipelineCosts] = {}

    def costs(
        self, recompute: str | Sequence[str], lengths: np.ndarray, longest: int = 0
    ) -> PipelineCosts:
        """Cost tables whose grid covers this batch (and rows of `longest` tokens, for packed
        micro-batches longer than any sample), cached by power-of-two bounds; `recompute` is
        one mode or one per stage (`mix_stages`)."""
        src = lengths if lengths.ndim == 1 else lengths[:, 0]
        hints = {
            "max_samples": _pow2(len(lengths)),
            "max_seqlen": _pow2(max(int(src.max()), longest)),
            "max_tgt_seqlen": _pow2(int(lengths[:, 1].max())) if lengths.ndim == 2 else 0,
        }
        mode = recompute if isinstance(recompute, str) else tuple(recompute)
        key = (mode, *hints.values())
        if key not in self._tables:
            if isinstance(mode, str):
                self._tables[key] = self.cost_model.pipeline_costs(mode, **hints)
            else:
                self._tables[key] = mix_stages([self.costs(m, lengths, longest) for m in mode])
        return self._tables[key]

    def costs_of(self, plan: ExecutionPlan, lengths: np.ndarray) -> PipelineCosts:
        """The cost tables `plan` (of this batch) was priced with, to simulate or bound it."""
        longest = max(m.seqlen for m in plan.microbatches)
        return self.costs(plan.stats["recompute"], lengths, longest)

    def plan(
        self,
        lengths: np.ndarray,
        sample_ids: np.ndarray | None = None,
        groups: list[Group] | None = None,
    ) -> ExecutionPlan:
        """Plan one global batch; `groups` fixes the micro-batches (indices into `lengths`),
        leaving the planner the replica split, schedule, recomputation and communication."""
        started = time.perf_counter()
        ids = np.arange(len(lengths)) if sample_ids is None else np.asarray(sample_ids)
        if len(ids) != len(lengths):
            raise PlanningError(f"{len(ids)} sample ids for {len(lengths)} lengths")
        lengths = validate_lengths(lengths, ids)
        best = self._choose(lengths, ids, groups)
        return self._assemble(best, lengths, ids, time.perf_counter() - started)

    def predict(self, lengths: np.ndarray, groups: list[Group] | None = None) -> float:
        """The predicted iteration time `plan` would report, without building the instruction
        lists (for studies that price many batches)."""
        ids = np.arange(len(lengths))
        return self._choose(validate_lengths(lengths, ids), ids, groups).makespan

    def _choose(self, lengths: np.ndarray, ids: np.ndarray, groups: list[Group] | None):
        """The fastest candidate over recomputation modes, its replicas rebalanced."""
        order = order_samples(lengths, self.config.order)  # shared by every candidate below
        if groups is not None:
            longest = max(g.seqlen for g in groups)
        else:
            packs = self.config.batching in ("packing", "dynamic")
            longest = self.config.max_seqlen if packs else 0
        best, failures = None, {}
        # A mode whose DP micro-batches fit only one at a time ("fits alone") is tried after
        # the modes where they fit as 1F1B holds them, against the best plan so far, so its
        # schedules are searched only where its bounds can beat that plan: such micro-batches
        # cannot overlap, and their plan is rarely the fastest (issue 21).
        deferred: list = []
        fallback = groups is None and self._dp_fallback()
        for mode in self._recompute_modes():
            try:
                costs = self.costs(mode, lengths, longest)
                cand = self._best_candidate(lengths, ids, order, costs, groups)
            except CostModelError:
                raise
            except PlanningError as e:
                failures[str(mode)] = f"recompute={mode}: {e}"
                if fallback:
                    deferred.append(mode)
                continue
            if best is None or cand.makespan < best.makespan:
                best = cand
            if self._good_enough(best):
                break
        for mode in deferred:
            to_beat = best.makespan if best is not None else math.inf
            try:
                costs = self.costs(mode, lengths, longest)
                cand = self._best_candidate(lengths, ids, order, costs, None, True, to_beat)
            except CostModelError:
                raise
            except PlanningError as e:
                failures[str(mode)] = f"recompute={mode}: {e}"
                continue
            if cand is not None and (best is None or cand.makespan < best.makespan):
                best = cand
        if best is None:
            raise PlanningError("no feasible plan. " + " | ".join(failures.values()))
        if groups is None and self._packs_dynamic(lengths):
            best = self._packed_if_faster(best, lengths, longest)
        return best

    def _good_enough(self, best: Candidate) -> bool:
        """Whether later recompute modes may stop: the plan is not memory-bound (peak below
        `memory_pressure` of the limit everywhere) or pipelines well (small bubble)."""
        limit = best.costs.memory_limit * self.config.memory_pressure
        return (
            bool(np.all(best.peak_memory <= limit)) or best.bubble <= self.config.bubble_tolerance
        )

    def _dp_fallback(self) -> bool:
        """Whether the DP may fall back to micro-batches that fit only alone (§4: the adaptive
        schedule needs only that; 1F1B holds C - j on stage j)."""
        return (
            self.config.batching == "dynamic"
            and self.config.schedule == "adaptive"
            and self.num_stages > 1
        )

    def _rebalanced(self, best: Candidate) -> Candidate:
        """`best` with its replicas rebalanced by makespan when they are uneven (and few)."""
        spans = [c.timeline.makespan for c in best.choices]
        if unbalanced(spans) and max(map(len, best.replicas)) <= REBALANCE_MAX_MICROBATCHES:
            rebalanced = self._schedule(best.groups, best.costs, rebalanced_from=best)
            rebalanced.dp_passes, rebalanced.label = best.dp_passes, best.label
            rebalanced.budget_exhausted = best.budget_exhausted
            return rebalanced
        return best

    def _recompute_modes(self) -> list[str | tuple[str, ...]]:
        available = self.cost_model.recompute_modes()
        fixed = self.config.stage_recompute
        if fixed:
            missing = sorted(set(fixed) - set(available))
            if missing:
                raise PlanningError(f"cost model has no tables for recompute={missing}")
            return [fixed]
        wanted = available if self.config.recompute == "auto" else [self.config.recompute]
        missing = [m for m in wanted if m not in available]
        if missing or not wanted:
            raise PlanningError(f"cost model has no tables for recompute={missing or wanted}")
        return wanted

    # ---- candidates ------------------------------------------------------------------
    def _best_candidate(
        self,
        lengths: np.ndarray,
        ids: np.ndarray,
        order: np.ndarray,
        costs: PipelineCosts,
        groups: list[Group] | None = None,
        alone: bool = False,
        to_beat: float = math.inf,
    ) -> Candidate | None:
        """The fastest option under `costs`; None when every option was pruned, its bounds
        no better than `to_beat`."""
        options = (
            [("given", partial(_without_dp, list, groups))]
            if groups is not None
            else self._candidate_groups(lengths, ids, order, costs, alone)
        )
        best, errors = self._fastest(options, costs, to_beat)
        if best is None and (errors or to_beat == math.inf):
            raise PlanningError("; ".join(errors) or "no candidate micro-batching")
        return best

    def _fastest(
        self, options, costs: PipelineCosts, to_beat: float = math.inf
    ) -> tuple[Candidate | None, list[str]]:
        """The fastest of `options` ((label, thunk) pairs) under `costs` (None if none was
        scheduled), and why the others failed; each is compared with its replicas rebalanced
        where their mean makespan is below the best so far (rebalancing evens them out at
        best). An option whose work bound cannot beat the best so far, or `to_beat`, is not
        scheduled (no schedule of it, over any split into the replicas, could)."""
        best, errors = None, []
        for label, make_groups in options:
            try:
                made = make_groups()
                bar = min(to_beat, best.makespan) if best is not None else to_beat
                if _work_bound(made.shapes, costs, self.config) >= bar:
                    continue  # cannot beat the best so far: skip its schedule search
                cand = self._schedule(made.groups, costs, shapes=made.shapes)
            except CostModelError as e:
                raise CostModelError(f"candidate {label}: {e}") from None
            except PlanningError as e:
                errors.append(f"{label}: {e}")
                continue
            cand.dp_passes, cand.budget_exhausted, cand.label = made.passes, made.exhausted, label
            spans = [c.timeline.makespan for c in cand.choices]
            if best is None or sum(spans) / len(spans) < best.makespan:
                cand = self._rebalanced(cand)  # evened out, its replicas might beat the best
            if best is None or cand.makespan < best.makespan:
                best = cand
        return best, errors

    def _candidate_groups(
        self,
        lengths: np.ndarray,
        ids: np.ndarray,
        order: np.ndarray,
        costs: PipelineCosts,
        alone: bool = False,
    ):
        """(label, thunk) pairs; each thunk returns the candidate's `_Made` or raises.
        `alone`: the DP's micro-batches need only fit alone."""
        cfg = self.config
        if cfg.batching == "dynamic":
            dp = cache(partial(self._dynamic_groups, lengths, ids, order, costs, alone, False))
            yield "dp", dp
            if self._packs_dynamic(lengths):
                yield "dp, packed rows", lambda: _pack_where_cheaper(dp(), lengths, costs)
                if cfg.dp_packing:
                    packing_dp = partial(self._dynamic_groups, lengths, ids, order, costs, alone)
                    yield "dp over packed rows", partial(packing_dp, True)
        elif cfg.batching == "padding":
            for size in [cfg.micro_batch_size] if cfg.micro_batch_size else _pow2_range(1, 256):
                yield f"padding(mbs={size})", partial(_without_dp, padding_groups, lengths, size)
        elif cfg.batching == "packing":
            yield from self._packing_candidates(lengths)
        else:
            longest = int(lengths.sum(axis=1).max() if lengths.ndim == 2 else lengths.max())
            budgets = [cfg.token_budget] if cfg.token_budget else _budget_grid(longest)
            for budget in budgets:
                yield (
                    f"token-budget({budget})",
                    partial(_without_dp, token_budget_groups, lengths, budget, order),
                )

    def _packs_dynamic(self, lengths: np.ndarray) -> bool:
        """Whether DynaPipe's plan may hold packed rows (decoder-only lengths, switched on)."""
        return self.config.batching == "dynamic" and self.config.packed_rows and lengths.ndim == 1

    def _packing_candidates(self, lengths: np.ndarray):
        """(label, thunk) of rows packed to the longest length, each micro-batch size of the
        grid (or the fixed one); the rows are packed once."""
        cfg = self.config
        max_len = cfg.max_seqlen or int(lengths.max())
        bins = cache(partial(packing_bins, lengths, max_len))
        fixed = cfg.micro_batch_size if cfg.batching == "packing" else 0
        for size in [fixed] if fixed else _pow2_range(1, 64):
            # Cached: `_packed_if_faster` prices each size's rows in every recomputation mode.
            yield f"packing(mbs={size})", cache(partial(_packed_rows, bins, lengths, max_len, size))

    def _shorter_rows_candidates(self, lengths: np.ndarray):
        """(label, thunk) of DynaPipe's own packed rows (`rows_up_to`) at each length of
        `packed_row_lengths`, one or two rows a micro-batch: shorter rows are there to give more
        micro-batches (larger ones are the baseline's rows' business; each size more costs
        planning time: all sizes up to 64 made the plan 3x slower)."""
        for row in packed_row_lengths(self.config.max_seqlen or int(lengths.max())):
            rows = cache(partial(rows_up_to, lengths, row))
            for size in (1, 2):
                # Cached: `_packed_if_faster` prices each size's rows in every recompute mode.
                yield (
                    f"rows up to {row}(mbs={size})",
                    cache(partial(_trimmed_rows, rows, lengths, size)),
                )

    def _packed_if_faster(self, best: Candidate, lengths: np.ndarray, longest: int) -> Candidate:
        """DynaPipe's plan, or rows packed first-fit-decreasing when they are predicted faster:
        in each recomputation mode the fastest row length and micro-batch size, rebalanced as
        the baseline's would be. The baseline's own rows (`max_seqlen`) are among them, so the
        plan is never slower than packing (issue 21); shorter rows (`_shorter_rows_candidates`)
        cut the pipeline's bubble at packing's work, where the DP's micro-batches of sorted
        samples pay padding and more micro-batches (issue 32). Inside the DP's plan each
        micro-batch is already padded or packed, whichever is cheaper."""
        candidates = [*self._packing_candidates(lengths), *self._shorter_rows_candidates(lengths)]
        for mode in self._recompute_modes():
            try:
                costs = self.costs(mode, lengths, longest)
            except PlanningError:
                continue
            fastest, _ = self._fastest(candidates, costs, to_beat=best.makespan)
            if fastest is not None and fastest.makespan < best.makespan:
                best = fastest
        return best

    def _dynamic_groups(
        self,
        lengths: np.ndarray,
        ids: np.ndarray,
        order: np.ndarray,
        costs: PipelineCosts,
        alone: bool,
        packed: bool,
    ) -> _Made:
        """DP micro-batches under the schedule's memory rule (§4 "Limit memory consumption"),
        the DP's passes, and whether its wall-clock budget ran out (its partition is then the
        best found so far, not the optimum). `packed`: packed rows in the DP's search, each
        micro-batch run packed exactly as the DP priced it (`packed_group` at the DP's row
        length, see `microbatch.dp`).

        1F1B keeps up to C - j micro-batches on stage j. The adaptive schedule needs only each
        micro-batch to fit alone (`alone`), but micro-batches that fill memory alone cannot
        overlap, so the planner asks for that rule only when some sample needs it
        (`_choose`).
        """
        cfg, c = self.config, self.num_stages
        inflight = np.ones(c) if alone else np.arange(c, 0, -1, dtype=np.float64)
        mb = dynamic_microbatches(
            lengths,
            costs,
            inflight=inflight,
            num_replicas=cfg.num_replicas,
            order=order,
            bucket_rel=cfg.bucket_rel,
            work_budget=cfg.dp_work_budget,
            sample_ids=ids,
            packed_rows=packed,
        )
        index_lists = split_for_replicas(list(mb.microbatches), cfg.num_replicas)
        groups = groups_from_indices(lengths, index_lists)
        if mb.row_lengths:
            # Halves from `split_for_replicas` pack into rows of their own longest sample.
            rows = mb.row_lengths if len(index_lists) == len(mb.microbatches) else [0] * len(groups)
            groups = [
                packed_group(replace(g, seqlen=max(g.seqlen, r)), lengths)
                for g, r in zip(groups, rows, strict=True)
            ]
        return _Made.of(groups, mb.passes, mb.budget_exhausted)

    def _schedule(
        self,
        groups: list[Group],
        costs: PipelineCosts,
        rebalanced_from: Candidate | None = None,
        shapes: _Shapes | None = None,
    ) -> Candidate:
        cfg = self.config
        shapes = _group_shapes(groups) if shapes is None else shapes
        rows, seq, tgt = shapes.rows, shapes.seq, shapes.tgt
        fwd, bwd, act, tra = _priced(shapes, costs)
        avail = costs.available_memory()
        alone = act + tra
        bad = np.flatnonzero(~np.isfinite(fwd).all(axis=1) | (alone > avail).any(axis=1))
        if len(bad):
            g = groups[bad[0]]
            raise PlanningError(
                f"micro-batch of {g.num_rows} rows x {g.seqlen} tokens does not fit in memory "
                f"or beyond the cost table (recompute={costs.recompute})"
            )
        times = (fwd + bwd).max(axis=1)

        def schedule(members: tuple[int, ...]) -> ScheduleChoice:
            m = np.array(members)
            comm = costs.p2p_times(rows[m], seq[m], tgt[m])
            # Stored activations plus the working memory of the op that runs fit the memory.
            return search_schedule(
                fwd[m],
                bwd[m],
                act[m],
                avail,
                comm,
                comm,
                kind=cfg.schedule,
                num_clusters=cfg.num_clusters,
                inflight_options=cfg.injection_caps,
                transient=tra[m],
            )

        replicas, choices = self._split_replicas(times, schedule, len(groups), rebalanced_from)
        peak = np.zeros(self.num_stages)
        for choice in choices:
            peak = np.maximum(peak, costs.static + choice.peak)
        return Candidate(groups, costs, replicas, choices, peak)

    def _split_replicas(
        self,
        times: np.ndarray,
        schedule: Callable[[tuple[int, ...]], ScheduleChoice],
        num_groups: int,
        rebalanced_from: Candidate | None,
    ) -> tuple[list[list[int]], list[ScheduleChoice]]:
        """Micro-batches per replica and each replica's schedule (§4 "Balance data parallel
        model replicas"): Karmarkar-Karp balances work. Given `rebalanced_from` (the same
        groups, already split that way and scheduled), micro-batches then move off a replica
        whose long micro-batch makes it finish last (`rebalance_replicas`), priced by the same
        schedule search, so the slowest replica never gets slower."""
        start = karmarkar_karp(times, self.config.num_replicas)
        if not all(start):
            raise PlanningError(
                f"{num_groups} micro-batches cannot feed {self.config.num_replicas} replicas"
            )
        priced: dict[tuple[int, ...], ScheduleChoice | PlanningError] = {}
        if rebalanced_from is not None:
            known = zip(rebalanced_from.replicas, rebalanced_from.choices, strict=True)
            priced.update((tuple(members), c) for members, c in known)

        def choice(members: tuple[int, ...]) -> ScheduleChoice | PlanningError:
            if members not in priced:
                try:
                    priced[members] = schedule(members)
                except PlanningError as err:
                    priced[members] = err
            return priced[members]

        def makespan(members: tuple[int, ...]) -> float:
            c = choice(members)
            return math.inf if isinstance(c, PlanningError) else c.timeline.makespan

        split = (
            rebalance_replicas(start, lambda _, m: makespan(m), times) if rebalanced_from else start
        )
        choices = [choice(tuple(members)) for members in split]
        for c in choices:
            if isinstance(c, PlanningError):
                raise c
        return [list(members) for members in split], choices

    # ---- assembly --------------------------------------------------------------------
    def _assemble(self, cand: Candidate, lengths, ids, planning_s: float) -> ExecutionPlan:
        cfg, c, costs = self.config, self.num_stages, cand.costs
        microbatches, ranks, next_id = [], [], 0
        for r, (members, choice) in enumerate(zip(cand.replicas, cand.choices, strict=True)):
            mb_ids = list(range(next_id, next_id + len(members)))
            next_id += len(members)
            shapes = []
            for k, g_index in enumerate(members):
                g = cand.groups[g_index]
                rows = [len(row) for row in g.rows] if g.rows is not None else []
                samples = [int(ids[i]) for i in g.samples]
                microbatches.append(
                    MicroBatch(
                        mb_ids[k], r, samples, g.seqlen, g.tgt_seqlen, rows, g.attention_saved
                    )
                )
                shapes.append(
                    [
                        costs.boundary_shape(j, g.num_rows, g.seqlen, g.tgt_seqlen)
                        for j in range(c - 1)
                    ]
                )
            tl = choice.timeline
            programs = plan_communication(
                choice.orders, tl.start, tl.end, mb_ids, shapes, cfg.dtype
            )
            ranks.extend(RankPlan(r, j, programs[j]) for j in range(c))
        real = int(lengths.sum())
        padded = sum(g.num_rows * (g.seqlen + g.tgt_seqlen) for g in cand.groups)
        stats = {
            "predicted_iteration_s": cand.makespan,
            "tokens": real,
            "tokens_per_s": real / cand.makespan,
            "padding_efficiency": real / padded,
            "peak_memory_bytes": [int(x) for x in cand.peak_memory],
            "bubble_fraction": cand.bubble,
            "num_microbatches": len(cand.groups),
            "recompute": costs.recompute
            if isinstance(costs.recompute, str)
            else list(costs.recompute),
            "batching": cand.label,
            "schedule": cfg.schedule,
            "dp_passes": cand.dp_passes,
            "budget_exhausted": cand.budget_exhausted,
            "planning_time_s": planning_s,
        }
        return ExecutionPlan(
            c,
            cfg.num_replicas,
            microbatches,
            ranks,
            stats,
            {"cost_model": self.cost_model.describe()},
        )


def _group_shapes(groups: list[Group]) -> _Shapes:
    shape = np.array([(g.num_rows, g.seqlen, g.tgt_seqlen) for g in groups], dtype=np.int64)
    saved = np.array([g.attention_saved for g in groups], dtype=np.float64)
    return _Shapes(*shape.reshape(-1, 3).T, saved)


def _priced(shapes: _Shapes, costs: PipelineCosts) -> tuple[np.ndarray, ...]:
    """[micro-batch, stage] forward, backward, stored-activation and transient costs; packed
    rows' attention saving is priced in (`PipelineCosts.packed_times`). A time below zero or
    NaN is the cost model's fault: `CostModelError`, naming the micro-batch."""
    rows, seq, tgt, saved = shapes
    # Micro-batches share few shapes (the packing baseline's all but one): each is priced once.
    key = (rows * (int(seq.max(initial=0)) + 1) + seq) * (int(tgt.max(initial=0)) + 1) + tgt
    _, first, which = np.unique(key, return_index=True, return_inverse=True)
    priced = costs.stage_costs_many(rows[first], seq[first], tgt[first])
    fwd, bwd, act, tra = (table[which] for table in priced)
    if saved.any():
        fwd, bwd = costs.packed_times(fwd, bwd, rows, seq, saved)
    bad = ~(fwd >= 0) | ~(bwd >= 0)  # NaN fails both comparisons
    if bad.any():
        k, j = (int(x[0]) for x in np.nonzero(bad))
        raise CostModelError(
            f"micro-batch {k}, {rows[k]} rows of {seq[k]} tokens, is priced forward "
            f"{fwd[k, j]:.4g} s, backward {bwd[k, j]:.4g} s on stage {j} (attention skipped "
            f"{saved[k]:.4g} tokens^2): the cost model is invalid there"
        )
    return fwd, bwd, act, tra


def _stage_work(shapes: _Shapes, costs: PipelineCosts) -> np.ndarray:
    """[micro-batch, stage] forward + backward time."""
    fwd, bwd, _, _ = _priced(shapes, costs)
    return fwd + bwd


def _work_bound(shapes: _Shapes, costs: PipelineCosts, config: PlannerConfig) -> float:
    """A lower bound on the makespan of any schedule of micro-batches of `shapes` within
    memory, over any split into the replicas: a share of each stage's work plus the least fill
    and drain (`makespan_lower_bound`), and the time their activations must stay stored
    within the memory (`memory_time_lower_bound`)."""
    fwd, bwd, act, _ = _priced(shapes, costs)
    comm = costs.p2p_times(shapes.rows, shapes.seq, shapes.tgt)
    r = config.num_replicas
    return max(
        makespan_lower_bound(fwd, bwd, comm, comm, r),
        memory_time_lower_bound(fwd, bwd, comm, comm, act, costs.available_memory(), r),
    )


def _pack_where_cheaper(dp: _Made, lengths: np.ndarray, costs: PipelineCosts) -> _Made:
    """Each of the DP's padded micro-batches, or its samples packed into rows of its length
    (`packed_group`) where the cost model prices that faster on the pipeline's stages (fewer
    rows, no attention over padding; its memory is never more)."""
    packed = [packed_group(g, lengths) for g in dp.groups]
    cheaper = _stage_work(_group_shapes(packed), costs).sum(axis=1) < _stage_work(
        dp.shapes, costs
    ).sum(axis=1)
    chosen = [p if c else g for g, p, c in zip(dp.groups, packed, cheaper, strict=True)]
    return _Made.of(chosen, dp.passes, dp.exhausted)


def _packed_rows(
    bins: Callable[[], list[list[int]]], lengths: np.ndarray, max_len: int, size: int
) -> _Made:
    return _Made.of(packed_rows_groups(bins(), lengths, max_len, size))


def _trimmed_rows(rows: Callable[[], list[list[int]]], lengths: np.ndarray, size: int) -> _Made:
    """`trimmed_rows_groups` priced from their shapes; the groups are built if scheduled."""
    r = rows()
    counts, seqlen, saved = trimmed_rows_shapes(r, lengths, size)
    shapes = _Shapes(counts, seqlen, np.zeros_like(seqlen), saved)
    return _Made(partial(trimmed_rows_groups, r, lengths, size), shapes)


def _without_dp(make, *args) -> _Made:
    return _Made.of(make(*args))


def packed_row_lengths(max_seqlen: int) -> list[int]:
    """Row lengths DynaPipe packs a batch to (`rows_up_to`): --seq-length and the powers of two
    down to a sixteenth of it."""
    powers = (1 << k for k in range(max_seqlen.bit_length()))
    return sorted({max_seqlen, *(p for p in powers if max_seqlen <= 16 * p < 16 * max_seqlen)})


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_range(lo: int, hi: int) -> list[int]:
    return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]


def _budget_grid(longest: int) -> list[int]:
    """Token budgets from the longest sample up to 32x it, in half-octave steps."""
    base = _pow2(longest)
    return sorted({longest, *(int(base * 2 ** (k / 2)) for k in range(0, 11))})


def split_for_replicas(index_lists: list[np.ndarray], num_replicas: int) -> list[np.ndarray]:
    """At least one micro-batch per replica: when a small batch fits in fewer micro-batches than
    there are replicas, halve the largest until every replica gets one. Halves of a feasible
    micro-batch are feasible (fewer samples, no longer rows)."""
    lists = list(index_lists)
    while len(lists) < num_replicas:
        k = max(range(len(lists)), key=lambda i: len(lists[i]))
        if len(lists[k]) < 2:
            total = sum(len(x) for x in lists)
            raise PlanningError(f"{total} samples cannot feed {num_replicas} replicas")
        half = len(lists[k]) // 2
        lists[k : k + 1] = [lists[k][:half], lists[k][half:]]
    return lists
