"""Heterogeneous plans on the runtime (forked gloo ranks, fp32) against the single-process
reference of `gpt_reference`.

Five ranks run two asymmetric pipelines side by side: pipeline A has a TP=2 stage (layer 0)
and a TP=1 stage (layers 1-3), pipeline B one TP=2 stage holding all four layers. Each pipeline
is planned alone on its share of the global batch and the plans are merged
(`merge_pipeline_plans`). After one iteration the loss, every rank's gradient (its shard of the
reference gradient, whatever its TP degree) and the parameters after an SGD step equal the
reference's, both for an even split of the batch and for a very uneven one (different numbers
of sequences and tokens per pipeline), and with pipeline A the other way round (a TP=1 stage
feeding a TP=2 stage), and with the stages in Megatron DDP stepped by Megatron's optimiser as
the training loop runs them. Pipelines built with their own random initialisation agree on every
weight after `broadcast_weights`. Layouts that do not fit the job fail before any collective,
and a plan laid out differently from the job's groups before running, naming the mismatch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    GPT,
    LENGTHS,
    LLAMA,
    SPEC,
    _reference_name,
    _shard,
    tp_slice,
)
from gpt_reference import reference as _reference  # noqa: E402

from dynapipe_planner.cluster import ClusterSpec, get_gpu  # noqa: E402
from dynapipe_planner.cost import AnalyticCostModel  # noqa: E402
from dynapipe_planner.plan import ExecutionPlan, ReplicaLayout, StageLayout  # noqa: E402
from dynapipe_planner.plan_merge import merge_pipeline_plans  # noqa: E402
from dynapipe_planner.planner import IterationPlanner, PlannerConfig  # noqa: E402

LR = 0.1
# Pipeline A: stage 0 = ranks 0, 1 (TP 2, layer 0), stage 1 = rank 2 (TP 1, layers 1-3).
# Pipeline B: one stage = ranks 3, 4 (TP 2, all layers).
LAYOUTS = [
    ReplicaLayout(0, 2, [StageLayout([0, 1], 2, (0, 1)), StageLayout([2], 1, (1, 4))]),
    ReplicaLayout(1, 1, [StageLayout([3, 4], 2, (0, 4))]),
]


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict, dict]:
    return run_ranks(_reference, 1)[0]


def pipeline_plan(num_stages: int, ids: np.ndarray) -> ExecutionPlan:
    """One pipeline's plan of samples `ids`; the tight memory limit makes several
    micro-batches (the shapes of a plan do not depend on TP)."""
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=num_stages, memory_limit_bytes=1_500_000)
    config = PlannerConfig(schedule="adaptive", recompute="none", dtype="fp32", max_seqlen=64)
    planner = IterationPlanner(AnalyticCostModel(SPEC, cluster), num_stages, config)
    return planner.plan(LENGTHS[ids], ids)


# The boundary the other way round: pipeline A's TP=1 stage (layers 0-2) feeds a TP=2 stage
# (layer 3), whose leader broadcasts the activations it receives.
WIDENING = [
    ReplicaLayout(0, 2, [StageLayout([0], 1, (0, 3)), StageLayout([1, 2], 2, (3, 4))]),
    ReplicaLayout(1, 1, [StageLayout([3, 4], 2, (0, 4))]),
]


def hetero_plan(owner: list[int], layouts: list[ReplicaLayout] = LAYOUTS) -> ExecutionPlan:
    """Samples with owner k go to pipeline k of `layouts`."""
    owner = np.asarray(owner)
    plans = [
        pipeline_plan(layout.num_stages, np.flatnonzero(owner == k))
        for k, layout in enumerate(layouts)
    ]
    return merge_pipeline_plans(plans, layouts)


def _run(
    rank: int,
    world: int,
    plan: ExecutionPlan,
    weights: dict,
    megatron_stack: bool,
    flags: tuple[str, ...] = GPT,
):
    """Initial-weight broadcast, then one iteration and an SGD step from the reference weights;
    with `megatron_stack` the stage is wrapped in Megatron DDP and stepped by Megatron's
    optimiser, as the training loop does.

    Returns (loss sum or None, real tokens), then by reference name: the weights after the
    broadcast, the synced gradients and the weights after the step, each with (tp rank, tp,
    partition dim) to place the shard."""
    from gpt_reference import build_stage
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.layouts.grad_sync import AsymmetricGradSync
    from megatron.dynapipe.pipeline.executor import PlanExecutor

    cpu_compat.install()
    tied = "--untie-embeddings-and-output-weights" not in flags
    ps.initialize_heterogeneous(plan.replicas, tied_embeddings=tied, timeout_s=30)
    try:
        config, model = build_stage(flags)
        place = ps.topology().place(rank)
        sync = AsymmetricGradSync(model, ps.hetero_groups(), tied_embeddings=tied)
        names = {n: _reference_name(n, place.layers[0], tied) for n, _ in model.named_parameters()}

        def snapshot(of) -> dict:
            return {
                names[n]: (of(p).detach().numpy().copy(), place.tp_rank, place.tp, p.partition_dim)
                if getattr(p, "tensor_model_parallel", False)
                else (of(p).detach().numpy().copy(), 0, 1, 0)
                for n, p in model.named_parameters()
            }

        sync.broadcast_weights()
        initial = snapshot(lambda p: p)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(_shard(weights[names[n]], p, names[n], place.tp_rank, place.tp))
        config.finalize_model_grads_func = sync.finalize
        stage = model
        if megatron_stack:
            groups = ps.pg_collection()  # megatron-core's globals describe no hetero layout
            stage = DistributedDataParallel(
                config, DistributedDataParallelConfig(), model, pg_collection=groups
            )
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0
                ),
                [stage],
                pg_collection=groups,
                use_gloo_process_groups=False,  # megatron-core takes no gloo groups with these
            )
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        executor = PlanExecutor.for_this_rank(
            stage, config, device=torch.device("cpu"), timeout_s=30
        )
        result = executor.run(plan, rank_microbatches(plan, ps.replica(), DATA))
        grads = snapshot(lambda p: p.main_grad if megatron_stack else p.grad)
        optimizer.step()
        reports = place.is_last and place.tp_rank == 0
        loss = (result.loss_sum if reports else None, result.num_tokens if reports else 0)
        return loss, initial, grads, snapshot(lambda p: p)
    finally:
        ps.destroy()


def _assert_shards(per_rank: list[dict], expected: dict, what: str, **tolerance) -> None:
    seen = set()
    for rank, tensors in enumerate(per_rank):
        for name, (value, tp_rank, tp, dim) in tensors.items():
            want = tp_slice(expected[name], name, tp_rank, tp, dim)
            np.testing.assert_allclose(
                value, want, err_msg=f"{what} {name} rank {rank}", **tolerance
            )
            seen.add(name)
    assert seen == set(expected)


def _full(stage: list[dict], name: str) -> np.ndarray:
    """A parameter reassembled from the snapshots of one stage's TP group."""
    _, _, tp, dim = stage[0][name]
    shards = {t[name][1]: t[name][0] for t in stage}
    if tp == 1:  # not sharded: every TP rank holds it whole, and the same
        for t in stage[1:]:
            np.testing.assert_array_equal(t[name][0], stage[0][name][0], err_msg=name)
    gated = name.endswith(("linear_fc1.weight", "linear_fc1.bias"))
    if gated and tp * shards[0].shape[dim] == 2 * SPEC.ffn_hidden_size:  # [gate_r; up_r]
        halves = [np.split(shards[k], 2, axis=dim) for k in range(tp)]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=dim)
    return np.concatenate([shards[k] for k in range(tp)], axis=dim)


