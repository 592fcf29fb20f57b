"""What a heterogeneous job reads before any process group exists: the `--hetero-plan` file,
a `dynapipe-strategy propose` candidates file, `--device-speed`, and the batch-fraction
dispatch of a static layout. Bad input fails with an error naming the offending item."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.static_hetero import dispatch_by_fraction
from dynapipe_planner.strategy.candidates import CandidateError, load_candidates, realisable
from dynapipe_planner.strategy.cli import strategy_main
from dynapipe_planner.strategy.proposal import Strategy
from dynapipe_planner.strategy.schemes import ParallelScheme
from megatron.dynapipe.device_speed import DeviceSpeedError, parse_device_speed
from megatron.dynapipe.layouts.plan_file import HeteroPlanError, load_hetero_plan, parse_hetero_plan

SPEC = ModelSpec("tiny", "gpt", 4, 32, 4, 128, 256, max_position_embeddings=128)


def _plan() -> dict:
    return {
        "replicas": [
            {
                "stages": [
                    {"devices": [0, 1], "tp": 2, "layers": [0, 2]},
                    {"devices": [2], "tp": 1, "layers": [2, 4]},
                ],
                "batch_fraction": 0.5,
            },
            {"stages": [{"devices": [3], "tp": 1, "layers": [0, 4]}], "batch_fraction": 0.5},
        ]
    }


def test_a_good_plan_gives_layouts_and_fractions() -> None:
    layouts, fractions, recompute = parse_hetero_plan(_plan(), SPEC, 4)
    assert [r.num_stages for r in layouts] == [2, 1]
    assert layouts[0].stages[0].devices == [0, 1] and layouts[0].stages[1].layers == (2, 4)
    assert fractions == [0.5, 0.5]
    assert recompute == ()  # the file names no modes: the planner chooses


def test_stage_recompute_modes_all_or_none() -> None:
    plan = _plan()
    for mode, stage in zip(("full", "none", "selective"), _stages(plan), strict=True):
        stage["recompute"] = mode
    assert parse_hetero_plan(plan, SPEC, 4).recompute == (("full", "none"), ("selective",))
    del plan["replicas"][1]["stages"][0]["recompute"]
    with pytest.raises(HeteroPlanError, match=r"replicas\[1\]\.stages\[0\] names no recompute"):
        parse_hetero_plan(plan, SPEC, 4)
    plan["replicas"][1]["stages"][0]["recompute"] = "some"
    with pytest.raises(HeteroPlanError, match=r"replicas\[1\]\.stages\[0\]\.recompute must be"):
        parse_hetero_plan(plan, SPEC, 4)


def test_a_static_layout_plans_and_runs_the_files_stage_modes() -> None:
    """The modes a `--hetero-plan` file names reach every pipeline's plans, and each rank
    reads its own stage's mode from the merged plan (`recompute.stage_mode`)."""
    from dynapipe_planner.planner import PlannerConfig
    from dynapipe_planner.static_hetero import StaticHeteroRecipe
    from megatron.dynapipe.pipeline.recompute import stage_mode

    plan = _plan()
    for mode, stage in zip(("full", "none", "selective"), _stages(plan), strict=True):
        stage["recompute"] = mode
    layouts, fractions, modes = parse_hetero_plan(plan, SPEC, 4)
    recipe = StaticHeteroRecipe(
        SPEC, "A100-80GB", tuple(layouts), tuple(fractions), PlannerConfig(), 0, modes
    )
    merged = recipe.build().plan(np.array([100, 30, 64, 12, 90, 7]))
    ranks = {(r.replica, r.stage) for r in merged.ranks}
    assert {k: stage_mode(merged.stats, *k) for k in sorted(ranks)} == {
        (0, 0): "full",
        (0, 1): "none",
        (1, 0): "selective",
    }


def _stages(plan: dict) -> list[dict]:
    return [st for rep in plan["replicas"] for st in rep["stages"]]


def _broken(path: tuple, value: object) -> dict:
    plan = _plan()
    target = plan
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return plan


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("replicas",), [], r"replicas must be a non-empty list"),
        (("replicas", 1, "batch_fraction"), 0, r"replicas\[1\]\.batch_fraction must be"),
        (("replicas", 1, "batch_fraction"), 0.2, r"batch_fraction values sum to 0\.7"),
        (("replicas", 0, "stages", 1, "tp"), 2, r"replicas\[0\]\.stages\[1\]\.tp is 2 but"),
        (("replicas", 0, "stages", 0, "devices"), [0, 1, 2], r"stages\[0\]\.tp is 2 but it"),
        (("replicas", 0, "stages", 1, "layers"), [2, 3], r"replicas\[0\]\.stages\[1\]\.layers"),
        (("replicas", 0, "stages", 1, "layers"), [2, 9], r"stages\[1\]\.layers \[2, 9\]"),
        (("replicas", 0, "stages", 1, "devices"), ["x"], r"stages\[1\]\.devices\[0\] must be"),
        (("replicas", 0, "stages", 1, "speed"), 2, r"stages\[1\] has unknown field"),
        (("replicas", 1, "stages", 0, "devices"), [2], r"rank 2 is also used by replica 0"),
        (("replicas", 1, "stages", 0, "devices"), [7], r"replica 1 stage 0 runs on rank 7"),
        (("replicas", 1, "stages"), KeyError, r"replicas\[1\]\.stages must be a non-empty"),
    ],
)
def test_bad_plans_are_rejected_naming_the_item(path, value, message) -> None:
    with pytest.raises(HeteroPlanError, match=message):
        parse_hetero_plan(_broken(path, value), SPEC, 4)


