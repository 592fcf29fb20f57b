"""Per-iteration strategy selection: Hydraulis (seed hydraulis.txt) §4, steps 1-4, with the
planner core inside every pipeline.

For each global batch, the candidate strategies proposed for maximum lengths from the batch's
longest sequence up to `window` histogram intervals beyond it are priced by the two-stage
assignment: dispatch across pipelines (§6.2, `dispatch`) then Eq. 1 packing within each
(§6.1, `pack_pipeline`); the slowest pipeline's Eq. 1 latency is the strategy's estimate and the
lowest estimate wins (step 4).

The winner is then planned for real, pipeline by pipeline, by the planner core on that
pipeline's own cost model, so its latency is a schedule timeline (what the simulator checks),
not an estimate: with `inside="packing"` (Hydraulis) each pipeline runs its Eq. 1 micro-batches
under 1F1B; with `inside="dynapipe"` (our extension) DynaPipe's DP builds the micro-batches of
the pipeline's sequences and the adaptive schedule runs them (seed dynapipe.txt §4-§5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cost import split_layers
from ..errors import PlanningError
from ..microbatch.baselines import Group
from ..plan import ExecutionPlan, RankPlan, ReplicaLayout, StageLayout
from ..plan_merge import merge_pipeline_plans
from ..planner import CostModel, IterationPlanner, PlannerConfig
from .dispatch import Dispatch, dispatch
from .packing import Packing, pack_pipeline
from .proposal import Proposal, Strategy
from .schemes import ParallelScheme, SchemeProfile

INSIDE = ("packing", "dynapipe")


@dataclass(frozen=True)
class SelectionConfig:
    """How each iteration is assigned and planned."""

    inside: str = "packing"
    trials: int = 100
    seed: int = 0
    window: int = 4
    packing: str = "lpt"
    recompute: str = "none"
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.inside not in INSIDE:
            raise PlanningError(f"inside must be one of {INSIDE}, got {self.inside!r}")


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


class StrategySelector:
    """Chooses and plans the strategy of every iteration from proposed candidates."""

    def __init__(
        self,
        profiles: list[SchemeProfile],
        proposals: list[Proposal],
        cost_model_of: Callable[[ParallelScheme], CostModel],
        config: SelectionConfig | None = None,
    ) -> None:
        if not proposals:
            raise PlanningError("no proposed strategies to select from")
        self.profiles = {p.scheme: p for p in profiles}
        self.proposals = sorted(proposals, key=lambda p: p.max_len)
        self.cost_model_of = cost_model_of
        self.config = config or SelectionConfig()
        self._planners: dict[ParallelScheme, IterationPlanner] = {}

    def candidates(self, longest: int) -> list[Strategy]:
        """Strategies proposed for the batch's maximum length and `window` lengths above it."""
        first = next((k for k, p in enumerate(self.proposals) if p.max_len >= longest), None)
        if first is None:
            top = self.proposals[-1].max_len
            raise PlanningError(
                f"the batch's longest sequence ({longest} tokens) is beyond every proposal "
                f"(they cover up to {top}); propose strategies for this context length"
            )
        chosen = self.proposals[first : first + 1 + self.config.window]
        return list(dict.fromkeys(s for p in chosen for s in p.strategies))

    def assign(self, lengths: np.ndarray, strategy: Strategy) -> Assignment:
        """Two-stage assignment of one batch to one strategy (dispatch, then Eq. 1 packing)."""
        cfg = self.config
        profiles = list(self.profiles.values())
        placed = dispatch(lengths, strategy, profiles, trials=cfg.trials, seed=cfg.seed)
        packings = tuple(
            pack_pipeline(lengths[placed.assignment == j], self.profiles[s], method=cfg.packing)
            for j, s in enumerate(placed.pipelines)
        )
        return Assignment(strategy, placed, packings)

    def select(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> IterationChoice:
        """Steps 1-4 for one batch, then the winner planned pipeline by pipeline."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.arange(len(lengths)) if sample_ids is None else np.asarray(sample_ids)
        best, estimates, failures = None, {}, []
        for strategy in self.candidates(int(lengths.max())):
            try:
                assignment = self.assign(lengths, strategy)
            except PlanningError as err:
                failures.append(f"{strategy}: {err}")
                continue
            estimates[strategy] = assignment.estimate
            if best is None or assignment.estimate < best.estimate:
                best = assignment
        if best is None:
            raise PlanningError("no candidate strategy can take this batch: " + "; ".join(failures))
        return IterationChoice(best, self._plan_pipelines(best, lengths, ids), estimates)

    def plan(
        self, lengths: np.ndarray, sample_ids: np.ndarray | None = None
    ) -> tuple[IterationChoice, ExecutionPlan]:
        """`select`, then the winner as one heterogeneous ExecutionPlan for the runtime."""
        choice = self.select(lengths, sample_ids)
        return choice, self.to_plan(choice)

    def to_plan(self, choice: IterationChoice) -> ExecutionPlan:
        """The chosen pipelines side by side (`merge_pipeline_plans`): GPUs are given out in
        pipeline order, stage by stage, TP groups contiguous; a pipeline that got no sequence
        this iteration runs an empty program (it still joins the gradient sync)."""
        plans, layouts, first_device = [], [], 0
        for i, pipeline in enumerate(choice.pipelines):
            planner = self._planner(pipeline.scheme)
            plans.append(pipeline.plan or idle_pipeline_plan(planner))
            layouts.append(pipeline_layout(i, pipeline.scheme, planner, first_device))
            first_device += pipeline.scheme.num_gpus
        return merge_pipeline_plans(plans, layouts)

    def _plan_pipelines(
        self, assignment: Assignment, lengths: np.ndarray, ids: np.ndarray
    ) -> tuple[PipelinePlan, ...]:
        pipelines = []
        placed = assignment.dispatch
        for j, (scheme, packing) in enumerate(
            zip(placed.pipelines, assignment.packings, strict=True)
        ):
            mine = np.flatnonzero(placed.assignment == j)
            if len(mine) == 0:
                pipelines.append(PipelinePlan(scheme, mine, None))
                continue
            own = lengths[mine]
            groups = None if self.config.inside == "dynapipe" else packed_groups(own, packing)
            plan = self._planner(scheme).plan(own, ids[mine], groups=groups)
            pipelines.append(PipelinePlan(scheme, mine, plan))
        return tuple(pipelines)

    def _planner(self, scheme: ParallelScheme) -> IterationPlanner:
        if scheme not in self._planners:
            cfg = self.config
            dynapipe = cfg.inside == "dynapipe"
            self._planners[scheme] = IterationPlanner(
                self.cost_model_of(scheme),
                scheme.pp,
                PlannerConfig(
                    batching="dynamic" if dynapipe else "packing",
                    schedule="adaptive" if dynapipe else "1f1b",
                    recompute=cfg.recompute,
                    dtype=cfg.dtype,
                    num_replicas=1,
                    dp_time_budget_s=0.0,
                ),
            )
        return self._planners[scheme]


def packed_groups(lengths: np.ndarray, packing: Packing) -> list[Group]:
    """One packed row per Eq. 1 micro-batch, attention priced block-diagonally (varlen)."""
    groups = []
    for members in packing.microbatches:
        own = lengths[list(members)].astype(np.float64)
        seqlen = int(own.sum())
        saved = float(seqlen**2 - np.sum(own**2))
        groups.append(Group(np.array(members), seqlen, rows=[list(members)], attention_saved=saved))
    return groups


def pipeline_layout(
    index: int, scheme: ParallelScheme, planner: IterationPlanner, first_device: int
) -> ReplicaLayout:
    """Devices and layers of each stage of one pipeline, layers split as its cost model did."""
    counts = split_layers(len(planner.cost_model.model.layer_kinds()), scheme.pp)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    stages = [
        StageLayout(
            list(range(first_device + j * scheme.tp, first_device + (j + 1) * scheme.tp)),
            scheme.tp,
            (bounds[j], bounds[j + 1]),
        )
        for j in range(scheme.pp)
    ]
    return ReplicaLayout(index, scheme.pp, stages)


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
