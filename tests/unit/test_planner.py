"""Plans from the whole planner pass every simulator check, for random batches, pipeline depths,
replica counts, memory limits, schedules and micro-batching methods."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.cluster import ClusterSpec, GiB, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.cost.table import mix_stages
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.microbatch import ordering
from dynapipe_planner.microbatch.baselines import Group
from dynapipe_planner.microbatch.ordering import order_samples
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig
from dynapipe_planner.simulate import simulate

T5_TINY = ModelSpec("t5-tiny", "t5", 4, 256, 4, 1024, 32128)


def make_planner(model, stages, replicas, memory_gib, **config) -> IterationPlanner:
    cluster = ClusterSpec(
        get_gpu("A100-40GB"),
        num_stages=stages,
        num_replicas=replicas,
        memory_limit_bytes=int(memory_gib * GiB),
    )
    return IterationPlanner(
        AnalyticCostModel(model, cluster), stages, PlannerConfig(num_replicas=replicas, **config)
    )


def check_plan(planner: IterationPlanner, plan: ExecutionPlan, lengths: np.ndarray) -> None:
    """Samples each used once; the simulator accepts the plan (order, shapes, deadlock, memory)
    and its timeline agrees with the planner's prediction."""
    used = sorted(s for m in plan.microbatches for s in m.samples)
    assert used == list(range(len(lengths)))
    for m in plan.microbatches:
        own = lengths[m.samples]
        if own.ndim == 1:
            assert m.seqlen >= own.max() or m.row_sizes
        else:
            assert m.seqlen >= own[:, 0].max() and m.tgt_seqlen >= own[:, 1].max()
    costs = planner.costs_of(plan, lengths)
    result = simulate(plan, costs, check_memory=True)
    predicted = plan.stats["predicted_iteration_s"]
    assert result.makespan == pytest.approx(predicted, rel=0.05)
    assert 0.0 <= plan.stats["bubble_fraction"] < 1.0
    assert 0.0 < plan.stats["padding_efficiency"] <= 1.0


lengths_st = st.lists(st.integers(1, 2048), min_size=1, max_size=60).map(np.array)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_st,
    stages=st.integers(1, 5),
    replicas=st.integers(1, 3),
    memory_gib=st.floats(4, 40),
    schedule=st.sampled_from(["adaptive", "1f1b"]),
    batching=st.sampled_from(["dynamic", "packing", "padding", "token-budget"]),
)
def test_plans_pass_the_simulator(lengths, stages, replicas, memory_gib, schedule, batching):
    planner = make_planner(
        MODEL_PRESETS["gpt-350m"],
        stages,
        replicas,
        memory_gib,
        schedule=schedule,
        batching=batching,
    )
    try:
        plan = planner.plan(lengths)
    except PlanningError as e:
        # Infeasible is a legitimate answer only with a reason that names what does not fit.
        assert any(w in str(e) for w in ("sample", "micro-batch", "memory", "replicas")), str(e)
        assume(False)
    check_plan(planner, plan, lengths)
    assert plan.num_stages == stages and plan.num_replicas == replicas


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pairs=st.lists(st.tuples(st.integers(1, 512), st.integers(1, 128)), min_size=1, max_size=30),
    stages=st.integers(1, 4),
    schedule=st.sampled_from(["adaptive", "1f1b"]),
)
def test_encoder_decoder_plans_pass_the_simulator(pairs, stages, schedule):
    lengths = np.array(pairs)
    planner = make_planner(T5_TINY, stages, 1, 8, schedule=schedule)
    check_plan(planner, planner.plan(lengths), lengths)


def test_dynapipe_is_no_slower_than_its_own_1f1b_ablation():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.exp(rng.normal(np.log(300), 1.0, 200)), 8, 4096).astype(int)
    times = {}
    for schedule in ("adaptive", "1f1b"):
        planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 4, 2, 36, schedule=schedule)
        times[schedule] = planner.plan(lengths).stats["predicted_iteration_s"]
    assert times["adaptive"] <= times["1f1b"] * 1.0001