def test_tp_must_divide_the_heads_and_every_rank_needs_a_stage(tmp_path: Path) -> None:
    odd = ModelSpec("odd", "gpt", 4, 48, 3, 192, 256, max_position_embeddings=128)
    with pytest.raises(HeteroPlanError, match=r"replicas\[0\]\.stages\[0\]\.tp 2 does not"):
        parse_hetero_plan(_plan(), odd, 4)
    with pytest.raises(HeteroPlanError, match=r"rank\(s\) \[4\] have no stage"):
        parse_hetero_plan(_plan(), SPEC, 5)
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    with pytest.raises(HeteroPlanError, match=r"plan\.json: not valid JSON"):
        load_hetero_plan(bad, SPEC, 4)


def test_candidates_file_for_another_gpu_count_is_named(tmp_path: Path) -> None:
    model = tmp_path / "model.json"
    model.write_text(json.dumps(SPEC.to_dict()))
    out = tmp_path / "proposals.json"
    argv = ["propose", "--model", str(model), "--num-gpus", "8", "--gpus-per-node", "8"]
    argv += ["--seq-length", "128", "--num-samples", "500", "--output", str(out)]
    assert strategy_main(argv) == 0
    with pytest.raises(CandidateError, match=r"proposals\.json was proposed for 8 GPUs but this"):
        load_candidates(out, SPEC, 4)
    _, proposals = load_candidates(out, SPEC, 8)
    assert proposals and all(s.num_gpus <= 8 for p in proposals for s in p.strategies)
    odd = ModelSpec("odd", "gpt", 4, 48, 3, 192, 256, max_position_embeddings=128)
    with pytest.raises(CandidateError, match=r"schemes\[\d+\]: scheme TP2PP1 has TP 2"):
        load_candidates(out, odd, 8)


def test_strategies_that_do_not_fill_the_job_are_dropped_with_a_line() -> None:
    tp1, tp2 = ParallelScheme(1, 1), ParallelScheme(2, 2)
    from dynapipe_planner.strategy.proposal import Proposal, RelaxedSolution

    relaxed = RelaxedSolution(0.0, np.zeros(0), np.zeros(0))
    big = Strategy.of({tp2: 2})
    small = Strategy.of({tp1: 3})
    fits = Strategy.of({tp1: 2, ParallelScheme(2, 1): 1})
    dropped: list[str] = []
    found = realisable(
        [], [Proposal(64, relaxed, (big, small, fits), (0, 0, 0))], 4, 4, homogeneous=False,
        dropped=dropped,
    )  # fmt: skip
    assert found.strategies == [fits]
    assert [r.num_stages for r in found.layouts[0]] == [1, 1, 1]
    assert "2xTP2PP2 needs 8 ranks, the job has 4" in dropped[0]
    assert "uses 3 of the job's 4 ranks" in dropped[1]


def test_plans_of_a_strategy_have_the_layouts_its_groups_were_built_for() -> None:
    """At 64K tokens TP2 holds longer sequences than TP1, so dispatch orders the TP2 pipeline
    first; the plan must still lay the strategy out as `realisable` did (scheme order)."""
    from dynapipe_planner.cluster import get_gpu
    from dynapipe_planner.model_spec import MODEL_PRESETS
    from dynapipe_planner.strategy.candidates import layout_key, strategy_layouts
    from dynapipe_planner.strategy.schemes import (
        AnalyticSchemeModels,
        profile_schemes,
        scheme_tables,
    )
    from dynapipe_planner.strategy.selection import SelectionConfig, StrategySelector

    spec = MODEL_PRESETS["gpt-1.3b"]
    models = AnalyticSchemeModels(spec, get_gpu("A100-80GB"), 4, gpus_per_node=4)
    tp1, tp2 = ParallelScheme(1, 1), ParallelScheme(2, 1)
    profiles = profile_schemes([tp1, tp2], scheme_tables(models, 65536))
    by_scheme = {p.scheme: p.max_len for p in profiles}
    assert by_scheme[tp2] > by_scheme[tp1]
    strategy = Strategy.of({tp1: 2, tp2: 1})
    selector = StrategySelector(
        profiles, [], models, 4, SelectionConfig(trials=3), fixed=[strategy]
    )
    choice = selector.select(np.full(8, 300))
    assert choice.pipelines[0].scheme == tp2  # dispatch's order
    plan = selector.to_plan(choice)
    assert layout_key(plan.replicas) == layout_key(strategy_layouts(strategy, spec.num_layers))


