"""Galvatron-BMW's search kept to the plans `pretrain_gpt.py --parallel-plan` runs.

The layer DP (seed `galvatron_bmw.txt` §IV-A) gives every layer its own strategy, so a plan may
change the TP degree between layers of one stage, which Galvatron runs by re-laying out the
activations between the groups and our runtime does not: it runs one TP degree per job, over
consecutive ranks (`plan_file.parallel_plan_refusal` names everything it refuses). Filtering
layer by layer cannot keep "one TP degree per job" (that binds the layers together), so
`runnable_search` runs the search once per TP degree, each over the layer strategies of that
degree which the runtime runs (the refusal's own test on a one-layer plan), and keeps the
fastest plan: the best runnable plan, since every runnable plan uses exactly one degree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import PlanningError
from ..model_spec import ModelSpec
from .cost_inputs import CostInputs
from .optimizer import SearchResult, search
from .plan_file import parallel_plan_refusal
from .space import LayerStrategy


def runs_in_runtime(strategy: LayerStrategy, tp: int) -> bool:
    """Whether a job of TP degree `tp` runs a layer with `strategy`."""
    return strategy.tp == tp and parallel_plan_refusal([strategy], [1]) is None


def runnable_search(
    model: ModelSpec,
    cost_inputs: CostInputs,
    num_gpus: int,
    memory_budget: float,
    *,
    max_tp: int | None = None,
    strategy_filter: Callable[[LayerStrategy], bool] | None = None,
    **options: Any,
) -> SearchResult:
    """`search` (same arguments) over the plans the runtime runs: the fastest of one search
    per TP degree that divides both the GPUs and the heads. Raises PlanningError, naming each
    degree's reason, when none fits."""
    degrees = [
        tp
        for tp in range(1, min(num_gpus, max_tp or num_gpus) + 1)
        if num_gpus % tp == 0 and model.num_heads % tp == 0
    ]
    best: SearchResult | None = None
    evaluated, seconds, reasons = 0, 0.0, []
    for tp in degrees:

        def runs(strategy: LayerStrategy, tp: int = tp) -> bool:
            return runs_in_runtime(strategy, tp) and (
                strategy_filter is None or strategy_filter(strategy)
            )

        try:
            result = search(
                model, cost_inputs, num_gpus, memory_budget, max_tp=tp, strategy_filter=runs,
                **options,
            )  # fmt: skip
        except PlanningError as refusal:
            reasons.append(f"TP {tp}: {refusal}")
            continue
        evaluated, seconds = evaluated + result.evaluated, seconds + result.search_time_s
        if best is None or result.throughput > best.throughput:
            best = result
    if best is None:
        raise PlanningError(
            "no plan that pretrain_gpt.py --parallel-plan runs fits: " + "; ".join(reasons)
        )
    return dataclasses.replace(best, evaluated=evaluated, search_time_s=seconds)
