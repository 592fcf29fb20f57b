"""Rebalancing micro-batches across replicas by scheduled makespan
(dynapipe_planner.schedule.balance): it keeps a partition, never slows the slowest replica, and
fixes the case Karmarkar-Karp gets wrong, a replica holding one very long micro-batch."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.microbatch.replicas import karmarkar_karp
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.planner import IterationPlanner, PlannerConfig
from dynapipe_planner.schedule import search_schedule
from dynapipe_planner.schedule.balance import rebalance_replicas

STAGES = 4


def any_replica(makespan):
    """The same price on every replica (homogeneous pipelines)."""
    return lambda _, members: makespan(members)


def chain_aware_makespan(times: np.ndarray):
    """A replica waits for its longest micro-batch's trip through all stages and fills that
    chain's bubbles with only half of its other work (a rough model of real schedules)."""

    def makespan(members):
        t = times[list(members)]
        return max(t.sum(), STAGES * t.max() + (t.sum() - t.max()) / 2)

    return makespan


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.floats(0.01, 10.0), min_size=2, max_size=14),
    st.integers(2, 4),
)
def test_rebalancing_keeps_a_partition_and_never_slows_the_slowest_replica(times, k):
    times = np.array(times)
    makespan = chain_aware_makespan(times)
    start = karmarkar_karp(times, k)
    result = rebalance_replicas(start, any_replica(makespan), times)
    assert sorted(i for part in result for i in part) == list(range(len(times)))
    assert all(part == tuple(sorted(part)) for part in result)
    assert [bool(p) for p in result] == [bool(p) for p in start]  # never empties a replica
    before = max(makespan(p) for p in start if p)
    after = max(makespan(p) for p in result if p)
    assert after <= before
    assert result == rebalance_replicas(start, any_replica(makespan), times)  # deterministic


def test_work_balanced_split_is_rebalanced_around_a_long_micro_batch():
    # Karmarkar-Karp gives the replica of the long micro-batch short ones too, though that
    # micro-batch's chain through 4 stages already takes longer than the other replica's work.
    times = np.array([5.5, 4.0] + [0.5] * 12)
    makespan = chain_aware_makespan(times)
    start = karmarkar_karp(times, 2)
    result = rebalance_replicas(start, any_replica(makespan), times, max_rounds=20)
    assert max(map(makespan, result)) < max(map(makespan, start))
    giant_before = next(p for p in start if 0 in p)
    giant_after = next(p for p in result if 0 in p)
    assert len(giant_after) < len(giant_before)  # short ones moved to the other replica


def test_rebalancing_with_real_schedules_lowers_the_slowest_replica():
    rng = np.random.default_rng(3)
    size = np.concatenate([[3.0], rng.uniform(0.3, 1.2, size=15)])
    fwd = size[:, None] * np.ones(STAGES)
    bwd, act = 2 * fwd, np.ones_like(fwd)
    comm = np.zeros((len(size), STAGES - 1))
    times = (fwd + bwd).max(axis=1)

    def makespan(members):
        m = np.array(members)
        choice = search_schedule(fwd[m], bwd[m], act[m], np.full(STAGES, 1e9), comm[m], comm[m])
        return choice.timeline.makespan

    start = karmarkar_karp(times, 2)
    result = rebalance_replicas(start, any_replica(makespan), times)
    assert max(map(makespan, result)) < 0.95 * max(map(makespan, start))


def test_planner_plans_the_long_tailed_batch_faster_than_the_work_balanced_split():
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=STAGES, num_replicas=2)
    cost_model = AnalyticCostModel(MODEL_PRESETS["gpt-1.3b"], cluster)
    lengths = np.array([6000] + [300 + 37 * i for i in range(60)])
    config = PlannerConfig(num_replicas=2, dp_work_budget=0)
    plan = IterationPlanner(cost_model, STAGES, config).plan(lengths)
    # The same micro-batches, split by work only.
    work_only = IterationPlanner(cost_model, STAGES, config)
    work_only_span = _makespan_of_work_split(work_only, plan, lengths)
    assert plan.stats["predicted_iteration_s"] < work_only_span
    assert math.isfinite(work_only_span)


def _makespan_of_work_split(planner: IterationPlanner, plan, lengths: np.ndarray) -> float:
    costs = planner.costs_of(plan, lengths)
    rows = np.array([m.num_rows for m in plan.microbatches])
    seq = np.array([m.seqlen for m in plan.microbatches])
    zero = np.zeros(len(rows))
    fwd, bwd, act, tra = costs.stage_costs_many(rows, seq, zero)
    spans = []
    for members in karmarkar_karp((fwd + bwd).max(axis=1), 2):
        m = np.array(members)
        comm = costs.p2p_times(rows[m], seq[m], zero[m])
        limit = costs.available_memory() - tra[m].max(axis=0)
        choice = search_schedule(fwd[m], bwd[m], act[m], limit, comm, comm)
        spans.append(choice.timeline.makespan)
    return max(spans)
