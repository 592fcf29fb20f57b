"""Per-iteration strategy selection (dynapipe_planner.strategy.selection): the lowest estimate
wins among the windowed candidates, every pipeline's plan passes the simulator, every sample is
planned exactly once, and impossible batches are named."""

from __future__ import annotations

import numpy as np
import pytest

from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.data import global_batches, sample_lengths
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.service import PlanningService
from dynapipe_planner.simulate import simulate, verify_plan
from dynapipe_planner.strategy.proposal import (
    batch_proposals,
    interval_work,
    propose_strategies,
)
from dynapipe_planner.strategy.schemes import (
    analytic_scheme_models,
    profile_schemes,
    scheme_space,
    scheme_tables,
)
from dynapipe_planner.strategy.selection import SelectionConfig, StrategyRecipe, StrategySelector

GPT = MODEL_PRESETS["gpt-1.3b"]
NUM_GPUS, CONTEXT, TOKENS = 8, 16384, 40_000


@pytest.fixture(scope="module")
def setting():
    models = analytic_scheme_models(GPT, get_gpu("RTX4090"), NUM_GPUS)
    profiles = profile_schemes(scheme_space(GPT, NUM_GPUS), scheme_tables(models, CONTEXT))
    lengths = np.minimum(sample_lengths("webcode", 20000, seed=3), CONTEXT)
    proposals = propose_strategies(
        interval_work(lengths, profiles, step=256, tokens_per_iteration=TOKENS), NUM_GPUS
    )
    return models, profiles, proposals, lengths


@pytest.mark.parametrize("inside", ["packing", "dynapipe"])
def test_selected_plans_pass_the_simulator_and_cover_the_batch(setting, inside):
    models, profiles, proposals, lengths = setting
    selector = StrategySelector(
        profiles, proposals, models, NUM_GPUS, SelectionConfig(inside=inside, trials=20)
    )
    batches = global_batches(lengths, TOKENS, seed=4)
    for _ in range(3):
        ids = next(batches)
        batch = lengths[ids]
        choice = selector.select(batch, ids)
        assert choice.estimates[choice.strategy] == min(choice.estimates.values())
        assert set(choice.estimates) <= set(selector.candidates(batch))
        assert choice.strategy.num_gpus <= NUM_GPUS
        planned = []
        for pipeline in choice.pipelines:
            if pipeline.plan is None:
                continue
            plan = pipeline.plan
            verify_plan(plan)
            own = batch[pipeline.sequences]
            costs = selector.planner(pipeline.scheme).costs_of(plan, own)
            result = simulate(plan, costs, check_memory=True)
            assert result.makespan == pytest.approx(pipeline.latency, rel=0.05)
            planned += [s for m in plan.microbatches for s in m.samples]
        assert sorted(planned) == sorted(ids.tolist())
        assert choice.latency == max(p.latency for p in choice.pipelines)


def test_the_chosen_strategy_is_one_heterogeneous_plan_the_simulator_accepts(setting):
    models, profiles, proposals, lengths = setting
    selector = StrategySelector(
        profiles, proposals, models, NUM_GPUS, SelectionConfig(inside="dynapipe", trials=20)
    )
    ids = next(global_batches(lengths, TOKENS, seed=9))
    batch = lengths[ids]
    choice = selector.select(batch, ids)
    plan = selector.to_plan(choice)
    assert plan.to_dict() == selector.plan(batch, ids).to_dict() | {"stats": plan.stats}
    verify_plan(plan)
    assert plan.num_replicas == choice.strategy.num_pipelines == len(plan.replicas)
    devices = [d for layout in plan.replicas for stage in layout.stages for d in stage.devices]
    assert sorted(devices) == list(range(choice.strategy.num_gpus))
    costs = []
    for pipeline in choice.in_plan_order:
        planner = selector.planner(pipeline.scheme)
        if pipeline.plan is None:
            costs.append(planner.cost_model.pipeline_costs("none", max_seqlen=128))
        else:
            costs.append(planner.costs_of(pipeline.plan, batch[pipeline.sequences]))
    result = simulate(plan, costs, check_memory=True)
    assert result.makespan == pytest.approx(choice.latency, rel=0.05)
    assert plan.stats["predicted_iteration_s"] == choice.latency


def test_candidates_come_from_the_window_above_the_batch_maximum(setting):
    models, profiles, proposals, _ = setting
    selector = StrategySelector(profiles, proposals, models, NUM_GPUS, SelectionConfig(window=0))
    longest = proposals[len(proposals) // 2].max_len - 1
    own = next(p for p in proposals if p.max_len >= longest)
    assert selector.candidates(np.array([longest]))[: len(own.strategies)] == list(own.strategies)


def test_proposals_from_the_batch_only_widen_the_choice(setting):
    models, profiles, proposals, lengths = setting
    paper = StrategySelector(
        profiles, proposals, models, NUM_GPUS, SelectionConfig(batch_candidates=0, trials=10)
    )
    ours = StrategySelector(profiles, proposals, models, NUM_GPUS, SelectionConfig(trials=10))
    max_len = {p.scheme: p.max_len for p in profiles}
    batches = global_batches(lengths, TOKENS, seed=6)
    for _ in range(2):
        batch = lengths[next(batches)]
        own = batch_proposals(batch, profiles, NUM_GPUS, keep=5)
        assert 0 < len(own) <= 5
        for strategy in own:
            assert strategy.num_gpus <= NUM_GPUS
            assert max(max_len[s] for s, _ in strategy.pipelines) >= batch.max()
        assert set(paper.candidates(batch)) <= set(ours.candidates(batch))
        assert min(ours.select(batch).estimates.values()) <= min(
            paper.select(batch).estimates.values()
        )


def test_batch_beyond_every_proposal_and_bad_config_are_named(setting):
    models, profiles, proposals, _ = setting
    selector = StrategySelector(profiles, proposals, models, NUM_GPUS)
    top = proposals[-1].max_len
    with pytest.raises(PlanningError, match=rf"longest sequence \({top + 1} tokens\)"):
        selector.select(np.array([100, top + 1]))
    with pytest.raises(PlanningError, match="inside must be one of"):
        SelectionConfig(inside="ring")
    with pytest.raises(PlanningError, match="no proposed strategies"):
        StrategySelector(profiles, [], models, NUM_GPUS)


def without_planning_times(value):
    """A plan's dict without the wall-clock planning times (the only non-deterministic part)."""
    if isinstance(value, dict):
        return {k: without_planning_times(v) for k, v in value.items() if k != "planning_time_s"}
    if isinstance(value, list):
        return [without_planning_times(v) for v in value]
    return value


def test_planning_service_workers_make_the_same_heterogeneous_plans(setting):
    models, profiles, proposals, lengths = setting
    config = SelectionConfig(inside="dynapipe", trials=10)
    recipe = StrategyRecipe(tuple(profiles), tuple(proposals), models, NUM_GPUS, config)
    batches = global_batches(lengths, TOKENS, seed=11)
    work = [(k, lengths[ids], ids) for k, ids in ((k, next(batches)) for k in range(2))]
    inline = recipe.build()
    with PlanningService(recipe, work, num_workers=1, timeout_s=120) as service:
        for k, batch, ids in work:
            ahead = service.get(k)
            assert ahead.num_replicas > 0 and ahead.replicas
            expected = inline.plan(batch, ids)
            assert without_planning_times(ahead.to_dict()) == without_planning_times(
                expected.to_dict()
            )
