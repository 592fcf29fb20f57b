"""Strategies on a mixed GPU cluster (dynapipe_planner.strategy.mixed, hetero.pipeline_costs):
per-stage cost tables equal the analytic model of each stage's GPU, schemes are profiled on
their own GPU type, the per-iteration choice is the best of every candidate priced alone
(brute force), its plans match their price on the real cluster, dispatch never gives a
pipeline a sequence beyond its memory, and the gradient-sync bound counts only what crosses
machines."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dynapipe_planner.cluster import ClusterSpec
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.devices import cluster_from_dict
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.hetero.cost import HeteroCostModel, TrainingJob
from dynapipe_planner.hetero.layout import HeteroPipeline, HeteroStage
from dynapipe_planner.hetero.pipeline_costs import pipeline_cost_model
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.strategy.mixed import (
    ClusterPricer,
    PlacedSchemeModels,
    group_candidates,
    mixed_selector,
    place_pipelines,
    typed_scheme_space,
)
from dynapipe_planner.strategy.proposal import Strategy
from dynapipe_planner.strategy.schemes import ParallelScheme, profile_schemes, scheme_tables
from dynapipe_planner.strategy.selection import SelectionConfig, packed_groups

GPT = MODEL_PRESETS["gpt-1.3b"]
CONTEXT = 8192
A100, RTX = ("a100", "A100-80GB", 300), ("rtx", "RTX3080Ti", 32)  # machine, GPU, intra GB/s


def cluster_of(name: str, *machines: tuple[tuple[str, str, int], int]):
    """A cluster of machines ((name, GPU type, intra-machine GB/s), GPU count) on 1.25 GB/s."""
    return cluster_from_dict(
        {
            "name": name,
            "network": {"bandwidth_gbs": 1.25, "latency_us": 30},
            "machines": [
                {"name": m, "gpu": gpu, "count": count, "intra_bandwidth_gbs": bw}
                for (m, gpu, bw), count in machines
            ],
        }
    )


CLUSTER = cluster_of("tiny-mixed", (A100, 2), (RTX, 4))


def pipeline(*stages: tuple[tuple[int, ...], int]) -> HeteroPipeline:
    out, start = [], 0
    for devices, layers in stages:
        out.append(HeteroStage(devices, (start, start + layers)))
        start += layers
    return HeteroPipeline(tuple(out), 1)


def test_each_stage_is_priced_by_its_own_gpu_and_layers():
    layers = GPT.num_layers
    mixed = pipeline(((2, 3), layers - 4), ((0,), 4))  # 3080 Ti pair first, then one A100
    costs = pipeline_cost_model(CLUSTER, GPT, mixed, num_replicas=2).pipeline_costs(
        max_samples=4, max_seqlen=2048
    )
    for stage, (gpu_device, tp) in enumerate([(2, 2), (0, 1)]):
        machine = CLUSTER.machine_of(gpu_device)
        gpu = machine.gpu
        if tp > 1:  # TP over the machine's own link, as the cluster file gives it
            gpu = replace(
                gpu,
                intra_node_bandwidth=machine.intra_bandwidth,
                link_latency_s=machine.intra_latency_s,
            )
        alone = AnalyticCostModel(
            GPT,
            ClusterSpec(
                gpu,
                num_stages=2,
                num_replicas=2,
                tp=tp,
                gpus_per_node=tp,
                memory_limit_bytes=machine.memory_limit_bytes,
            ),
            flash_attention=True,
            distributed_optimizer=True,
            sequence_parallel=True,
        ).pipeline_costs(max_samples=4, max_seqlen=2048, layer_counts=[layers - 4, 4])
        np.testing.assert_array_equal(costs.forward[stage], alone.forward[stage])
        assert costs.static[stage] == alone.static[stage]
        assert costs.stage_memory_limits()[stage] == machine.memory_limit_bytes
    assert costs.p2p_bandwidth[0] == pytest.approx(1.25e9)
    with pytest.raises(PlanningError, match="do not split the 24 layers"):
        pipeline_cost_model(CLUSTER, GPT, pipeline(((0,), 3), ((1,), 3))).pipeline_costs()


def test_typed_schemes_are_profiled_where_they_run():
    models = PlacedSchemeModels(CLUSTER, GPT, CLUSTER.num_devices)
    fast, slow = ParallelScheme(1, 2, "A100-80GB"), ParallelScheme(1, 2, "RTX3080Ti")
    a100, rtx = profile_schemes([fast, slow], scheme_tables(models, CONTEXT))
    assert a100.max_len > rtx.max_len  # 72 GB against 10 GB
    assert float(a100.time(2048)) < float(rtx.time(2048))
    placed = place_pipelines(CLUSTER, GPT, [slow, fast, ParallelScheme(2, 1)])
    # Typed: the next GPUs of their type; untyped: the cluster's next free GPUs, in order.
    assert [p.devices for p in placed] == [[2, 3], [0, 1], [4, 5]]
    with pytest.raises(PlanningError, match=r"TP1PP2@RTX3080Ti: needs 2 GPUs, only 0"):
        place_pipelines(CLUSTER, GPT, [slow, slow, slow])


@pytest.fixture(scope="module")
def mixed():
    models = PlacedSchemeModels(CLUSTER, GPT, CLUSTER.num_devices)
    profiles = profile_schemes(typed_scheme_space(GPT, CLUSTER), scheme_tables(models, CONTEXT))
    rng = np.random.default_rng(0)
    data = np.minimum(np.rint(np.exp(rng.normal(6.5, 1.2, 4000))).astype(np.int64) + 1, CONTEXT)
    candidates = group_candidates(profiles, CLUSTER, data, keep=3)
    return models, profiles, data, candidates


def test_candidates_fill_each_gpu_type_with_one_scheme(mixed):
    _, profiles, data, candidates = mixed
    assert len(candidates) == len(set(candidates)) == 9  # 3 fillings x 3 fillings
    # With one filling per type kept, the cheapest that holds the longest sequence joins it:
    # 7,000 tokens fit only TP4PP1 of the 3080 Tis, every A100 scheme (the cheapest, TP1PP1).
    longer = np.append(np.minimum(data, 7000), 7000)
    few = group_candidates(profiles, CLUSTER, longer, keep=1)
    rtx = {s for c in few for s, _ in c.pipelines if s.gpu == "RTX3080Ti"}
    a100 = {s for c in few for s, _ in c.pipelines if s.gpu == "A100-80GB"}
    assert len(few) == 2 and len(rtx) == 2 and a100 == {ParallelScheme(1, 1, "A100-80GB")}
    max_len = {p.scheme: p.max_len for p in profiles}
    assert max(max_len[s] for s in rtx) >= 7000 > min(max_len[s] for s in rtx)
    for strategy in candidates:
        for gpu, count in (("A100-80GB", 2), ("RTX3080Ti", 4)):
            mine = [(s, d) for s, d in strategy.pipelines if s.gpu == gpu]
            assert len(mine) == 1 and mine[0][1] == count // mine[0][0].num_gpus


def test_gpus_a_scheme_leaves_over_go_to_the_cheapest_that_fits():
    """Three A100s and three 3080 Tis: a 2-GPU scheme's filling leaves one GPU of its type,
    which a 1-GPU scheme takes where one fits in memory (the A100s); on the 3080 Tis no 1-GPU
    scheme holds gpt-1.3b, so that GPU idles."""
    odd = cluster_of("odd-mixed", (A100, 3), (RTX, 3))
    models = PlacedSchemeModels(odd, GPT, odd.num_devices)
    profiles = profile_schemes(typed_scheme_space(GPT, odd), scheme_tables(models, CONTEXT))
    fits = {p.scheme for p in profiles}
    data = np.full(64, 1024)
    candidates = group_candidates(profiles, odd, data, keep=4)
    a100_fillings = {
        tuple((s, d) for s, d in c.pipelines if s.gpu == "A100-80GB") for c in candidates
    }
    assert any(len(f) == 2 for f in a100_fillings), a100_fillings  # a 2-GPU scheme, topped up
    for filling in a100_fillings:
        assert sum(s.num_gpus * d for s, d in filling) == 3, filling
    one_gpu_rtx = [s for s in fits if s.gpu == "RTX3080Ti" and s.num_gpus == 1]
    assert not one_gpu_rtx
    for c in candidates:
        rtx = sum(s.num_gpus * d for s, d in c.pipelines if s.gpu == "RTX3080Ti")
        assert rtx <= 3


def test_choice_is_the_best_candidate_and_respects_memory(mixed):
    models, profiles, data, candidates = mixed
    by_scheme = {p.scheme: p for p in profiles}
    config = SelectionConfig(trials=10)
    selector = mixed_selector(profiles, candidates, models, config)
    pricer = ClusterPricer(CLUSTER, GPT, CLUSTER.num_devices)
    rng = np.random.default_rng(1)
    for _ in range(1):
        batch = rng.choice(data, 24)
        batch[0] = CONTEXT  # a sequence only the A100 pipelines can hold
        choice = selector.select(batch)
        # Brute force: every candidate priced on its own by the same selection.
        alone = {}
        for s in candidates:
            try:
                single = mixed_selector(profiles, [s], models, config).select(batch)
            except PlanningError:
                continue  # cannot hold the batch
            alone[s] = single.estimates[s]
        assert alone, "no candidate holds the batch"
        assert choice.estimates[choice.strategy] == pytest.approx(min(alone.values()))
        assert choice.latency <= choice.estimates[choice.strategy] * (1 + 1e-9)
        placed = place_pipelines(CLUSTER, GPT, [p.scheme for p in choice.pipelines])
        for pipe, chosen, packing in zip(
            placed, choice.pipelines, choice.assignment.packings, strict=True
        ):
            own = batch[chosen.sequences]
            assert (own <= by_scheme[chosen.scheme].max_len).all()
            if chosen.scheme.gpu == "RTX3080Ti":
                assert 0 not in chosen.sequences.tolist()
            if len(own):
                limits = pricer.planner(pipe).costs("none", own, int(own.max()))
                peak = np.asarray(chosen.plan.stats["peak_memory_bytes"])
                assert (peak <= limits.stage_memory_limits()).all()
                # The selector's price is the real cluster's price of the same micro-batches.
                real = pricer.planner(pipe).predict(own, packed_groups(own, packing))
                assert real == pytest.approx(chosen.latency, rel=1e-9)


def test_plans_run_each_pipeline_on_gpus_of_its_type():
    """The runtime's plan puts every chosen pipeline on GPUs of its scheme's type, each GPU at
    most once, all layers in each pipeline. Here the RTX machine comes first in the cluster
    while the plan lists the A100 pipeline first (scheme order), so GPUs dealt out in that
    order would put the A100 pipeline on RTX GPUs."""
    cluster = cluster_of("rtx-first", (RTX, 4), (A100, 2))
    models = PlacedSchemeModels(cluster, GPT, cluster.num_devices)
    rtx, a100 = ParallelScheme(1, 2, "RTX3080Ti"), ParallelScheme(1, 2, "A100-80GB")
    profiles = profile_schemes([rtx, a100], scheme_tables(models, CONTEXT))
    strategy = Strategy.of({rtx: 2, a100: 1})
    selector = mixed_selector(profiles, [strategy], models, SelectionConfig(trials=5))
    choice = selector.select(np.full(24, 500))
    plan = selector.to_plan(choice)
    ordered = choice.in_plan_order
    assert ordered[0].scheme == a100  # the plan's order, not the cluster's
    types = {d: m.gpu.name for m in cluster.machines for d in m.devices}
    used = []
    for layout, chosen in zip(plan.replicas, ordered, strict=True):
        devices = [d for stage in layout.stages for d in stage.devices]
        assert {types[d] for d in devices} == {chosen.scheme.gpu}
        assert layout.stages[0].layers[0] == 0
        assert layout.stages[-1].layers[1] == GPT.num_layers
        used += devices
    assert sorted(used) == list(range(cluster.num_devices))


def test_no_candidates_and_untyped_schemes_are_errors(mixed):
    models, profiles, _, _ = mixed
    with pytest.raises(PlanningError, match="no candidate strategies"):
        mixed_selector(profiles, [], models)
    with pytest.raises(PlanningError, match="needs schemes with a GPU type"):
        models(ParallelScheme(1, 1))
    assert str(Strategy.of({ParallelScheme(1, 2, "A100-80GB"): 1})) == "1xTP1PP2@A100-80GB"


def test_hierarchical_sync_counts_only_what_crosses_machines():
    job = TrainingJob(GPT, seqlen=CONTEXT)
    cost = HeteroCostModel(CLUSTER, job)
    layers = GPT.num_layers
    same_machine = [pipeline(((0,), layers)), pipeline(((1,), layers))]
    assert cost.hierarchical_sync_s(same_machine) == 0.0
    assert cost.hierarchical_sync_s(same_machine[:1]) == 0.0
    # Two copies of every parameter on two machines: each link carries 2 (2 - 1) / 2 of them.
    params = layers * GPT.layer_params("decoder") + GPT.embedding_params()
    params += GPT.vocab_size * GPT.hidden_size
    across = [pipeline(((0,), layers)), pipeline(((2, 3), layers))]
    assert cost.hierarchical_sync_s(across) == pytest.approx(params * 2 / 1.25e9)
    # A third copy on a machine that already holds one adds nothing across machines.
    assert cost.hierarchical_sync_s([*across, pipeline(((1,), layers))]) == pytest.approx(
        params * 2 / 1.25e9
    )
