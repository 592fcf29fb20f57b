"""Cost models: what a micro-batch costs on each pipeline stage (time and memory).

Every model produces a `PipelineCosts` (see `table.py`), the single contract the planner reads.
"""

from .table import PipelineCosts, StageCosts, split_layers

__all__ = ["PipelineCosts", "StageCosts", "split_layers"]
