"""Plans follow the sampler: the planning rank's service starts at the sampler's current
(possibly resumed) position, and a plan that does not cover the sampler's batch of its
iteration is refused instead of training on other data than the checkpoint records."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from distributed import run_ranks
from test_service import COST_MODEL, LENGTHS

from dynapipe_planner.planner import PlannerConfig
from dynapipe_planner.service import PlannerRecipe

RECIPE = PlannerRecipe(COST_MODEL, 2, PlannerConfig(dp_work_budget=0))


def _resume_and_mismatch(rank: int, world: int) -> str:
    from dynapipe_planner.errors import PlanningServiceError
    from megatron.dynapipe.data.sampler import GlobalBatchSampler
    from megatron.dynapipe.pipeline.plan_source import PlanMismatch, open_plan_source

    sampler = GlobalBatchSampler(LENGTHS, 8192, seed=3)
    next(sampler)  # iteration 0 was trained before the "resume"
    with open_plan_source(
        RECIPE, sampler, LENGTHS, stop_iteration=3, num_workers=0, timeout_s=30
    ) as plans:
        with pytest.raises(PlanningServiceError, match="no plan for iteration 1: it was"):
            plans.get(0, LENGTHS[:0])  # planning began after it
        _, batch = next(sampler)
        plan, _ = plans.get(1, batch)
        assert sorted(s for mb in plan.microbatches for s in mb.samples) == sorted(batch)
        _, batch = next(sampler)
        with pytest.raises(PlanMismatch) as caught:
            plans.get(2, batch[:-1])
    return str(caught.value)


def test_plans_start_at_the_sampler_and_must_cover_its_batch() -> None:
    (message,) = run_ranks(_resume_and_mismatch, 1)
    assert message.startswith("rank 0: the plan of iteration 3 covers")  # key 2, from 1
    assert "differ from the sampler's batch" in message