def test_vocabulary_padding_rows_follow_the_resuming_job() -> None:
    """A checkpoint padded for other TP degrees: padding rows dropped or added as zeros, in the
    weights and both Adam moments; other parameters are left for `load_full` to check."""
    import torch

    from megatron.dynapipe.layouts.switch import fit_vocab_rows

    def entry(rows: int) -> dict:
        base = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
        return {"param": base, "exp_avg": base + 100, "exp_avg_sq": base + 200}

    full = {"embedding.word_embeddings.weight": entry(6), "output_layer.weight": entry(6)}
    full["decoder.w"] = entry(3)
    wanted = {"embedding.word_embeddings.weight": (8, 2), "output_layer.weight": (4, 2)}
    notes = fit_vocab_rows(full, {**wanted, "decoder.w": (5, 2)})
    grown = full["embedding.word_embeddings.weight"]
    assert grown["param"].shape == (8, 2)
    assert torch.equal(grown["exp_avg"][:6], entry(6)["exp_avg"])
    assert not grown["exp_avg_sq"][6:].any()
    assert torch.equal(full["output_layer.weight"]["param"], entry(6)["param"][:4])
    assert full["decoder.w"]["param"].shape == (3, 2)
    assert notes == [
        "embedding.word_embeddings.weight: the checkpoint pads the vocabulary to 6 rows, this "
        "job to 8; padding rows added as zeros",
        "output_layer.weight: the checkpoint pads the vocabulary to 6 rows, this job to 4; "
        "padding rows dropped",
    ]


def test_device_speed() -> None:
    assert parse_device_speed("2:2,3:1.5", 4) == [1.0, 1.0, 2.0, 1.5]
    assert parse_device_speed("1,1,2,2", 4) == [1.0, 1.0, 2.0, 2.0]
    assert parse_device_speed(None, 2) == [1.0, 1.0]
    with pytest.raises(DeviceSpeedError, match=r"item '5:2': rank 5 is outside 0\.\.3"):
        parse_device_speed("5:2", 4)
    with pytest.raises(DeviceSpeedError, match=r"lists 3 factor\(s\) for 4 ranks"):
        parse_device_speed("1,2,2", 4)
    with pytest.raises(DeviceSpeedError, match=r"item '1:fast' is not RANK:FACTOR"):
        parse_device_speed("1:fast", 4)


def test_batch_fractions_split_the_tokens() -> None:
    lengths = np.random.default_rng(0).integers(5, 120, 200)
    owner = dispatch_by_fraction(lengths, [0.75, 0.25])
    share = lengths[owner == 0].sum() / lengths.sum()
    assert abs(share - 0.75) < 0.01
    assert np.array_equal(owner, dispatch_by_fraction(lengths, [0.75, 0.25]))


def test_a_hexiscale_plan_file_is_read(tmp_path: Path) -> None:
    """`dynapipe-hetero --output` plans: batch sizes become shares; a stage order that puts a
    later stage on a lower rank is refused naming it."""
    good = {
        "format": "hexiscale-plan",
        "version": 1,
        "micro_batch_size": 1,
        "seqlen": 128,
        "replicas": [
            {
                "id": 0,
                "num_stages": 2,
                "stages": [
                    {"devices": [0], "tp": 1, "layers": [0, 2]},
                    {"devices": [2], "tp": 1, "layers": [2, 4]},
                ],
                "micro_batches": 6,
                "batch_size": 6,
            },
            {
                "id": 1,
                "num_stages": 2,
                "stages": [
                    {"devices": [1], "tp": 1, "layers": [0, 2]},
                    {"devices": [3], "tp": 1, "layers": [2, 4]},
                ],
                "micro_batches": 2,
                "batch_size": 2,
            },
        ],
    }
    path = tmp_path / "hexi.json"
    path.write_text(json.dumps(good))
    layouts, fractions, recompute = load_hetero_plan(path, SPEC, 4)
    assert fractions == [0.75, 0.25] and layouts[1].stages[1].devices == [3]
    assert recompute == ()
    # The HexiScale planner's per-stage modes (stats.recompute) come along, checked.
    good["stats"] = {"recompute": [["full", "none"], ["full", "none"]]}
    path.write_text(json.dumps(good))
    assert load_hetero_plan(path, SPEC, 4).recompute == (("full", "none"), ("full", "none"))
    good["stats"] = {"recompute": [["full", "none"], ["full"]]}
    path.write_text(json.dumps(good))
    with pytest.raises(HeteroPlanError, match=r"stats\.recompute\[1\] must list one mode per"):
        load_hetero_plan(path, SPEC, 4)
    del good["stats"]
    good["replicas"][0]["stages"][1]["devices"] = [0]
    good["replicas"][0]["stages"][0]["devices"] = [2]
    path.write_text(json.dumps(good))
    with pytest.raises(HeteroPlanError, match=r"replica 0 stage 1 runs on rank 0, not above"):
        load_hetero_plan(path, SPEC, 4)
