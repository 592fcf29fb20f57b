"""Per-iteration strategy switching over disaggregated optimiser states (forked gloo ranks,
fp32), against a single-process reference that trains the whole model with Adam.

Four ranks switch between {TP2 x PP2}, {TP1 x PP2 + TP1 x PP2} and {TP2 + TP1 + TP1} over
consecutive iterations, and back to the first: the fp32 master weights and Adam states stay
sharded over all four ranks, each iteration pulls its layout's working weights and pushes its
gradients to the owners. Every iteration's loss and the master weights after the last step
equal the reference's. Starting from freshly initialised models instead (`load_from`), every
strategy's working weights agree after their pull.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from gpt_reference import DATA, GPT, LENGTHS, LLAMA, sample_by_sample_loss  # noqa: E402
from gpt_reference import reference as _reference  # noqa: E402
from test_hetero_runtime import pipeline_plan  # noqa: E402

from dynapipe_planner.plan import ExecutionPlan, ReplicaLayout, StageLayout  # noqa: E402
from dynapipe_planner.plan_merge import merge_pipeline_plans  # noqa: E402

LR = 1e-3
# Adam divides by sqrt(v) + eps: a parameter whose true gradient is zero (the key bias: softmax
# ignores it) gets rounding noise of ~1e-10 as gradient, which eps must keep from becoming an
# update of size lr; 1e-6 does.
EPS = 1e-6
STRATEGIES = [
    # TP2 x PP2
    [ReplicaLayout(0, 2, [StageLayout([0, 1], 2, (0, 2)), StageLayout([2, 3], 2, (2, 4))])],
    # TP1 x PP2 + TP1 x PP2
    [
        ReplicaLayout(0, 2, [StageLayout([0], 1, (0, 2)), StageLayout([1], 1, (2, 4))]),
        ReplicaLayout(1, 2, [StageLayout([2], 1, (0, 2)), StageLayout([3], 1, (2, 4))]),
    ],
    # TP2 + TP1 + TP1
    [
        ReplicaLayout(0, 1, [StageLayout([0, 1], 2, (0, 4))]),
        ReplicaLayout(1, 1, [StageLayout([2], 1, (0, 4))]),
        ReplicaLayout(2, 1, [StageLayout([3], 1, (0, 4))]),
    ],
]
SCHEDULE = [0, 1, 2, 0]  # strategy of each iteration: every switch, and back


def strategy_plan(layouts: list[ReplicaLayout]) -> ExecutionPlan:
    """The global batch dealt round-robin over the strategy's pipelines, each planned alone."""
    owner = np.arange(len(LENGTHS)) % len(layouts)
    plans = [
        pipeline_plan(layout.num_stages, np.flatnonzero(owner == k))
        for k, layout in enumerate(layouts)
    ]
    return merge_pipeline_plans(plans, layouts)


def _reference_training(
    rank: int, world: int, weights: dict, iterations: int, flags: tuple[str, ...] = GPT
):
    """The whole model on one rank: each iteration the whole batch, then one Adam step."""
    from gpt_reference import build_stage

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps

    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        _, model = build_stage(flags)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(weights[n]))
        optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        losses = []
        for _ in range(iterations):
            optimizer.zero_grad()
            loss = sample_by_sample_loss(model)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    finally:
        ps.destroy()


def _build(rank: int, overlap: bool = False, flags: tuple[str, ...] = GPT):
    """Every strategy's groups, this rank's stage model and executor of each, one optimiser."""
    from gpt_reference import build_stage

    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.layouts.switch import DisaggregatedOptimizer
    from megatron.dynapipe.pipeline.executor import PlanExecutor

    tied = "--untie-embeddings-and-output-weights" not in flags
    ps.initialize_strategies(STRATEGIES, tied_embeddings=tied, timeout_s=30)
    models, configs, topologies = [], [], []
    for k in range(len(STRATEGIES)):
        ps.use_strategy(k)
        config, model = build_stage(flags)
        models.append(model)
        configs.append(config)
        topologies.append(ps.topology())
    optimizer = DisaggregatedOptimizer(
        dict(enumerate(models)), topologies, lr=LR, eps=EPS, overlap=overlap, tied_embeddings=tied
    )
    executors = []
    for k in range(len(STRATEGIES)):
        ps.use_strategy(k)
        configs[k].finalize_model_grads_func = optimizer.finalize_func(k)
        executors.append(
            PlanExecutor.for_this_rank(
                models[k], configs[k], device=torch.device("cpu"), timeout_s=30
            )
        )
    return optimizer, models, executors


