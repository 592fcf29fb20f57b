"""Per-iteration strategy selection: Hydraulis (seed hydraulis.txt) §4, steps 1-4, with the
planner core inside every pipeline.

For each global batch, the candidates are the strategies proposed for maximum lengths from the
batch's longest sequence upwards (or `window` lengths above it) and, by default, two sets the
paper does not price: strategies proposed from the batch's own lengths (`batch_proposals`) and
the homogeneous strategy of every scheme that holds the batch. Each is assigned in two stages:
dispatch across pipelines (§6.2, `dispatch`, short sequences priced as packed by default),
then Eq. 1 packing within each (§6.1, `pack_pipeline`). The paper prices a strategy by its
slowest pipeline's Eq. 1 latency (`estimate="eq1"`); by default we price each pipeline as the
planner core will plan it, so the choice matches the latency it will have, and then move the
winner's sequences between its pipelines while that lowers its planned latency.

The winner is planned pipeline by pipeline by the planner core on that pipeline's own cost
model: with `inside="packing"` (Hydraulis) each pipeline runs its Eq. 1 micro-batches under
1F1B; with `inside="dynapipe"` (our extension) DynaPipe's DP builds the micro-batches of the
pipeline's sequences and the adaptive schedule runs them (seed dynapipe.txt §4-§5), the Eq. 1
packing kept as an option."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cost import split_layers
from ..errors import PlanningError
from ..microbatch.baselines import Group
from ..plan import ExecutionPlan, RankPlan, ReplicaLayout, StageLayout
from ..plan_merge import merge_pipeline_plans
from ..planner import CostModel, IterationPlanner, PlannerConfig
from ..schedule.balance import rebalance_replicas
from .dispatch import DISPATCH_PRICINGS, Dispatch, dispatch, pipeline_bound, sequence_times
from .packing import Packing, pack_pipeline
from .proposal import Proposal, Strategy, batch_proposals
from .schemes import ParallelScheme, SchemeProfile

INSIDE = ("packing", "dynapipe")
ESTIMATES = ("planned", "eq1")


@dataclass(frozen=True)
class SelectionConfig:
    """How each iteration is assigned and planned."""

    inside: str = "packing"
    estimate: str = "planned"
    trials: int = 100
    seed: int = 0
    window: int | None = None
    homogeneous: bool = True  # also price one-scheme strategies (not in the paper's set)
    # Strategies proposed from the batch's own lengths (`batch_proposals`), 0: the paper's
    # dataset-level candidates only.
    batch_candidates: int = 10
    dispatch_pricing: str = "packed"  # how dispatch prices a sequence (DISPATCH_PRICINGS)
    step: int = 128  # length-interval width of those proposals
    packing: str = "lpt"
    recompute: str = "none"
    dtype: str = "bf16"
    # The only strategies priced (None: any): a runtime built process groups for these alone.
    allowed: frozenset[Strategy] | None = None

    def __post_init__(self) -> None:
        if self.inside not in INSIDE:
            raise PlanningError(f"inside must be one of {INSIDE}, got {self.inside!r}")
        if self.estimate not in ESTIMATES:
            raise PlanningError(f"estimate must be one of {ESTIMATES}, got {self.estimate!r}")
        if self.dispatch_pricing not in DISPATCH_PRICINGS:
            raise PlanningError(
                f"dispatch pricing must be one of {DISPATCH_PRICINGS}, "
                f"got {self.dispatch_pricing!r}"
            )


@dataclass(frozen=True)
class Assignment:
    """A strategy's two-stage assignment of one batch: dispatch, packings, Eq. 1 estimate."""

    strategy: Strategy
    dispatch: Dispatch
    packings: tuple[Packing, ...]

    @property
    def estimate(self) -> float:
        return max((p.objective for p in self.packings), default=0.0)


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline's sequences (indices into the batch) and its single-replica plan."""

    scheme: ParallelScheme
    sequences: np.ndarray
    plan: ExecutionPlan | None  # None: the pipeline got no sequence this iteration

    @property
    def latency(self) -> float:
        return self.plan.stats["predicted_iteration_s"] if self.plan else 0.0


