"""Cost models: what a micro-batch costs on each pipeline stage (time and memory).

Every model produces a `PipelineCosts` (see `table.py`), the single contract the planner reads.
"""

from __future__ import annotations

from typing import Any

from ..cluster import cluster_from_dict
from ..errors import PlanningError
from ..model_spec import ModelSpec
from .analytic import AnalyticCostModel
from .profiled import ProfiledCostModel
from .table import PipelineCosts, StageCosts, split_layers

__all__ = [
    "AnalyticCostModel",
    "PipelineCosts",
    "ProfiledCostModel",
    "StageCosts",
    "cost_model_from_description",
    "split_layers",
]


def cost_model_from_description(desc: dict[str, Any]) -> AnalyticCostModel | ProfiledCostModel:
    """Rebuild the cost model a plan was made with (its `meta["cost_model"]`)."""
    try:
        model = ModelSpec.from_dict(desc["model"])
        cluster = cluster_from_dict(desc["cluster"])
        if desc["kind"] == "analytic":
            return AnalyticCostModel(
                model,
                cluster,
                flash_attention=desc.get("flash_attention", False),
                distributed_optimizer=desc.get("distributed_optimizer", False),
                sequence_parallel=desc.get("sequence_parallel", False),
                dtype=desc.get("dtype", "bf16"),
            )
        if desc["kind"] == "profiled":
            return ProfiledCostModel.load(desc["path"], model, cluster)
    except (KeyError, TypeError) as e:
        raise PlanningError(f"cost model description is malformed: missing {e}") from e
    raise PlanningError(f"unknown cost model kind {desc.get('kind')!r}")