def _switching(
    rank: int,
    world: int,
    plans: list[ExecutionPlan],
    weights: dict,
    overlap: bool,
    flags: tuple[str, ...] = GPT,
):
    """Train SCHEDULE from `weights`; returns per iteration (loss sum, tokens) of this rank and
    its master shards at the end."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.layouts.switch import owner_ranges

    cpu_compat.install()
    try:
        optimizer, models, executors = _build(rank, overlap, flags)
        optimizer.load_full(weights)
        reports = []
        for k in SCHEDULE:
            ps.use_strategy(k)
            optimizer.pull(k)
            models[k].zero_grad(set_to_none=True)
            result = executors[k].run(plans[k], rank_microbatches(plans[k], ps.replica(), DATA))
            optimizer.step()
            place = ps.topology().place(rank)
            leader = place.is_last and place.tp_rank == 0
            reports.append((result.loss_sum if leader else 0.0, result.num_tokens if leader else 0))
        shards = {}
        for name, info in optimizer.catalogue.items():
            a, _ = owner_ranges(info.shape[info.dim], world)[rank]
            shards[name] = (a, info.dim, optimizer.master[name].detach().numpy().copy())
        return reports, shards
    finally:
        ps.destroy()


@pytest.mark.parametrize(
    ("overlap", "flags"),
    [(False, GPT), (True, GPT), (False, LLAMA)],
    ids=["blocking", "overlapped", "llama"],
)
def test_switching_strategies_equals_the_reference(overlap: bool, flags) -> None:
    """Overlapped pull/push (weights awaited at each stage's first forward, gradients sent
    right after its last backward) changes when messages travel, not what arrives. A Llama
    (SwiGLU, GQA) switches between TP degrees too: its gated MLP's TP shards each hold a slice
    of both halves, which the whole-model layout keeps apart."""
    weights = run_ranks(_reference, 1, flags)[0][1]
    ref_losses, ref_final = run_ranks(_reference_training, 1, weights, len(SCHEDULE), flags)[0]
    plans = [strategy_plan(layouts) for layouts in STRATEGIES]
    results = run_ranks(_switching, 4, plans, weights, overlap, flags, timeout_s=180)

    for i in range(len(SCHEDULE)):
        loss_sum = sum(r[0][i][0] for r in results)
        tokens = sum(r[0][i][1] for r in results)
        assert tokens == LENGTHS.sum()
        assert loss_sum / tokens == pytest.approx(ref_losses[i], rel=1e-5), f"iteration {i}"
    assert ref_losses[-1] < ref_losses[0]
    for name, full in ref_final.items():
        pieces = sorted((r[1][name][0], r[1][name]) for r in results if name in r[1])
        dim = pieces[0][1][1]
        assembled = np.concatenate([p[2] for _, p in pieces], axis=dim)
        np.testing.assert_allclose(assembled, full, rtol=1e-4, atol=1e-6, err_msg=name)


def _fresh(rank: int, world: int):
    """Start from strategy 2's random initialisation; pull into every strategy."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.layouts.grad_sync import logical_name

    cpu_compat.install()
    try:
        optimizer, models, _ = _build(rank)
        optimizer.load_from(2)
        out = []
        for k, model in enumerate(models):
            ps.use_strategy(k)
            optimizer.pull(k)
            place = ps.topology().place(rank)
            out.append(
                {
                    logical_name(n, place.layers[0], True): (
                        p.detach().numpy().copy(),
                        place.tp_rank if getattr(p, "tensor_model_parallel", False) else 0,
                        place.tp if getattr(p, "tensor_model_parallel", False) else 1,
                        getattr(p, "partition_dim", 0),
                    )
                    for n, p in model.named_parameters()
                }
            )
        return out
    finally:
        ps.destroy()


def test_fresh_models_agree_in_every_strategy_after_the_pull() -> None:
    results = run_ranks(_fresh, 4, timeout_s=120)
    # Rank 2 holds the whole model with TP 1 in strategy 2: the canonical copy.
    canonical = {n: v[0] for n, v in results[2][2].items()}
    assert len(canonical) > 10
    for k in range(len(STRATEGIES)):
        for rank, per_strategy in enumerate(results):
            for name, (value, tp_rank, tp, dim) in per_strategy[k].items():
                want = np.split(canonical[name], tp, axis=dim)[tp_rank]
                np.testing.assert_array_equal(value, want, err_msg=f"{name} s{k} r{rank}")


def _megatron_globals() -> dict[str, tuple[int, str]]:
    """megatron.core.parallel_state's module state: each global's identity and its repr (which
    also catches a list or dict changed in place)."""
    import inspect

    from megatron.core import parallel_state as mpu

    return {
        name: (id(value), repr(value))
        for name, value in vars(mpu).items()
        if name.startswith("_")
        and not name.startswith("__")
        and not callable(value)
        and not inspect.ismodule(value)
    }


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))


def _globals_while_switching(rank: int, world: int, plans: list[ExecutionPlan]):
    """Which of megatron-core's globals building every strategy's groups and models changes,
    and which switching and training through SCHEDULE changes after that; whether each model
    kept its own strategy's groups."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches

    cpu_compat.install()
    before = _megatron_globals()
    try:
        optimizer, models, executors = _build(rank)
        built = _megatron_globals()
        own_groups = []
        for k, model in enumerate(models):
            ps.use_strategy(k)
            own_groups.append(model.pg_collection is ps.pg_collection())
        optimizer.load_from(2)
        for k in SCHEDULE:
            ps.use_strategy(k)
            optimizer.pull(k)
            models[k].zero_grad(set_to_none=True)
            executors[k].run(plans[k], rank_microbatches(plans[k], ps.replica(), DATA))
            optimizer.step()
        return _changed(before, built), _changed(built, _megatron_globals()), own_groups
    finally:
        ps.destroy()


def test_switching_leaves_megatron_globals_alone() -> None:
    """Each strategy's models are built on its own ProcessGroupCollection: megatron-core's
    parallel_state globals are never pointed at a strategy's groups. Initialisation creates
    only the scratch buffer megatron-core's attention takes its tensors from."""
    plans = [strategy_plan(layouts) for layouts in STRATEGIES]
    for built, switched, own_groups in run_ranks(_globals_while_switching, 4, plans, timeout_s=120):
        assert built == ["_GLOBAL_MEMORY_BUFFER"]
        assert switched == []
        assert own_groups == [True] * len(STRATEGIES)