EVEN = [k % 2 for k in range(len(LENGTHS))]
UNEVEN = [1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0]  # 9 sequences (228 tokens) vs 3 (44)


@pytest.mark.parametrize(
    ("owner", "layouts", "megatron_stack", "flags"),
    [
        (EVEN, LAYOUTS, False, GPT),
        (UNEVEN, LAYOUTS, False, GPT),
        (EVEN, WIDENING, False, GPT),
        (UNEVEN, LAYOUTS, True, GPT),
        (UNEVEN, LAYOUTS, False, LLAMA),
    ],
    ids=["even-split", "uneven-batch-sizes", "tp1-into-tp2", "megatron-ddp-and-optimizer", "llama"],
)
def test_asymmetric_pipelines_equal_the_reference(
    reference, owner, layouts, megatron_stack, flags
) -> None:
    """The Llama (SwiGLU, GQA, untied) checks the gated MLP's shards, [gate_r; up_r]."""
    ref_loss, ref_weights, ref_grads = (
        reference if flags == GPT else run_ranks(_reference, 1, flags)[0]
    )
    plan = hetero_plan(owner, layouts)
    assert len({m.replica for m in plan.microbatches}) == 2
    results = run_ranks(_run, 5, plan, ref_weights, megatron_stack, flags)

    tokens = sum(r[0][1] for r in results)
    assert tokens == LENGTHS.sum()
    loss_sum = sum(r[0][0] for r in results if r[0][0] is not None)
    assert loss_sum / tokens == pytest.approx(ref_loss, rel=1e-5)
    _assert_shards([r[2] for r in results], ref_grads, "gradient", rtol=1e-4, atol=1e-6)
    stepped = {n: ref_weights[n] - LR * ref_grads[n] for n in ref_grads}
    _assert_shards([r[3] for r in results], stepped, "updated weight", rtol=1e-5, atol=1e-6)

    # Initial weights after the broadcast: every stage holding a parameter agrees with the
    # first stage holding it, whatever TP degree each was initialised with.
    initial = [r[1] for r in results]
    stage_ranks = {
        (rep.id, j): stage.devices for rep in layouts for j, stage in enumerate(rep.stages)
    }
    for name in ref_grads:
        fulls = [
            _full([initial[r] for r in ranks], name)
            for ranks in stage_ranks.values()
            if name in initial[ranks[0]]
        ]
        assert len(fulls) >= 2, name
        for other in fulls[1:]:
            np.testing.assert_array_equal(other, fulls[0], err_msg=name)