@dataclass(frozen=True)
class IterationChoice:
    """The chosen strategy, its pipelines' plans and every candidate's estimate."""

    assignment: Assignment
    pipelines: tuple[PipelinePlan, ...]
    estimates: dict[Strategy, float] = field(repr=False)

    @property
    def strategy(self) -> Strategy:
        return self.assignment.strategy

    @property
    def latency(self) -> float:
        """The iteration's propagation time: its slowest pipeline's planned makespan."""
        return max(p.latency for p in self.pipelines)

    @property
    def in_plan_order(self) -> list[PipelinePlan]:
        """The pipelines in the strategy's own order (by scheme), the order of the plan's
        replicas (`pipelines` is dispatch's: longest MaxLen first)."""
        return sorted(self.pipelines, key=lambda pipeline: pipeline.scheme)


class StrategySelector:
    """Chooses and plans the strategy of every iteration from proposed candidates."""

    def __init__(
        self,
        profiles: list[SchemeProfile],
        proposals: list[Proposal],
        cost_model_of: Callable[[ParallelScheme], CostModel],
        num_gpus: int,
        config: SelectionConfig | None = None,
        *,
        fixed: Sequence[Strategy] = (),
        placement: Callable[[Sequence[ParallelScheme]], list[ReplicaLayout]] | None = None,
    ) -> None:
        if not proposals and not fixed:
            raise PlanningError("no proposed strategies to select from")
        self.fixed = tuple(fixed)
        self.placement = placement  # where each chosen pipeline runs (default: contiguous)
        self.num_gpus = num_gpus
        self.profiles = {p.scheme: p for p in profiles}
        self.proposals = sorted(proposals, key=lambda p: p.max_len)
        self.config = config or SelectionConfig()
        self.planners = PipelinePlanners(
            cost_model_of, recompute=self.config.recompute, dtype=self.config.dtype
        )

    def candidates(self, lengths: np.ndarray) -> list[Strategy]:
        """Strategies proposed for the batch's maximum length and `window` lengths above it
        (every longer one by default: all proposed strategies that hold the batch), the
        strategies proposed from the batch itself (`batch_proposals`), then the homogeneous
        strategy of every scheme that holds the batch: the relaxation prices GPU-seconds,
        not a long sequence's trip through a small pipeline, so one large scheme everywhere
        can still win an iteration. A selector built with `fixed` strategies offers exactly
        those (a mixed cluster's candidates: no proposal stands behind them)."""
        if self.fixed:
            return list(self.fixed)
        longest = int(np.max(lengths))
        first = next((k for k, p in enumerate(self.proposals) if p.max_len >= longest), None)
        if first is None:
            top = self.proposals[-1].max_len
            raise PlanningError(
                f"the batch's longest sequence ({longest} tokens) is beyond every proposal "
                f"(they cover up to {top}); propose strategies for this context length"
            )
        window = self.config.window
        end = len(self.proposals) if window is None else first + 1 + window
        proposed = [s for p in self.proposals[first:end] for s in p.strategies]
        homogeneous = [
            Strategy.homogeneous(p.scheme, self.num_gpus)
            for p in self.profiles.values()
            if p.max_len >= longest and p.scheme.num_gpus <= self.num_gpus
        ]
        own = (
            batch_proposals(
                lengths,
                list(self.profiles.values()),
                self.num_gpus,
                starts=proposed + homogeneous,
                keep=self.config.batch_candidates,
                step=self.config.step,
            )
            if self.config.batch_candidates
            else []
        )
        offered = homogeneous if self.config.homogeneous else []
        found = list(dict.fromkeys(proposed + own + offered))
        if self.config.allowed is not None:
            found = [s for s in found if s in self.config.allowed]
            if not found:
                raise PlanningError(
                    f"no allowed strategy holds a batch whose longest sequence has {longest} tokens"
                )
        return found

    def assign(self, prices: _BatchPrices, strategy: Strategy) -> Assignment:
        """Two-stage assignment of one batch to one strategy (dispatch, then Eq. 1 packing)."""
        cfg = self.config
        profiles = list(self.profiles.values())
        placed = dispatch(
            prices.lengths,
            strategy,
            profiles,
            trials=cfg.trials,
            seed=cfg.seed,
            pricing=cfg.dispatch_pricing,
        )
        packings = tuple(
            prices.packing(s, _members(placed.assignment, j))
            for j, s in enumerate(placed.pipelines)
        )
        return Assignment(strategy, placed, packings)

    def select(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> IterationChoice:
        """Steps 1-4 for one batch, then the winner planned pipeline by pipeline."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.arange(len(lengths)) if sample_ids is None else np.asarray(sample_ids)
        prices = _BatchPrices(self, lengths)
        best, estimates, failures = None, {}, []
        for strategy in self.candidates(lengths):
            try:
                assignment = self.assign(prices, strategy)
            except PlanningError as err:
                failures.append(f"{strategy}: {err}")
                continue
            estimates[strategy] = self._score(assignment, prices)
            if best is None or estimates[strategy] < estimates[best.strategy]:
                best = assignment
        if best is None:
            raise PlanningError("no candidate strategy can take this batch: " + "; ".join(failures))
        if self.config.estimate == "planned":
            best = self._rebalanced(best, prices)
        return IterationChoice(best, self._plan_pipelines(best, prices, ids), estimates)

    def _rebalanced(self, assignment: Assignment, prices: _BatchPrices) -> Assignment:
        """The winner's sequences moved off its slowest pipeline while that lowers the
        planned latency (`rebalance_replicas`, priced by the planner core): the dispatch
        balances Eq. 2 bounds, which miss what the schedule adds."""
        placed = assignment.dispatch
        schemes, lengths = placed.pipelines, prices.lengths
        parts = [_members(placed.assignment, j) for j in range(len(schemes))]
        pricing = self.config.dispatch_pricing
        stage_time = np.array(
            [
                float(sequence_times(self.profiles[schemes[j]], lengths[i], pricing))
                for i, j in enumerate(placed.assignment)
            ]
        )
        moved = rebalance_replicas(parts, lambda j, m: prices.latency(schemes[j], m), stage_time)
        if moved == parts:
            return assignment
        where = np.empty(len(lengths), dtype=np.int64)
        for j, members in enumerate(moved):
            where[list(members)] = j
        packings = tuple(
            prices.packing(s, members) for s, members in zip(schemes, moved, strict=True)
        )
        bounds = [
            pipeline_bound(sequence_times(self.profiles[s], lengths[where == j], pricing), s.pp)
            for j, s in enumerate(schemes)
        ]
        return Assignment(assignment.strategy, Dispatch(schemes, where, max(bounds)), packings)

    def _score(self, assignment: Assignment, prices: _BatchPrices) -> float:
        """The paper's Eq. 1 estimate, or (`estimate="planned"`) each pipeline's time as the
        planner core will plan it, so the choice matches the latency it will have."""
        if self.config.estimate == "eq1":
            return assignment.estimate
        placed = assignment.dispatch
        return max(
            prices.latency(s, _members(placed.assignment, j))
            for j, s in enumerate(placed.pipelines)
        )

    def plan(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> ExecutionPlan:
        """`select`, then the winner as one heterogeneous ExecutionPlan for the runtime (what
        the planning service's workers call); `stats["planning_time_s"]` is the wall time of
        both."""
        started = time.perf_counter()
        plan = self.to_plan(self.select(lengths, sample_ids))
        plan.stats["planning_time_s"] = time.perf_counter() - started
        return plan

    def to_plan(self, choice: IterationChoice) -> ExecutionPlan:
        """The chosen pipelines side by side (`merge_pipeline_plans`) in the strategy's own
        order (by scheme, not dispatch's longest-MaxLen-first), so a strategy always gets the
        same layouts, whatever the batch: the runtime built its groups for exactly those. GPUs
        are given out by `placement` (a mixed cluster's: each pipeline on GPUs of its type) or
        else in that order, stage by stage, TP groups contiguous; a pipeline that got no
        sequence this iteration runs an empty program (it still joins the gradient sync)."""
        ordered = choice.in_plan_order
        schemes = [p.scheme for p in ordered]
        planners = [self.planner(s) for s in schemes]
        plans = [p.plan or idle_pipeline_plan(q) for p, q in zip(ordered, planners, strict=True)]
        if self.placement is not None:
            layouts = self.placement(schemes)
        else:
            layouts = contiguous_layouts(schemes, len(planners[0].cost_model.model.layer_kinds()))
        return merge_pipeline_plans(plans, layouts)

    def _plan_pipelines(
        self, assignment: Assignment, prices: _BatchPrices, ids: np.ndarray
    ) -> tuple[PipelinePlan, ...]:
        pipelines = []
        placed = assignment.dispatch
        for j, scheme in enumerate(placed.pipelines):
            members = _members(placed.assignment, j)
            mine = np.array(members, dtype=np.int64)
            if not members:
                pipelines.append(PipelinePlan(scheme, mine, None))
                continue
            groups = prices.micro_batches(scheme, members)[0]
            plan = self.planner(scheme).plan(prices.lengths[mine], ids[mine], groups=groups)
            pipelines.append(PipelinePlan(scheme, mine, plan))
        return tuple(pipelines)

    def planner(self, scheme: ParallelScheme) -> IterationPlanner:
        """The planner core that plans `scheme`'s pipelines (`inside` decides which)."""
        return self.planners.of(scheme, self.config.inside)


class _BatchPrices:
    """Each pipeline of one batch priced once, however often selection, rebalancing and
    planning ask: its Eq. 1 packing, then the planner core's micro-batches and predicted time.
    Keyed by (scheme, sorted sequence indices); the planner core is deterministic."""

    def __init__(self, selector: StrategySelector, lengths: np.ndarray) -> None:
        self.selector, self.lengths = selector, lengths
        self._packings: dict[tuple[ParallelScheme, tuple[int, ...]], Packing] = {}
        self._planned: dict[tuple[ParallelScheme, tuple[int, ...]], tuple] = {}

    def packing(self, scheme: ParallelScheme, members: tuple[int, ...]) -> Packing:
        key = (scheme, members)
        if key not in self._packings:
            cfg, profile = self.selector.config, self.selector.profiles[scheme]
            own = self.lengths[list(members)]
            self._packings[key] = pack_pipeline(own, profile, method=cfg.packing)
        return self._packings[key]

    def micro_batches(
        self, scheme: ParallelScheme, members: tuple[int, ...]
    ) -> tuple[list[Group] | None, float]:
        """Micro-batches for the planner core (None: DynaPipe's DP decides) and their predicted
        time. Inside DynaPipe the Eq. 1 packing stays an option under the adaptive schedule:
        with a handful of long sequences it can beat the DP's split."""
        key = (scheme, members)
        if key not in self._planned:
            own = self.lengths[list(members)]
            planner = self.selector.planner(scheme)
            packed = packed_groups(own, self.packing(scheme, members))
            dynapipe = self.selector.config.inside == "dynapipe"
            options = [None, packed] if dynapipe else [packed]
            timed = [(planner.predict(own, groups), k) for k, groups in enumerate(options)]
            latency, k = min(timed)
            self._planned[key] = (options[k], latency)
        return self._planned[key]

    def latency(self, scheme: ParallelScheme, members: tuple[int, ...]) -> float:
        """Predicted time of these sequences on a pipeline of `scheme`: 0 for none, inf when
        one is longer than its MaxLen."""
        if not members:
            return 0.0
        if self.lengths[list(members)].max() > self.selector.profiles[scheme].max_len:
            return math.inf
        return self.micro_batches(scheme, members)[1]


def _members(assignment: np.ndarray, pipeline: int) -> tuple[int, ...]:
    """Sorted indices of the sequences dispatched to `pipeline`."""
    return tuple(np.flatnonzero(assignment == pipeline).tolist())


@dataclass(frozen=True)
class StrategyRecipe:
    """Builds the same `StrategySelector` in each planning-service worker (all fields pickle),
    so heterogeneous plans are made ahead of training like the planner core's."""

    profiles: tuple[SchemeProfile, ...]
    proposals: tuple[Proposal, ...]
    cost_model_of: Callable[[ParallelScheme], CostModel]
    num_gpus: int
    config: SelectionConfig = field(default_factory=SelectionConfig)
    fixed: tuple[Strategy, ...] = ()
    placement: Callable[[Sequence[ParallelScheme]], list[ReplicaLayout]] | None = None

    def build(self) -> StrategySelector:
        return StrategySelector(
            list(self.profiles),
            list(self.proposals),
            self.cost_model_of,
            self.num_gpus,
            self.config,
            fixed=self.fixed,
            placement=self.placement,
        )


class PipelinePlanners:
    """The planner core of each scheme's pipeline, built once per scheme: packed micro-batches
    under 1F1B (`inside="packing"`) or DynaPipe's DP with the adaptive schedule
    (`inside="dynapipe"`); one replica, no DP work budget (every pass runs)."""

    def __init__(
        self,
        cost_model_of: Callable[[ParallelScheme], CostModel],
        *,
        recompute: str = "none",
        dtype: str = "bf16",
    ) -> None:
        self.cost_model_of = cost_model_of
        self.recompute, self.dtype = recompute, dtype
        self._planners: dict[tuple[ParallelScheme, str], IterationPlanner] = {}

    def of(self, scheme: ParallelScheme, inside: str) -> IterationPlanner:
        if inside not in INSIDE:
            raise PlanningError(f"inside must be one of {INSIDE}, got {inside!r}")
        key = (scheme, inside)
        if key not in self._planners:
            dynapipe = inside == "dynapipe"
            self._planners[key] = IterationPlanner(
                self.cost_model_of(scheme),
                scheme.pp,
                PlannerConfig(
                    batching="dynamic" if dynapipe else "packing",
                    schedule="adaptive" if dynapipe else "1f1b",
                    recompute=self.recompute,
                    dtype=self.dtype,
                    num_replicas=1,
                    dp_work_budget=0,
                    # "packing" is the paper's Eq. 1 packing; "dynapipe" DynaPipe's DP as the
                    # paper's alternative, padded, so the two stay distinct in the ablations
                    packed_rows=False,
                ),
            )
        return self._planners[key]


def packed_groups(lengths: np.ndarray, packing: Packing) -> list[Group]:
    """One packed row per Eq. 1 micro-batch, attention priced block-diagonally (varlen)."""
    groups = []
    for members in packing.microbatches:
        own = lengths[list(members)].astype(np.float64)
        seqlen = int(own.sum())
        saved = float(seqlen**2 - np.sum(own**2))
        groups.append(Group(np.array(members), seqlen, rows=[list(members)], attention_saved=saved))
    return groups


def contiguous_layouts(schemes: Sequence[ParallelScheme], num_layers: int) -> list[ReplicaLayout]:
    """Pipelines of `schemes` (in order) on consecutive devices, stage by stage, TP groups
    contiguous, layers split as the planner core's cost model splits them; the one layout
    rule of a strategy's plans and of the groups the runtime builds for it."""
    layouts, first = [], 0
    for index, scheme in enumerate(schemes):
        bounds = np.concatenate([[0], np.cumsum(split_layers(num_layers, scheme.pp))]).tolist()
        stages = [
            StageLayout(
                list(range(first + j * scheme.tp, first + (j + 1) * scheme.tp)),
                scheme.tp,
                (int(bounds[j]), int(bounds[j + 1])),
            )
            for j in range(scheme.pp)
        ]
        layouts.append(ReplicaLayout(index, scheme.pp, stages))
        first += scheme.num_gpus
    return layouts


def idle_pipeline_plan(planner: IterationPlanner) -> ExecutionPlan:
    """The plan of a pipeline with nothing to do this iteration: empty programs, zero time."""
    stages = planner.num_stages
    stats = {
        "predicted_iteration_s": 0.0,
        "tokens": 0,
        "tokens_per_s": 0.0,
        "padding_efficiency": 1.0,
        "peak_memory_bytes": [0] * stages,
        "num_microbatches": 0,
    }
    ranks = [RankPlan(0, j, []) for j in range(stages)]
    return ExecutionPlan(stages, 1, [], ranks, stats, {"cost_model": planner.cost_model.describe()})
