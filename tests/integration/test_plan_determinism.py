"""Plans do not depend on the machine's load: the planner's budgets count work, not seconds
(issue 35), so a batch planned beside CPU-bound processes is the batch planned on an idle
machine."""

from __future__ import annotations

import multiprocessing

from test_planner import make_planner

from dynapipe_planner.data import sample_lengths
from dynapipe_planner.model_spec import MODEL_PRESETS


def _burn_cpu() -> None:
    while True:
        pass


def test_a_busy_machine_plans_what_an_idle_one_plans() -> None:
    """Issue 35: the DP's budget counts ranges priced, not seconds. An N=8,000 batch planned
    exactly (bucket_rel 0) runs out of a small budget; planned again beside two CPU-bound
    processes it gives the same plan, byte for byte but for its wall-clock stat."""
    lengths = sample_lengths("lognormal", 8000, seed=8000, median=256, sigma=1.0, lo=8, hi=4096)
    planner = make_planner(
        MODEL_PRESETS["gpt-1.3b"], 4, 2, 40, bucket_rel=0.0, dp_work_budget=10**8
    )

    def planned() -> dict:
        plan = planner.plan(lengths).to_dict()
        del plan["stats"]["planning_time_s"]
        return plan

    idle = planned()
    assert idle["stats"]["budget_exhausted"] is True
    burners = [multiprocessing.get_context("fork").Process(target=_burn_cpu) for _ in range(2)]
    for burner in burners:
        burner.start()
    try:
        busy = planned()
    finally:
        for burner in burners:
            burner.kill()
            burner.join()
    assert busy == idle