def test_gradient_sends_are_not_held_to_the_end_of_the_iteration():
    """A sent gradient's buffer lives until its Wait and the schedule prices no such buffers, so
    each is waited for before the stage's backward of a later micro-batch, not all at the end."""
    planner = make_planner(MODEL_PRESETS["gpt-125m"], 2, 1, 20, micro_batch_size=1)
    lengths = np.full(12, 1024)
    plan = planner.plan(lengths)
    program = [(ins.op, ins.mb) for ins in plan.rank_plan(0, 1).instructions]
    backwards = [mb for op, mb in program if op == "BackwardPass"]
    assert len(backwards) > 3
    for sent, later in zip(backwards, backwards[2:], strict=False):
        assert program.index(("WaitSendGrad", sent)) < program.index(("BackwardPass", later))
    check_plan(planner, plan, lengths)


def test_sample_ids_are_carried_into_the_plan():
    planner = make_planner(MODEL_PRESETS["gpt-125m"], 2, 1, 20)
    ids = np.array([1000, 1001, 1002, 1003])
    plan = planner.plan(np.array([10, 300, 20, 40]), ids)
    assert sorted(s for m in plan.microbatches for s in m.samples) == ids.tolist()


def test_recompute_auto_picks_recomputation_when_nothing_fits_without_it():
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 16)
    lengths = np.array([4096, 100, 200])
    with pytest.raises(PlanningError, match=r"sample 0 \(length 4096"):
        make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 16, recompute="none").plan(lengths)
    plan = planner.plan(lengths)
    assert plan.stats["recompute"] in ("selective", "full")


STAGE_MODES = [("full", "full"), ("full", "none"), ("none", "none")]


def test_stage_recompute_fixes_each_stages_mode():
    """A HexiScale plan's per-stage modes: stage j is priced (time and memory, `mix_stages`)
    and simulated under its own mode, and the plan names the modes per stage."""
    lengths = np.random.default_rng(5).integers(200, 2048, 24)
    model = MODEL_PRESETS["gpt-1.3b"]
    plans = {modes: make_planner(model, 2, 1, 40, stage_recompute=modes) for modes in STAGE_MODES}
    predicted = {}
    for modes, planner in plans.items():
        plan = planner.plan(lengths)
        assert plan.stats["recompute"] == list(modes)
        check_plan(planner, plan, lengths)
        costs = planner.costs_of(plan, lengths)
        for j, mode in enumerate(modes):
            alone = planner.costs(mode, lengths, max(m.seqlen for m in plan.microbatches))
            np.testing.assert_array_equal(costs.forward[j], alone.forward[j])
            np.testing.assert_array_equal(costs.activation[j], alone.activation[j])
        predicted[modes] = plan.stats["predicted_iteration_s"]
    # Recomputing on fewer stages is never slower.
    assert predicted[("full", "none")] <= predicted[("full", "full")]
    assert predicted[("none", "none")] <= predicted[("full", "none")]
    # One long sample at 32 GiB: the last stage (with the output layer) must recompute, the
    # first need not; no single mode is both feasible and as fast.
    long = np.array([4096, 100, 200])
    with pytest.raises(PlanningError):
        make_planner(model, 2, 1, 32, stage_recompute=("none", "none")).plan(long)
    mixed = make_planner(model, 2, 1, 32, stage_recompute=("none", "full")).plan(long)
    full = make_planner(model, 2, 1, 32, recompute="full").plan(long)
    assert mixed.stats["predicted_iteration_s"] < 0.95 * full.stats["predicted_iteration_s"]
    with pytest.raises(PlanningError, match="lists 1 modes for 2 stages"):
        make_planner(model, 2, 1, 40, stage_recompute=("full",))
    with pytest.raises(PlanningError, match=r"stage_recompute\[1\] must be one of"):
        make_planner(model, 2, 1, 40, stage_recompute=("full", "half"))


def test_mix_stages_rejects_tables_of_other_grids():
    model = MODEL_PRESETS["gpt-350m"]
    planner = make_planner(model, 2, 1, 40)
    short = planner.costs("none", np.array([100]))
    long = planner.costs("full", np.array([4000]))
    with pytest.raises(PlanningError, match="stage 1: its table has another shape or grid"):
        mix_stages([short, long])