def test_layouts_that_do_not_fit_the_job_fail_before_any_collective() -> None:
    from megatron.dynapipe.layout_groups import HeteroTopology, LayoutMismatch

    with pytest.raises(LayoutMismatch, match=r"replica 1 stage 0 runs on rank 4, but the job"):
        HeteroTopology.from_layouts(LAYOUTS, 4)
    with pytest.raises(LayoutMismatch, match=r"rank\(s\) \[5\] have no stage"):
        HeteroTopology.from_layouts(LAYOUTS, 6)
    clash = [LAYOUTS[0], ReplicaLayout(1, 1, [StageLayout([2, 4], 2, (0, 4))])]
    with pytest.raises(LayoutMismatch, match="replica 1 stage 0: rank 2 is also used by replica 0"):
        HeteroTopology.from_layouts(clash, 5)
    backwards = [
        ReplicaLayout(0, 2, [StageLayout([2], 1, (0, 1)), StageLayout([0, 1], 2, (1, 4))]),
        LAYOUTS[1],
    ]
    with pytest.raises(LayoutMismatch, match="replica 0 stage 1 runs on rank 0, not above rank 2"):
        HeteroTopology.from_layouts(backwards, 5)
    short = [LAYOUTS[0], ReplicaLayout(1, 1, [StageLayout([3, 4], 2, (0, 3))])]
    with pytest.raises(LayoutMismatch, match=r"replica 1 holds layers \[0, 3\) but replica 0"):
        HeteroTopology.from_layouts(short, 5)

    def run(rank: int, world: int) -> str:
        from megatron.dynapipe import parallel_state as ps

        with pytest.raises(LayoutMismatch) as err:
            ps.initialize_heterogeneous(LAYOUTS, timeout_s=5)
        assert not ps.is_initialized()
        return str(err.value)

    messages = run_ranks(run, 4, timeout_s=30)
    assert all("runs on rank 4, but the job has 4 rank(s)" in m for m in messages)


def test_topology_names_leaders_and_chunk_holders() -> None:
    from megatron.dynapipe.layout_groups import EMBEDDING, HeteroTopology

    topology = HeteroTopology.from_layouts(LAYOUTS, 5)
    places = [topology.place(r) for r in range(5)]
    assert [(p.replica, p.stage, p.tp_rank) for p in places] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 0),
        (1, 0, 1),
    ]
    place = topology.place(2)
    assert (place.replica, place.stage, place.tp_rank, place.tp, place.is_last) == (
        0,
        1,
        0,
        1,
        True,
    )
    assert [topology.leader(0, 0), topology.leader(0, 1), topology.leader(1, 0)] == [0, 2, 3]
    # Layer 2 lives on A's TP1 stage (rank 2) and B's TP2 stage (ranks 3, 4): two chunks.
    holders = topology.holders(2, tied_embeddings=True)
    assert holders == [(0, 1), (1, 0)]
    assert topology.chunk_holders(holders) == [(2, 3), (2, 4)]
    assert topology.replicated_holders(holders) == (2, 3, 4)
    # The tied embedding: A's first and last stage and B's only stage.
    assert topology.holders(EMBEDDING, tied_embeddings=True) == [(0, 0), (0, 1), (1, 0)]
    assert topology.chunk_holders(topology.holders(EMBEDDING, True)) == [(0, 2, 3), (1, 2, 4)]


def test_a_plan_laid_out_differently_is_rejected_before_running() -> None:
    plan = hetero_plan([k % 2 for k in range(len(LENGTHS))])
    moved = [
        ReplicaLayout(0, 2, [StageLayout([0, 1], 2, (0, 2)), StageLayout([2], 1, (2, 4))]),
        LAYOUTS[1],
    ]
    other = merge_pipeline_plans(
        [
            pipeline_plan(2, np.arange(0, len(LENGTHS), 2)),
            pipeline_plan(1, np.arange(1, len(LENGTHS), 2)),
        ],
        moved,
    )

    def run(rank: int, world: int) -> str:
        from gpt_reference import build_stage

        from megatron.dynapipe import cpu_compat
        from megatron.dynapipe import parallel_state as ps
        from megatron.dynapipe.pipeline.executor import PlanExecutor, PlanRejected

        cpu_compat.install()
        ps.initialize_heterogeneous(plan.replicas, timeout_s=10)
        try:
            config, model = build_stage()
            executor = PlanExecutor.for_this_rank(
                model, config, device=torch.device("cpu"), timeout_s=5
            )
            with pytest.raises(PlanRejected) as err:
                executor.run(other, {})
            return str(err.value)
        finally:
            ps.destroy()

    messages = run_ranks(run, 5)
    assert all(m.startswith("replica 0 stage 0: plan lays it out as") for m in messages)
