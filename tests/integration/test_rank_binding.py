"""Binding a HexiScale plan's cluster devices to launcher ranks (`hetero.rank_binding`): every
used device gets one rank, each pipeline's stages keep their order and land on increasing ranks
(what the runtime's `--hetero-plan` accepts), and per-device values follow their device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.errors import PlanningError
from dynapipe_planner.hetero.cli import hetero_main
from dynapipe_planner.hetero.layout import HeteroPipeline, HeteroPlan, HeteroStage
from dynapipe_planner.hetero.plan_file import load_plan, plan_to_dict
from dynapipe_planner.hetero.rank_binding import bind_ranks
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec
from megatron.dynapipe.layouts.plan_file import HeteroPlanError, parse_hetero_plan

LAYERS = 4
SPEC = ModelSpec("t", "gpt", LAYERS, 64, 4, 256, 512)


@st.composite
def plans(draw) -> HeteroPlan:
    """Pipelines over a random subset of devices in random order, random stage depths and TP."""
    num_devices = draw(st.integers(1, 12))
    devices = draw(st.permutations(range(num_devices)))
    used = devices[: draw(st.integers(1, num_devices))]
    pipelines, at = [], 0
    while at < len(used):
        depth = draw(st.integers(1, min(LAYERS, len(used) - at)))
        cuts = sorted(
            draw(st.sets(st.integers(1, LAYERS - 1), min_size=depth - 1, max_size=depth - 1))
        )
        bounds = [0, *cuts, LAYERS]
        stages = []
        for j in range(depth):
            left = len(used) - at - (depth - j - 1)  # leave a device for each later stage
            tp = draw(st.sampled_from([t for t in (1, 2, 4) if t <= left]))
            stages.append(HeteroStage(tuple(used[at : at + tp]), (bounds[j], bounds[j + 1])))
            at += tp
        pipelines.append(HeteroPipeline(tuple(stages), draw(st.integers(1, 8))))
    return HeteroPlan(pipelines, 1, 128, "t", "c", {"estimate_s": 1.0})


@settings(max_examples=examples(200), deadline=None)
@given(plans())
def test_every_device_once_stage_order_kept_and_runtime_accepts(plan: HeteroPlan) -> None:
    binding = bind_ranks(plan)
    used = [d for p in plan.pipelines for s in p.stages for d in s.devices]
    # Every used device gets exactly one rank, ranks are 0..n-1.
    assert sorted(binding.device_of_rank) == sorted(used)
    assert binding.world_size == len(used)
    bound = binding.plan
    for before, after in zip(plan.pipelines, bound.pipelines, strict=True):
        assert after.micro_batches == before.micro_batches
        assert len(after.stages) == len(before.stages)
        for s0, s1 in zip(before.stages, after.stages, strict=True):
            # Same layers, same TP group in the same order, only renamed.
            assert s1.layers == s0.layers
            assert [binding.device_of_rank[r] for r in s1.devices] == list(s0.devices)
        for s0, s1 in zip(after.stages, after.stages[1:], strict=False):
            assert min(s1.devices) > max(s0.devices)
    assert bound.stats["device_of_rank"] == list(binding.device_of_rank)
    assert bound.stats["estimate_s"] == 1.0
    # The runtime's reader takes the bound plan as it is.
    layouts, fractions, _ = parse_hetero_plan(plan_to_dict(bound), SPEC, binding.world_size)
    assert [len(lay.stages) for lay in layouts] == [len(p.stages) for p in plan.pipelines]
    sizes = [p.micro_batches for p in plan.pipelines]
    assert fractions == pytest.approx([s / sum(sizes) for s in sizes])


def test_a_stage_order_against_device_order_runs_after_binding() -> None:
    # Stage 0 on the slow devices 2, 3 (TP2), stage 1 on device 0; device 1 alone.
    plan = HeteroPlan(
        [
            HeteroPipeline((HeteroStage((3, 2), (0, 1)), HeteroStage((0,), (1, 4))), 3),
            HeteroPipeline((HeteroStage((1,), (0, 4)),), 2),
        ],
        1,
        128,
    )
    with pytest.raises(HeteroPlanError, match="stage 1 runs on rank 0, not above rank 3"):
        parse_hetero_plan(plan_to_dict(plan), SPEC, 4)
    binding = bind_ranks(plan)
    assert binding.device_of_rank == (3, 2, 0, 1)
    assert [s.devices for s in binding.plan.pipelines[0].stages] == [(0, 1), (2,)]
    parse_hetero_plan(plan_to_dict(binding.plan), SPEC, 4)
    # Speeds given per cluster device follow their device to its rank.
    slowdown_of_device = [1.0, 1.0, 2.0, 2.5]
    assert binding.per_rank(slowdown_of_device) == [2.5, 2.0, 1.0, 1.0]
    with pytest.raises(PlanningError, match=r"device\(s\) \[3, 2\]"):
        binding.per_rank([1.0, 1.0])


def test_a_device_used_twice_is_named() -> None:
    plan = HeteroPlan(
        [
            HeteroPipeline((HeteroStage((0,), (0, 4)),), 1),
            HeteroPipeline((HeteroStage((1,), (0, 2)), HeteroStage((0,), (2, 4))), 1),
        ],
        1,
        128,
    )
    with pytest.raises(
        PlanningError, match="pipeline 1 stage 1: device 0 is already used by pipeline 0 stage 0"
    ):
        bind_ranks(plan)


def test_cli_writes_a_bound_plan(tmp_path: Path, capsys) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: two-speeds\nnetwork: {bandwidth_gbs: 1}\nmachines:\n"
        "  - {name: slow, gpu: A100-80GB, count: 2, peak_tflops: 100}\n"
        "  - {name: fast, gpu: A100-80GB, count: 2}\n"
    )
    out = tmp_path / "p.json"
    argv = ["--cluster", str(cluster), "--model", "gpt-1.3b", "--seq-length", "1024"]
    argv += ["--global-batch-size", "16", "--max-plans", "40", "--quiet", "--output", str(out)]
    assert hetero_main([*argv, "--bind-ranks"]) == 0
    printed = capsys.readouterr().out
    plan = load_plan(out)
    device_of_rank = json.loads(out.read_text())["stats"]["device_of_rank"]
    assert sorted(device_of_rank) == sorted(d for p in plan.pipelines for d in p.devices)
    for r, d in enumerate(device_of_rank):
        assert f"{r}=device {d} ({'slow' if d < 2 else 'fast'})" in printed
    parse_hetero_plan(json.loads(out.read_text()), MODEL_PRESETS["gpt-1.3b"], len(device_of_rank))