def test_an_exhausted_dp_budget_reaches_the_plans_stats():
    """With a budget no DP pass fits in, the plan is still valid and says the DP was cut short;
    without a budget (0) the same DP runs all its passes and says nothing was cut."""
    lengths = np.random.default_rng(3).integers(1, 2000, 80)
    model = MODEL_PRESETS["gpt-350m"]
    dp_only = {"bucket_rel": 0.0, "packed_rows": False}  # packed rows could win without a DP
    full = make_planner(model, 3, 2, 20, dp_work_budget=0, **dp_only).plan(lengths)
    assert full.stats["dp_passes"] > 1 and full.stats["budget_exhausted"] is False
    planner = make_planner(model, 3, 2, 20, dp_work_budget=1, **dp_only)
    cut = planner.plan(lengths)
    assert cut.stats["dp_passes"] == 1 and cut.stats["budget_exhausted"] is True
    check_plan(planner, cut, lengths)
    assert ExecutionPlan.from_bytes(cut.to_bytes()).stats["budget_exhausted"] is True
    padded = make_planner(model, 3, 2, 20, batching="padding", dp_work_budget=1)
    assert padded.plan(lengths).stats["budget_exhausted"] is False


def test_deterministic():
    lengths = np.random.default_rng(3).integers(1, 2000, 80)
    a = make_planner(MODEL_PRESETS["gpt-350m"], 3, 2, 20).plan(lengths).to_dict()
    b = make_planner(MODEL_PRESETS["gpt-350m"], 3, 2, 20).plan(lengths).to_dict()
    for d in (a, b):
        d["stats"].pop("planning_time_s")
    assert a == b


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        (np.array([], dtype=int), "empty batch"),
        (np.array([5, 0, 7]), "sample 1 has length 0"),
        (np.array([5, -3]), "sample 1 has length -3"),
    ],
)
def test_bad_lengths_are_named(lengths, message):
    with pytest.raises(PlanningError, match=message):
        make_planner(MODEL_PRESETS["gpt-125m"], 2, 1, 20).plan(lengths)


def test_more_replicas_than_microbatches_is_explained():
    planner = make_planner(MODEL_PRESETS["gpt-125m"], 2, 3, 20)
    with pytest.raises(PlanningError, match="cannot feed 3 replicas"):
        planner.plan(np.array([100]))


def test_every_replica_gets_a_microbatch_when_one_would_do():
    # Four short samples fit in one micro-batch; two replicas still each need one.
    planner = make_planner(MODEL_PRESETS["gpt-125m"], 2, 2, 20)
    lengths = np.array([30, 40, 50, 60])
    plan = planner.plan(lengths)
    check_plan(planner, plan, lengths)
    assert {m.replica for m in plan.microbatches} == {0, 1}


def test_packing_rows_longer_than_every_sample_are_priced_not_rejected():
    # Rows of 8192 tokens from samples of at most 700: the cost grid must cover the rows, not
    # just the samples (it once followed the samples and called such rows out of memory).
    planner = make_planner(MODEL_PRESETS["gpt-125m"], 2, 1, 40, batching="packing", max_seqlen=8192)
    lengths = np.random.default_rng(2).integers(50, 700, size=60)
    plan = planner.plan(lengths)
    assert {m.seqlen for m in plan.microbatches} == {8192}
    check_plan(planner, plan, lengths)


def test_given_micro_batches_are_planned_as_given():
    planner = make_planner(MODEL_PRESETS["gpt-125m"], 2, 1, 40, schedule="1f1b")
    lengths = np.array([100, 300, 200, 50])
    groups = [
        Group(np.array([0, 3]), 150, rows=[[0, 3]], attention_saved=150**2 - 100**2 - 50**2),
        Group(np.array([1, 2]), 300),
    ]
    plan = planner.plan(lengths, groups=groups)
    assert [(m.samples, m.seqlen, m.row_sizes) for m in plan.microbatches] == [
        ([0, 3], 150, [2]),
        ([1, 2], 300, []),
    ]
    check_plan(planner, plan, lengths)


