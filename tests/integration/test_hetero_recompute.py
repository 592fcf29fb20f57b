"""Recomputation chosen per stage in the HexiScale planner (`TrainingJob(recompute="auto")`):
layer assignment over several modes is exactly optimal, a stage runs its fastest mode that fits,
and plans, replays, the exact reference, the table and the CLI agree."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

from dynapipe_planner.devices import cluster_from_dict, load_cluster
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.hetero.cli import hetero_main
from dynapipe_planner.hetero.cost import (
    HeteroCostModel,
    StageOption,
    TrainingJob,
    fastest_holding,
)
from dynapipe_planner.hetero.layer_assign import (
    StageShape,
    assign_layers,
    pipeline_profile,
    stage_shapes,
)
from dynapipe_planner.hetero.milp import milp_reference
from dynapipe_planner.hetero.plan_file import plan_table
from dynapipe_planner.hetero.search import SearchConfig, hexiscale_search
from dynapipe_planner.hetero.simulate import simulate_plan
from dynapipe_planner.model_spec import MODEL_PRESETS

EXAMPLES = ROOT / "examples" / "clusters"
FAST = SearchConfig()


def brute_force(shapes: list[StageShape], layers: int) -> float:
    """Smallest achievable slowest-stage time over every split of `layers` (inf: none fits)."""
    best = math.inf
    for cut in itertools.combinations(range(1, layers), len(shapes) - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, layers), strict=True)]
        best = min(best, max(s.time_s(n) for s, n in zip(shapes, counts, strict=True)))
    return best


def random_shape(rng: random.Random, j: int) -> StageShape:
    options = []
    for mode in rng.sample(["none", "selective", "full"], rng.randint(1, 3)):
        options.append(
            StageOption(
                mode,
                rng.choice([1.0, 1.5, 2.0, 3.0]),
                rng.choice([0.0, 0.5, 2.0]),
                rng.randint(0, 6),
            )
        )
    return StageShape((j,), tuple(options))


def test_assign_layers_with_modes_is_optimal() -> None:
    rng = random.Random(0)
    infeasible = 0
    for case in range(400):
        shapes = [random_shape(rng, j) for j in range(rng.randint(1, 4))]
        layers = rng.randint(1, 9)
        optimum = brute_force(shapes, layers) if len(shapes) <= layers else math.inf
        counts = assign_layers(shapes, layers)
        if math.isinf(optimum):
            assert counts is None, case
            infeasible += 1
            continue
        assert counts is not None and sum(counts) == layers and min(counts) >= 1, case
        _, bottleneck = pipeline_profile(shapes, counts)
        assert bottleneck == pytest.approx(optimum, rel=1e-9), (case, counts)
    assert 0 < infeasible < 300  # both outcomes exercised


def test_fastest_holding_prefers_speed_then_memory() -> None:
    options = (
        StageOption("none", 1.0, 0.0, 2),
        StageOption("selective", 1.2, 0.0, 4),
        StageOption("full", 1.5, 0.0, 8),
    )
    assert [fastest_holding(options, n).mode for n in (1, 2, 3, 8)] == [
        "none",
        "none",
        "selective",
        "full",
    ]
    # Nothing holds 9 layers: the most frugal mode, so the estimate reports it out of memory.
    assert fastest_holding(options, 9).mode == "full"


def mixed_cost(recompute: str, batch: int = 16) -> HeteroCostModel:
    cluster = cluster_from_dict(
        {
            "network": {"bandwidth_gbs": 1.25, "latency_us": 30},
            "machines": [
                {"name": "a", "gpu": "A100-80GB", "count": 2},
                {"name": "b", "gpu": "RTX4090", "count": 2},
            ],
        }
    )
    job = TrainingJob(
        MODEL_PRESETS["gpt-1.3b"], seqlen=2048, global_batch=batch, recompute=recompute
    )
    return HeteroCostModel(cluster, job)


def test_auto_is_never_slower_than_one_mode_on_the_same_stages() -> None:
    auto = mixed_cost("auto")
    stages = [(0,), (1,), (2,), (3,)]
    best = pipeline_profile(s := stage_shapes(auto, stages, 1), assign_layers(s, 24))[1]
    for mode in ("none", "selective", "full"):
        fixed = mixed_cost(mode)
        shapes = stage_shapes(fixed, stages, 1)
        layers = assign_layers(shapes, 24)
        if layers is not None:
            assert best <= pipeline_profile(shapes, layers)[1] * (1 + 1e-12)


def test_each_stage_runs_its_fastest_mode_that_fits() -> None:
    cost = HeteroCostModel(
        load_cluster(EXAMPLES / "hexiscale_setting1.yaml"),
        TrainingJob(MODEL_PRESETS["llama2-7b"], global_batch=1024, recompute="auto"),
    )
    plan = hexiscale_search(cost, FAST).plan
    est = cost.estimate(plan)
    assert est.fits, est.oom
    seen = set()
    for p, costs in zip(plan.pipelines, est.stages, strict=True):
        depth = len(p.stages)
        for j, (stage, c) in enumerate(zip(p.stages, costs, strict=True)):
            options = cost.stage_options(
                stage.devices,
                j == 0,
                j == depth - 1,
                min(depth - j, p.micro_batches),
                len(plan.pipelines),
            )
            chosen = next(o for o in options if o.mode == c.recompute)
            assert chosen.capacity >= stage.num_layers
            assert c.memory_bytes <= c.memory_limit_bytes
            faster = [o for o in options if o.per_layer_s < chosen.per_layer_s]
            assert all(o.capacity < stage.num_layers for o in faster), (j, c.recompute)
            seen.add(c.recompute)
    # 24 GB GPUs under 1F1B: early stages need full recomputation, later ones none.
    assert {"full", "none"} <= seen
    assert plan.stats["recompute"] == [[c.recompute for c in s] for s in est.stages]
    sim = simulate_plan(cost, plan)
    assert sim.iteration_s == pytest.approx(est.iteration_s, rel=0.01)
    assert sim.iteration_s <= est.iteration_s * (1 + 1e-9)
    full = hexiscale_search(
        HeteroCostModel(cost.cluster, TrainingJob(MODEL_PRESETS["llama2-7b"], global_batch=1024)),
        FAST,
    )
    assert est.mfu > full.estimate.mfu
    assert "recompute" in plan_table(plan).splitlines()[0]


def test_planner_matches_exact_reference_with_auto() -> None:
    cost = mixed_cost("auto")
    ours = hexiscale_search(cost, FAST)
    exact_plan, exact = milp_reference(cost)
    assert cost.estimate(exact_plan).fits
    assert exact.mfu >= ours.estimate.mfu - 1e-9
    assert ours.estimate.mfu >= exact.mfu - 0.02


def test_bad_recompute_is_named(capsys) -> None:
    with pytest.raises(PlanningError, match="'sometimes'"):
        TrainingJob(MODEL_PRESETS["gpt-1.3b"], recompute="sometimes")
    with pytest.raises(SystemExit):
        hetero_main(["--cluster", str(EXAMPLES / "mixed_8gpu.yaml"), "--recompute", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_cli_auto_prints_each_stages_mode(capsys) -> None:
    code = hetero_main(
        [
            "--cluster",
            str(EXAMPLES / "mixed_8gpu.yaml"),
            "--model",
            "llama2-7b",
            "--global-batch-size",
            "64",
            "--recompute",
            "auto",
            "--max-plans",
            "40",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    modes = {w for row in rows for w in row if w in ("none", "selective", "full")}
    assert modes, out


def test_dynapipe_simulate_prices_each_stages_mode(tmp_path: Path, capsys) -> None:
    """A static layout's plan with modes per stage (as `--hetero-plan` runs it) is simulated
    under those modes by `dynapipe-simulate`, matching the planner's prediction."""
    import json

    from dynapipe_planner.cli import simulate_main
    from dynapipe_planner.model_spec import ModelSpec
    from dynapipe_planner.plan import ReplicaLayout, StageLayout
    from dynapipe_planner.planner import PlannerConfig
    from dynapipe_planner.static_hetero import StaticHeteroRecipe

    spec = ModelSpec("tiny", "gpt", 4, 32, 4, 128, 256, max_position_embeddings=128)
    layouts = (
        ReplicaLayout(0, 2, [StageLayout([0], 1, (0, 2)), StageLayout([1], 1, (2, 4))]),
        ReplicaLayout(1, 1, [StageLayout([2], 1, (0, 4))]),
    )
    modes = (("full", "none"), ("selective",))
    recipe = StaticHeteroRecipe(spec, "A100-80GB", layouts, (0.6, 0.4), PlannerConfig(), 0, modes)
    plan = recipe.build().plan(np.array([100, 30, 64, 12, 90, 7, 128, 50]))
    assert [p["recompute"] for p in plan.stats["pipelines"]] == [list(m) for m in modes]
    path = tmp_path / "plan.json"
    plan.save(path)
    assert simulate_main([str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["makespan_s"] == pytest.approx(plan.stats["predicted_iteration_s"], rel=1e-6)
