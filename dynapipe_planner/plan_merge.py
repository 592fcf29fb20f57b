"""One heterogeneous `ExecutionPlan` from the plans of independent pipelines.

Hydraulis (seed `hydraulis.txt` §5.1) runs pipelines of different TP/PP in one job, each fed its
own share of the global batch; HexiScale (`hexiscale.txt` §3) lets those pipelines be
asymmetric. Each pipeline is planned alone (`IterationPlanner.plan` on its sequences, with its
own cost model and depth); this module puts the single-pipeline plans side by side as the
replicas of one plan, so the runtime and the simulator see one iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .errors import PlanningError
from .plan import ExecutionPlan, MicroBatch, RankPlan, ReplicaLayout, validate_structure

# Stats every pipeline's plan must carry for the merged stats to be computed.
_NEEDED_STATS = (
    "predicted_iteration_s",
    "tokens",
    "padding_efficiency",
    "peak_memory_bytes",
    "num_microbatches",
)


def merge_pipeline_plans(
    plans: Sequence[ExecutionPlan], layouts: Sequence[ReplicaLayout]
) -> ExecutionPlan:
    """Replica i of the result is `plans[i]` (a single-replica plan) laid out as `layouts[i]`.

    Micro-batch ids are renumbered to be unique across pipelines (instructions follow), and the
    stats are combined as one iteration sees them: the slowest pipeline sets the iteration
    time, tokens add up, and the per-pipeline stats stay under `stats["pipelines"]`."""
    if not plans or len(plans) != len(layouts):
        raise PlanningError(f"{len(plans)} pipeline plans for {len(layouts)} layouts")
    microbatches: list[MicroBatch] = []
    ranks: list[RankPlan] = []
    owner_of_sample: dict[int, int] = {}
    for i, (plan, layout) in enumerate(zip(plans, layouts, strict=True)):
        _check_pipeline(i, plan, layout)
        new_id = {m.id: len(microbatches) + k for k, m in enumerate(plan.microbatches)}
        for m in plan.microbatches:
            for sample in m.samples:
                if owner_of_sample.setdefault(sample, i) != i:
                    raise PlanningError(
                        f"pipeline {i}: sample {sample} is also in pipeline "
                        f"{owner_of_sample[sample]}'s plan"
                    )
            own = {"samples": list(m.samples), "row_sizes": list(m.row_sizes)}  # no aliasing
            microbatches.append(replace(m, id=new_id[m.id], replica=i, **own))
        ranks.extend(
            RankPlan(i, r.stage, [replace(ins, mb=new_id[ins.mb]) for ins in r.instructions])
            for r in plan.ranks
        )
    merged = ExecutionPlan(
        max(layout.num_stages for layout in layouts),
        len(plans),
        microbatches,
        ranks,
        _merged_stats([p.stats for p in plans]),
        {"cost_models": [p.meta["cost_model"] for p in plans]},
        replicas=list(layouts),
    )
    validate_structure(merged, "merged plan")
    return merged


def _check_pipeline(i: int, plan: ExecutionPlan, layout: ReplicaLayout) -> None:
    validate_structure(plan, f"pipeline {i}")
    if plan.num_replicas != 1:
        raise PlanningError(
            f"pipeline {i}: its plan has {plan.num_replicas} replicas; merge single-pipeline plans"
        )
    if layout.num_stages != plan.num_stages:
        raise PlanningError(
            f"pipeline {i}: its plan has {plan.num_stages} stage(s) but its layout "
            f"{layout.num_stages}"
        )
    if layout.id != i:
        raise PlanningError(f"pipeline {i}: its layout has id {layout.id}, expected {i}")
    missing = [key for key in _NEEDED_STATS if key not in plan.stats]
    if missing:
        raise PlanningError(f"pipeline {i}: its plan's stats lack {missing}")
    if "cost_model" not in plan.meta:
        raise PlanningError(f"pipeline {i}: its plan carries no meta['cost_model']")


def _merged_stats(per_pipeline: list[dict[str, Any]]) -> dict[str, Any]:
    """Pipelines run concurrently, so the iteration takes as long as the slowest. Padding
    efficiency is real tokens over padded tokens of the whole batch, so each pipeline's padded
    tokens are recovered as tokens / efficiency before dividing."""
    iteration_s = max(s["predicted_iteration_s"] for s in per_pipeline)
    tokens = sum(s["tokens"] for s in per_pipeline)
    padded = sum(s["tokens"] / s["padding_efficiency"] for s in per_pipeline)
    return {
        "predicted_iteration_s": iteration_s,
        "tokens": tokens,
        "tokens_per_s": tokens / iteration_s,
        "padding_efficiency": tokens / padded,
        "peak_memory_bytes": [list(s["peak_memory_bytes"]) for s in per_pipeline],
        "num_microbatches": sum(s["num_microbatches"] for s in per_pipeline),
        "budget_exhausted": any(s.get("budget_exhausted", False) for s in per_pipeline),
        "pipelines": [dict(s) for s in per_pipeline],
    }