def test_predict_is_the_planned_iteration_time():
    planner = make_planner(MODEL_PRESETS["gpt-350m"], 3, 2, 20)
    lengths = np.random.default_rng(8).integers(20, 900, size=80)
    assert planner.predict(lengths) == planner.plan(lengths).stats["predicted_iteration_s"]


def test_tsp_order_is_a_permutation_and_plans_cleanly():
    rng = np.random.default_rng(5)
    lengths = np.stack([rng.integers(1, 512, 60), rng.integers(1, 128, 60)], axis=1)
    perm = order_samples(lengths, "tsp")
    assert sorted(perm.tolist()) == list(range(60))
    # Equal (input, target) points stay adjacent: the path visits distinct points.
    points = [tuple(p) for p in lengths[perm]]
    assert len({p for i, p in enumerate(points) if i == 0 or points[i - 1] != p}) == len(
        set(points)
    )
    planner = make_planner(T5_TINY, 2, 1, 8, order="tsp")
    check_plan(planner, planner.plan(lengths), lengths)


def test_tsp_distance_matrix_and_callback_find_the_same_path(monkeypatch):
    """Up to `MATRIX_MAX_POINTS` distinct points OR-Tools reads the distances as one matrix;
    beyond, a Python callback gives them: the same distances, so the same path."""
    rng = np.random.default_rng(6)
    lengths = np.stack([rng.integers(1, 2048, 30), rng.integers(1, 256, 30)], axis=1)
    with_matrix = order_samples(lengths, "tsp")
    monkeypatch.setattr(ordering, "MATRIX_MAX_POINTS", 0)
    assert np.array_equal(order_samples(lengths, "tsp"), with_matrix)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_st,
    stages=st.integers(1, 4),
    replicas=st.integers(1, 2),
    memory_gib=st.floats(4, 40),
)
def test_dynapipe_is_never_predicted_slower_than_packing(lengths, stages, replicas, memory_gib):
    """Packed rows are in DynaPipe's space (issue 21): per DP micro-batch, and the packing
    baseline's whole-batch rows in every recomputation mode (with the DP packing while it
    partitions: tests/unit/test_packed_dp.py)."""
    times = {}
    for batching in ("dynamic", "packing"):
        planner = make_planner(
            MODEL_PRESETS["gpt-350m"], stages, replicas, memory_gib, batching=batching,
            schedule="1f1b" if batching == "packing" else "adaptive",
        )  # fmt: skip
        try:
            times[batching] = planner.plan(lengths).stats["predicted_iteration_s"]
        except PlanningError:
            times[batching] = float("inf")
    assert times["dynamic"] <= times["packing"] * (1 + 1e-9)


def test_a_micro_batch_packed_into_rows_of_its_length() -> None:
    from dynapipe_planner.microbatch.baselines import packed_group

    lengths = np.array([7, 3, 4, 2, 9, 1])
    group = packed_group(Group(np.array([0, 1, 2, 3, 5]), 8), lengths)
    rows = [sorted(lengths[r].tolist()) for r in group.rows]
    assert sorted(rows) == [[1, 7], [2], [3, 4]]  # first-fit-decreasing: 7 | 4 3 | 2, then 1
    assert sorted(group.samples.tolist()) == [0, 1, 2, 3, 5] and group.seqlen == 8
    assert group.attention_saved == 3 * 64 - (49 + 1) - (16 + 9) - 4
    alone = packed_group(Group(np.array([0, 4]), 9), lengths)  # 7 + 9 > 9: one per row
    assert alone.rows == [[0], [4]] and alone.attention_saved == 2 * 81 - 49 - 81


def test_dp_micro_batches_become_packed_rows_where_cheaper() -> None:
    rng = np.random.default_rng(4)
    lengths = np.clip(np.exp(rng.normal(np.log(200), 1.2, 300)), 8, 2048).astype(int)
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 36)
    plan = planner.plan(lengths)
    check_plan(planner, plan, lengths)
    assert any(m.row_sizes for m in plan.microbatches), plan.stats["batching"]
