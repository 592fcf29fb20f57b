"""Plans of a static heterogeneous layout: pipelines of fixed, unequal shape, each given a fixed
share of every global batch's tokens.

HexiScale (seed `hexiscale.txt` §3.2) gives each pipeline of an asymmetric layout its own batch
size, so a pipeline of slower or fewer GPUs gets fewer tokens. Its planner decides the layout
and the shares once, before training (`--hetero-plan`); per iteration only the sequences move.
Here each global batch is dealt to the pipelines by their `batch_fraction`s (longest sequence
first, each to the pipeline furthest below its share of the batch's tokens, so every pipeline's
token count ends close to its share), and each pipeline's sequences are then planned alone by
the planner core on the pipeline's own cost model (DynaPipe's micro-batches and schedule, seed
`dynapipe.txt` §4-§5), then merged into one heterogeneous ExecutionPlan
(`plan_merge.merge_pipeline_plans`). The recipe pickles, so the planning service's workers plan
ahead of training as for homogeneous jobs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .cluster import ClusterSpec, get_gpu
from .cost import AnalyticCostModel
from .errors import PlanningError
from .model_spec import ModelSpec
from .plan import ExecutionPlan, ReplicaLayout
from .plan_merge import merge_pipeline_plans
from .planner import IterationPlanner, PlannerConfig
from .strategy.selection import idle_pipeline_plan


def dispatch_by_fraction(lengths: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """The pipeline of each sequence: longest first, to the pipeline whose tokens so far are
    the smallest multiple of its share (ties to the lower index). Deterministic, so every
    planner process deals a batch alike."""
    share = np.asarray(fractions, dtype=np.float64)
    if share.ndim != 1 or len(share) == 0 or (share <= 0).any():
        raise PlanningError(f"batch fractions must be positive, got {list(fractions)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    owner = np.empty(len(lengths), dtype=np.int64)
    tokens = np.zeros(len(share))
    for i in np.argsort(-lengths, kind="stable"):
        j = int(np.argmin((tokens + lengths[i]) / share))
        owner[i] = j
        tokens[j] += lengths[i]
    return owner


class StaticHeteroPlanner:
    """Plans every global batch on fixed `layouts`, pipeline `j` taking about `fractions[j]` of
    its tokens; `planners[j]` plans pipeline j alone."""

    def __init__(
        self,
        layouts: Sequence[ReplicaLayout],
        fractions: Sequence[float],
        planners: Sequence[IterationPlanner],
    ) -> None:
        if not len(layouts) == len(fractions) == len(planners):
            raise PlanningError(
                f"{len(layouts)} layouts, {len(fractions)} fractions, {len(planners)} planners"
            )
        self.layouts, self.fractions, self.planners = list(layouts), list(fractions), planners

    def plan(self, lengths: np.ndarray, sample_ids: np.ndarray | None = None) -> ExecutionPlan:
        """One heterogeneous plan of the batch (`sample_ids`: the dataset's ids of `lengths`)."""
        started = time.perf_counter()
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = np.arange(len(lengths)) if sample_ids is None else np.asarray(sample_ids)
        owner = dispatch_by_fraction(lengths, self.fractions)
        plans = []
        for j, planner in enumerate(self.planners):
            mine = np.flatnonzero(owner == j)
            if len(mine) == 0:
                plans.append(idle_pipeline_plan(planner))
            else:
                plans.append(planner.plan(lengths[mine], ids[mine]))
        merged = merge_pipeline_plans(plans, self.layouts)
        merged.stats["planning_time_s"] = time.perf_counter() - started
        return merged


@dataclass(frozen=True)
class StaticHeteroRecipe:
    """Builds a `StaticHeteroPlanner` in each planning worker: every pipeline priced by the
    analytic model of `gpu` with its own depth and (smallest) TP degree; `config` is the
    planner core's configuration (one replica). `stage_recompute[j]`, when given, fixes
    pipeline j's recomputation mode per stage (a HexiScale plan's choice) instead of
    `config.recompute`."""

    spec: ModelSpec
    gpu: str
    layouts: tuple[ReplicaLayout, ...]
    fractions: tuple[float, ...]
    config: PlannerConfig
    memory_limit_bytes: int = 0
    stage_recompute: tuple[tuple[str, ...], ...] = ()

    def build(self) -> StaticHeteroPlanner:
        planners = []
        for j, layout in enumerate(self.layouts):
            config = self.config
            if self.stage_recompute:
                config = replace(config, stage_recompute=self.stage_recompute[j])
            # A stage-wise TP degree is the runtime's; the cost model prices one TP per
            # pipeline, the smallest (the slowest stage bounds the pipeline).
            cluster = ClusterSpec(
                get_gpu(self.gpu),
                num_stages=layout.num_stages,
                num_replicas=1,
                tp=min(s.tp for s in layout.stages),
                memory_limit_bytes=self.memory_limit_bytes,
            )
            planners.append(
                IterationPlanner(AnalyticCostModel(self.spec, cluster), layout.num_stages, config)
            )
        return StaticHeteroPlanner(self.layouts, self.fractions, planners)
