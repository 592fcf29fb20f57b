"""The planning service: the same plans with any number of worker processes, plans keyed by
iteration however workers finish, errors and timeouts that name the iteration, and no planner
process outliving the service or its parent."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from paths import TESTS

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.data import global_batches, sample_lengths
from dynapipe_planner.errors import PlanningError, PlanningServiceError, PlanTimeoutError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import PlannerConfig
from dynapipe_planner.service import PlannerRecipe, PlanningService

COST_MODEL = AnalyticCostModel(
    MODEL_PRESETS["gpt-350m"], ClusterSpec(get_gpu("A100-40GB"), num_stages=2)
)
# No DP time budget: an exhausted budget would make plans depend on CPU load.
RECIPE = PlannerRecipe(COST_MODEL, 2, PlannerConfig(dp_work_budget=0))
# Exact DP (no threshold bucketing): slow on a few hundred samples, for late plans.
EXACT = PlannerRecipe(COST_MODEL, 2, PlannerConfig(bucket_rel=0, dp_work_budget=0))
LENGTHS = sample_lengths("flan", 2000, seed=3, max_seqlen=2048)


def work(count: int = 4, first: int = 0) -> list[tuple[int, np.ndarray, np.ndarray]]:
    batches = global_batches(LENGTHS, 8192, seed=3)
    return [(first + i, LENGTHS[b], b) for i, b in zip(range(count), batches, strict=False)]


def comparable(plan: ExecutionPlan) -> dict:
    """The plan without its one timing-dependent field (see service.py, "Determinism")."""
    d = plan.to_dict()
    assert d["stats"].pop("planning_time_s") > 0
    return d


def assert_no_children(service: PlanningService) -> None:
    assert mp.active_children() == []
    assert len(service.worker_pids) == service.num_workers
    for pid in service.worker_pids:
        assert not _alive(pid)


def _alive(pid: int | None) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()  # unreaped orphans count as gone
    except FileNotFoundError:
        return False


def test_any_worker_count_gives_the_same_plans():
    assert PlannerRecipe.of(RECIPE.build()) == RECIPE
    plans = {}
    for workers in (0, 1, 2):
        with PlanningService(RECIPE, work(), num_workers=workers, lookahead=3) as service:
            plans[workers] = [comparable(service.get(i, timeout_s=30)) for i in range(4)]
        assert_no_children(service)
    assert plans[0] == plans[1] == plans[2]
    assert [p["microbatches"] for p in plans[0]] != [plans[0][0]["microbatches"]] * 4


def test_plans_are_keyed_by_iteration_whatever_the_order():
    items = work(4, first=10)
    slow = np.arange(250)
    items[0] = (10, LENGTHS[slow], slow)  # iteration 10 finishes after 11-13 on two workers
    with PlanningService(EXACT, items, num_workers=0) as inline:
        expected = {i: comparable(inline.get(i)) for i in (10, 11, 12, 13)}
    with PlanningService(EXACT, items, num_workers=2, lookahead=4) as service:
        for i in (13, 10, 12, 11):
            got = service.get_planned(i, timeout_s=30)
            assert got.iteration == i and got.planning_s > 0
            assert comparable(got.plan()) == expected[i]
        # Messages count iterations from 1, as the progress lines do: key 12 is iteration 13.
        with pytest.raises(PlanningServiceError, match="iteration 13: it was already taken"):
            service.get(12)
        with pytest.raises(
            PlanningServiceError, match="iteration 15: the work source ended at iteration 14"
        ):
            service.get(14)
        # A worker that started late, after the other had planned everything, may not have
        # reported yet (its "ready" is read with its first plan): only reported times count.
        reported = [s for s in service.worker_startup_s if s is not None]
        assert reported and all(s > 0 for s in reported)
    assert_no_children(service)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failed_plan_names_its_iteration_and_the_service_goes_on(workers):
    items = work(4)
    items[2] = (2, np.array([100, 200, 300_000]), np.array([7, 8, 9]))
    with PlanningService(RECIPE, items, num_workers=workers) as service:
        service.get(0, timeout_s=30)
        service.get(1, timeout_s=30)
        with pytest.raises(PlanningError, match=r"^iteration 3: .*sample 9 \(length 300000\)"):
            service.get(2, timeout_s=30)
        service.get(3, timeout_s=30)
    assert_no_children(service)


def test_a_late_plan_is_logged_then_times_out_naming_the_iteration(caplog):
    slow = np.arange(800)
    items = [(5, LENGTHS[slow], slow)]
    caplog.set_level(logging.WARNING, logger="dynapipe_planner.service")
    service = PlanningService(EXACT, items, num_workers=1, log_interval_s=0.1)
    try:
        with pytest.raises(PlanTimeoutError) as raised:
            service.get(5, timeout_s=0.4)
        # The message gives the time actually waited: the timeout, or more under load.
        waited = re.search(r"plan of iteration 6 not ready after (\d+\.\d) s", str(raised.value))
        assert waited and float(waited.group(1)) >= 0.4
        assert "waiting for plan of iteration 6 (planner busy/late" in caplog.text
    finally:
        started = time.monotonic()
        service.close()  # the worker is still planning: it must go at once
    assert time.monotonic() - started < 2
    assert_no_children(service)
    with pytest.raises(PlanningServiceError, match="iteration 6: the service is closed"):
        service.get(5)


def test_a_dead_worker_fails_the_iteration_that_waits_for_it():
    with PlanningService(RECIPE, work(), num_workers=1, lookahead=0) as service:
        service.get(0, timeout_s=30)
        (pid,) = service.worker_pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(PlanningServiceError, match=r"iteration 2: .* killed by SIGKILL"):
            service.get(1, timeout_s=30)
        with pytest.raises(PlanningServiceError, match=r"iteration 3: .* killed by SIGKILL"):
            service.get(2, timeout_s=30)
    assert_no_children(service)


def test_workers_skip_the_main_script_and_die_with_a_killed_parent(tmp_path):
    """A training script's imports (torch...) cost seconds per spawned worker: workers must not
    re-import it unless the recipe refers to it, and must go when the parent is SIGKILLed."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import dataclasses, os, signal, sys
            print("script imported as", __name__, file=sys.stderr, flush=True)
            from test_service import RECIPE, work  # PYTHONPATH: the tests' folders
            from dynapipe_planner.planner import PlannerConfig
            from dynapipe_planner.service import PlanningService

            class ScriptConfig(PlannerConfig):  # defined here: its workers need this script
                pass

            if __name__ == "__main__":
                own = dataclasses.replace(RECIPE, config=ScriptConfig(dp_work_budget=0))
                services = [
                    PlanningService(RECIPE, work(), num_workers=2),
                    PlanningService(own, work(), num_workers=1),
                ]
                for service in services:
                    service.get(0, timeout_s=30)
                print(*(p for s in services for p in s.worker_pids), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            """
        )
    )
    path = os.pathsep.join([str(TESTS), str(TESTS / "integration")])
    env = {**os.environ, "PYTHONPATH": path}  # the script's and its workers'
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert out.stderr.count("script imported as __main__") == 1
    assert out.stderr.count("script imported as __mp_main__") == 1  # the ScriptConfig worker
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_work_source_iterations_must_increase():
    items = [*work(2), (1, LENGTHS[:3], np.arange(3))]
    with PlanningService(RECIPE, items, num_workers=0) as service:
        service.get(1)
        with pytest.raises(PlanningServiceError, match="gave iteration 2 after iteration 2"):
            service.get(2)


def test_bad_settings_are_refused():
    with pytest.raises(PlanningServiceError, match="must be >= 0"):
        PlanningService(RECIPE, [], num_workers=-1)
    with pytest.raises(PlanningServiceError, match="recipe must pickle"):
        PlanningService(PlannerRecipe(lambda: None, 2), [])
    assert mp.active_children() == []
