"""Heterogeneous plans: pipelines of different depth and TP merged into one ExecutionPlan pass every
simulator check with per-replica costs, survive JSON and binary round trips, and malformed
layouts are rejected naming the item; homogeneous plans serialise exactly as before."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.cli import simulate_main
from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel, PipelineCosts, split_layers
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import (
    ExecutionPlan,
    ReplicaLayout,
    StageLayout,
    load_plan,
)
from dynapipe_planner.plan_merge import merge_pipeline_plans
from dynapipe_planner.planner import IterationPlanner, PlannerConfig
from dynapipe_planner.simulate import simulate, verify_plan

MODEL = MODEL_PRESETS["gpt-350m"]
GOLDEN = "tests/data/homogeneous_plan"


@cache
def planner(depth: int, tp: int) -> IterationPlanner:
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=depth, tp=tp)
    cost_model = AnalyticCostModel(MODEL, cluster)
    return IterationPlanner(cost_model, depth, PlannerConfig())


def layout(replica: int, depth: int, tp: int, first_device: int) -> ReplicaLayout:
    """Consecutive devices, `tp` per stage, layers split as the cost model splits them."""
    bounds = [0, *itertools.accumulate(split_layers(MODEL.num_layers, depth))]
    stages = [
        StageLayout(list(range(first_device + j * tp, first_device + (j + 1) * tp)), tp, (a, b))
        for j, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    return ReplicaLayout(replica, depth, stages)


def costs_of(plan: ExecutionPlan, depth: int, tp: int) -> PipelineCosts:
    """The tables a single-pipeline plan was made with, covering its micro-batches."""
    return planner(depth, tp).cost_model.pipeline_costs(
        plan.stats["recompute"],
        max_samples=max(len(m.samples) for m in plan.microbatches),
        max_seqlen=max(m.seqlen for m in plan.microbatches),
    )


def plan_pipelines(lengths: np.ndarray, owner: list[int], shapes: list[tuple[int, int]]):
    """Plan each pipeline k = (depth, tp) on the samples `owner` assigns it; merge them."""
    plans, layouts, device = [], [], 0
    for k, (depth, tp) in enumerate(shapes):
        ids = np.flatnonzero(np.asarray(owner) == k)
        plans.append(planner(depth, tp).plan(lengths[ids], ids))
        layouts.append(layout(k, depth, tp, device))
        device += depth * tp
    return plans, merge_pipeline_plans(plans, layouts)


SHAPES = [(2, 2), (4, 1)]


@pytest.fixture(scope="module")
def two_pipelines():
    lengths = np.random.default_rng(3).integers(8, 1200, 60)
    owner = [k % 2 for k in range(len(lengths))]
    plans, merged = plan_pipelines(lengths, owner, SHAPES)
    costs = [costs_of(p, *shape) for p, shape in zip(plans, SHAPES, strict=True)]
    return plans, merged, costs


# ---- merge and simulate -----------------------------------------------------------------------


def test_merged_plan_runs_each_pipeline_as_alone(two_pipelines):
    plans, merged, costs = two_pipelines
    verify_plan(merged)
    result = simulate(merged, costs)
    alone = [simulate(p, c).makespan for p, c in zip(plans, costs, strict=True)]
    assert result.makespan == max(alone)
    assert merged.num_stages == 4 and merged.num_replicas == 2
    assert [merged.replica_num_stages(k) for k in (0, 1)] == [2, 4]
    assert result.ranks == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_merge_renumbers_microbatches_and_combines_stats(two_pipelines):
    plans, merged, _ = two_pipelines
    ids = [m.id for m in merged.microbatches]
    assert ids == list(range(sum(len(p.microbatches) for p in plans)))
    for rank in merged.ranks:
        own = {m.id for m in merged.microbatches if m.replica == rank.replica}
        assert {ins.mb for ins in rank.instructions} == own
    first = len(plans[0].microbatches)
    assert [m.samples for m in merged.microbatches[first:]] == [
        m.samples for m in plans[1].microbatches
    ]
    stats = merged.stats
    times = [p.stats["predicted_iteration_s"] for p in plans]
    tokens = [p.stats["tokens"] for p in plans]
    padded = [t / p.stats["padding_efficiency"] for t, p in zip(tokens, plans, strict=True)]
    assert stats["predicted_iteration_s"] == max(times)
    assert stats["tokens"] == sum(tokens)
    assert stats["tokens_per_s"] == pytest.approx(sum(tokens) / max(times))
    assert stats["padding_efficiency"] == pytest.approx(sum(tokens) / sum(padded))
    assert stats["num_microbatches"] == len(merged.microbatches)
    assert stats["peak_memory_bytes"] == [p.stats["peak_memory_bytes"] for p in plans]
    assert stats["pipelines"] == [p.stats for p in plans]
    assert merged.meta["cost_models"] == [p.meta["cost_model"] for p in plans]
    assert stats["budget_exhausted"] is False
    # one pipeline's DP cut short by its time budget marks the whole iteration
    cut = replace(plans[1], stats={**plans[1].stats, "budget_exhausted": True})
    assert merge_pipeline_plans([plans[0], cut], merged.replicas).stats["budget_exhausted"]


def test_one_cost_table_for_a_mixed_plan_is_refused(two_pipelines):
    _, merged, costs = two_pipelines
    with pytest.raises(PlanningError, match=r"replica 1 has 4 stage\(s\) but its cost tables"):
        simulate(merged, costs[0])
    with pytest.raises(PlanningError, match="1 cost table sets for a plan of 2 replicas"):
        simulate(merged, costs[:1])


@settings(max_examples=examples(30), deadline=None)
@given(
    lengths=st.lists(st.integers(8, 1500), min_size=3, max_size=40),
    shapes=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([1, 2])), min_size=2, max_size=3),
    data=st.data(),
)
def test_random_splits_into_pipelines_pass_every_check(lengths, shapes, data):
    shapes = shapes[: len(lengths)]
    rest = data.draw(
        st.lists(
            st.integers(0, len(shapes) - 1),
            min_size=len(lengths) - len(shapes),
            max_size=len(lengths) - len(shapes),
        )
    )
    owner = list(range(len(shapes))) + rest
    plans, merged = plan_pipelines(np.array(lengths), owner, shapes)
    verify_plan(merged)
    costs = [costs_of(p, *shape) for p, shape in zip(plans, shapes, strict=True)]
    result = simulate(merged, costs)
    assert result.makespan == max(
        simulate(p, c).makespan for p, c in zip(plans, costs, strict=True)
    )
    samples = sorted(s for m in merged.microbatches for s in m.samples)
    assert samples == list(range(len(lengths)))


def test_merge_errors_name_the_pipeline(two_pipelines):
    plans, merged, _ = two_pipelines
    layouts = merged.replicas
    with pytest.raises(PlanningError, match="pipeline 1: its plan has 2 replicas"):
        merge_pipeline_plans([plans[0], merged], layouts)
    with pytest.raises(PlanningError, match=r"pipeline 0: its plan has 2 stage\(s\) but its"):
        merge_pipeline_plans([plans[0], plans[1]], [layout(0, 4, 1, 0), layout(1, 4, 1, 4)])
    with pytest.raises(PlanningError, match="pipeline 1: its layout has id 0"):
        merge_pipeline_plans(plans, [layouts[0], layout(0, 4, 1, 4)])
    with pytest.raises(PlanningError, match=r"pipeline 1: sample \d+ is also in pipeline 0"):
        merge_pipeline_plans([plans[0], plans[0]], [layouts[0], layout(1, 2, 2, 4)])
    with pytest.raises(PlanningError, match="2 pipeline plans for 1 layouts"):
        merge_pipeline_plans(plans, layouts[:1])


# ---- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "bin"])
def test_round_trip_is_lossless(tmp_path, two_pipelines, fmt):
    _, merged, _ = two_pipelines
    path = tmp_path / f"plan.{fmt}"
    merged.save(path)
    again = load_plan(path)
    assert again == ExecutionPlan.from_dict(json.loads(json.dumps(merged.to_dict())))
    assert again.to_dict() == json.loads(json.dumps(merged.to_dict()))
    assert again.replicas == merged.replicas
    again.save(tmp_path / f"again.{fmt}")
    assert (tmp_path / f"again.{fmt}").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("fmt", ["json", "bin"])
def test_homogeneous_plans_are_byte_identical_to_before(tmp_path, fmt):
    """The golden files were written by the code before layouts existed."""
    plan = load_plan(f"{GOLDEN}.{fmt}")
    assert plan.replicas == []
    plan.save(tmp_path / f"plan.{fmt}")
    with open(f"{GOLDEN}.{fmt}", "rb") as golden:
        assert (tmp_path / f"plan.{fmt}").read_bytes() == golden.read()
    assert "replicas" not in plan.to_dict()


def test_dynapipe_simulate_rebuilds_per_pipeline_cost_models(tmp_path, two_pipelines, capsys):
    _, merged, costs = two_pipelines
    path = tmp_path / "hetero.bin"
    merged.save(path)
    trace = tmp_path / "trace.json"
    assert simulate_main([str(path), "--trace", str(trace)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["makespan_s"] == pytest.approx(simulate(merged, costs).makespan)
    assert [(r["replica"], r["stage"]) for r in summary["ranks"]] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    names = {
        (e["pid"], e["args"]["name"])
        for e in json.loads(trace.read_text())["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert (1, "stage 3") in names and (0, "stage 3") not in names


def test_dynapipe_simulate_needs_one_cost_model_per_pipeline(tmp_path, two_pipelines, capsys):
    _, merged, _ = two_pipelines
    data = merged.to_dict()
    data["meta"]["cost_models"].pop()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert simulate_main([str(path)]) == 2
    assert "carries 1 cost model description(s)" in capsys.readouterr().err


# ---- malformed layouts ------------------------------------------------------------------------


def rank_index(data: dict, replica: int, stage: int) -> int:
    return next(
        k for k, r in enumerate(data["ranks"]) if (r["replica"], r["stage"]) == (replica, stage)
    )


def set_stage(data: dict, replica: int, stage: int, new_stage: int) -> None:
    data["ranks"][rank_index(data, replica, stage)]["stage"] = new_stage


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: set_stage(d, 0, 1, 2),
            r"rank \(replica 0, stage 2\) is out of range: replica 0 has 2 stage\(s\)",
        ),
        (
            lambda d: d["ranks"].pop(rank_index(d, 1, 3)),
            "5 ranks, expected 6; no rank plan for replica 1 stage 3",
        ),
        (
            lambda d: d["replicas"][1]["stages"].pop(),
            r"replica 1 lists 3 stage layout\(s\) but has num_stages 4",
        ),
        (
            lambda d: d["replicas"][1]["stages"][2].update(devices=[1]),
            "replica 1 stage 2: device 1 is also used by replica 0 stage 0",
        ),
        (
            lambda d: d["replicas"][0]["stages"][1].update(devices=[0, 2]),
            "replica 0 stage 1: device 0 is also used by replica 0 stage 0",
        ),
        (
            lambda d: d["replicas"][1]["stages"][2].update(layers=[13, 18]),
            r"replica 1 stage 2 holds layers \[13, 18\); it must start at layer 12",
        ),
        (
            lambda d: d["replicas"][1]["stages"][0].update(layers=[0, 0]),
            r"replica 1 stage 0 holds layers \[0, 0\)",
        ),
        (
            lambda d: d["replicas"][1]["stages"][3].update(layers=[18, 20]),
            r"replica 1 holds layers \[0, 20\) but replica 0 holds \[0, 24\)",
        ),
        (
            lambda d: d["replicas"][0]["stages"][1].update(tp=0, devices=[]),
            "replica 0 stage 1 has tp 0; tp must be >= 1",
        ),
        (
            lambda d: d["replicas"][0]["stages"][1].update(tp=3),
            r"replica 0 stage 1 has 2 device\(s\) for tp 3",
        ),
        (lambda d: d.update(num_stages=5), "num_stages 5, but the deepest replica has 4"),
        (lambda d: d["replicas"].pop(), "1 replica layouts for num_replicas 2"),
        (lambda d: d["replicas"][1].update(id=0), "replicas.1. has id 0"),
        (
            lambda d: d["replicas"][0]["stages"][0].update(layers=[0, 6, 12]),
            r"replicas\[0\].stages\[0\].layers must be \[start, end\)",
        ),
        (
            lambda d: d["replicas"][1]["stages"][1].pop("tp"),
            r"replicas\[1\].stages\[1\] is missing 'tp'",
        ),
    ],
)
def test_malformed_layouts_name_the_item(two_pipelines, edit, message):
    _, merged, _ = two_pipelines
    data = json.loads(json.dumps(merged.to_dict()))
    edit(data)
    with pytest.raises(PlanningError, match=message):
        ExecutionPlan.from_dict(data, "bad.json")


def test_last_stage_of_a_shallow_replica_has_no_peer_above(two_pipelines):
    _, merged, _ = two_pipelines
    data = json.loads(json.dumps(merged.to_dict()))
    program = data["ranks"][rank_index(data, 0, 1)]["instructions"]
    mb = program[0]["mb"]
    program.append({"op": "SendActStart", "mb": mb, "peer": 2, "shape": [1, 8, 8], "dtype": "bf16"})
    with pytest.raises(PlanningError, match=r"peer stage 2 does not exist; replica 0 has 2"):
        ExecutionPlan.from_dict(data)


def test_invalid_plan_is_never_written(tmp_path, two_pipelines):
    _, merged, _ = two_pipelines
    broken = ExecutionPlan.from_dict(json.loads(json.dumps(merged.to_dict())))
    broken.replicas[1].stages[0].tp = 0
    with pytest.raises(PlanningError, match="replica 1 stage 0 has tp 0"):
        broken.save(tmp_path / "plan.bin")
    assert list(tmp_path.iterdir()) == []


def test_merge_rejects_a_broken_pipeline_plan(two_pipelines):
    plans, merged, _ = two_pipelines
    broken = ExecutionPlan.from_dict(json.loads(json.dumps(plans[1].to_dict())))
    broken.ranks.pop()
    with pytest.raises(PlanningError, match="pipeline 1: 3 ranks, expected 4"):
        merge_pipeline_plans([plans[0], broken], merged.replicas)
