"""The plan executor against a single-process, non-pipelined reference (forked gloo ranks).

For one global batch planned by the real planner, the loss and every parameter gradient of
pipelined runs (PP=2, PP=4, TP=2 x PP=2, DP=2 x PP=2) with dynamic micro-batches equal a
reference that runs each sample alone through the whole model, within fp32 tolerance; so does
the packing baseline's plan. A plan whose communication order is wrong is rejected before
anything runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402

from dynapipe_planner.cluster import ClusterSpec, get_gpu  # noqa: E402
from dynapipe_planner.cost import AnalyticCostModel  # noqa: E402
from dynapipe_planner.model_spec import ModelSpec  # noqa: E402
from dynapipe_planner.plan import ExecutionPlan, RankPlan  # noqa: E402
from dynapipe_planner.planner import IterationPlanner, PlannerConfig  # noqa: E402

SPEC = ModelSpec("tiny", "gpt", 4, 32, 4, 64, 64, max_position_embeddings=64)
LENGTHS = np.array([5, 37, 12, 3, 29, 18, 8, 44, 21, 6, 15, 33])


def _dataset():
    """Random documents whose samples have exactly LENGTHS (vocabulary 64: 62 = EOD, 63 = pad)."""
    from megatron.dynapipe.data import in_memory_dataset

    rng = np.random.default_rng(0)
    documents = [np.append(rng.integers(0, 62, n), 62) for n in LENGTHS]
    return in_memory_dataset("test", documents, 64, vocab_size=64, eod_id=62, pad_id=63)


DATA = _dataset()


def make_plan(tp: int, pp: int, dp: int, batching: str = "dynamic") -> ExecutionPlan:
    """The planner's plan; a memory limit of about a megabyte makes this tiny model need several
    micro-batches (and packed rows for the packing baseline)."""
    memory = 1_000_000 if batching == "dynamic" else 1_200_000
    cluster = ClusterSpec(
        get_gpu("A100-80GB"), num_stages=pp, num_replicas=dp, tp=tp, memory_limit_bytes=memory
    )
    schedule = "adaptive" if batching == "dynamic" else "1f1b"
    config = PlannerConfig(
        num_replicas=dp,
        batching=batching,
        schedule=schedule,
        recompute="none",
        dtype="fp32",
        max_seqlen=64,
    )
    plan = IterationPlanner(AnalyticCostModel(SPEC, cluster), pp, config).plan(LENGTHS)
    assert len(plan.microbatches) >= 2 * dp, "the test needs several micro-batches per pipeline"
    return plan


def _reference(rank: int, world: int) -> tuple[float, dict, dict]:
    """Every sample alone through a PP=1 model: (loss, weights, gradients) by parameter name.

    Results cross the process boundary as numpy arrays: torch tensors would be shared through
    file descriptors that die with the forked rank."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.model import build_stage_model

    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        _, model = build_stage_model(SPEC, 64)
        weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        total = torch.zeros(())
        for i in range(len(LENGTHS)):
            t = torch.as_tensor(DATA.tokens(i), dtype=torch.int64)[None]
            n = t.shape[1] - 1
            mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
            per_token = model(t[:, :-1], torch.arange(n)[None], mask, labels=t[:, 1:])
            total = total + per_token.sum()
        loss = total / int(LENGTHS.sum())
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        return float(loss), weights, grads
    finally:
        ps.destroy()


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict, dict]:
    return run_ranks(_reference, 1)[0]


def _reference_name(local: str, layer_offset: int) -> str:
    """Name of a stage-local parameter in the PP=1 reference model."""
    if local == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # tied: the last stage's copy
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def _shard(full: np.ndarray, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    full = torch.from_numpy(full)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=param.partition_dim)[tp_rank]


def _pipelined(rank: int, world: int, tp: int, pp: int, plan: ExecutionPlan, weights: dict):
    """One iteration of `plan`; returns (loss or None, {reference name: (grad, expected slice)})."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data import microbatch_tensors
    from megatron.dynapipe.executor import PlanExecutor
    from megatron.dynapipe.model import build_stage_model, stage_layer_counts

    cpu_compat.install()
    ps.initialize(tp, pp, world // (tp * pp))
    try:
        config, model = build_stage_model(SPEC, 64)
        offset = sum(stage_layer_counts(SPEC, pp)[: ps.stage()])
        names = {}
        with torch.no_grad():
            for name, param in model.named_parameters():
                names[name] = _reference_name(name, offset)
                param.copy_(_shard(weights[names[name]], param, ps.tp_rank(), tp))
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.finalize_model_grads_func = finalize_model_grads
        executor = PlanExecutor.for_this_rank(
            model, config, device=torch.device("cpu"), timeout_s=30
        )
        batches = {
            mb.id: microbatch_tensors(mb, DATA)
            for mb in plan.microbatches
            if mb.replica == ps.replica()
        }
        model.zero_grad_buffer()
        result = executor.run(plan, batches)
        grads = {
            names[n]: (p.main_grad.numpy().copy(), ps.tp_rank(), tp, getattr(p, "partition_dim", 0))
            for n, p in model.module.named_parameters()
        }
        return (result.loss_sum, result.num_tokens), grads
    finally:
        ps.destroy()


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "batching"),
    [
        (1, 2, 1, "dynamic"),
        (1, 4, 1, "dynamic"),
        (2, 2, 1, "dynamic"),
        (1, 2, 2, "dynamic"),
        (1, 2, 1, "packing"),
    ],
)
def test_pipelined_gradients_equal_reference(reference, tp, pp, dp, batching) -> None:
    ref_loss, weights, ref_grads = reference
    plan = make_plan(tp, pp, dp, batching)
    results = run_ranks(_pipelined, tp * pp * dp, tp, pp, plan, weights)
    loss_sum = sum(r[0][0] for r in results if r[0][1]) / tp  # each TP shard reports it
    tokens = sum(r[0][1] for r in results) / tp
    assert tokens == LENGTHS.sum()
    assert loss_sum / tokens == pytest.approx(ref_loss, rel=1e-5)
    seen = set()
    for _, grads in results:
        for name, (grad, tp_rank, tp_size, dim) in grads.items():
            expected = ref_grads[name]
            if grad.shape != expected.shape:
                expected = np.split(expected, tp_size, axis=dim)[tp_rank]
            np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6, err_msg=name)
            seen.add(name)
    assert seen == set(ref_grads)


def test_wrong_order_is_rejected_before_running() -> None:
    plan = make_plan(1, 2, 1)
    first = plan.rank_plan(0, 0)
    sends = [i for i, ins in enumerate(first.instructions) if ins.op == "SendActStart"]
    swapped = list(first.instructions)
    a, b = sends[0], sends[1]
    swapped[a], swapped[b] = swapped[b], swapped[a]
    ranks = [RankPlan(rp.replica, rp.stage, swapped) if rp is first else rp for rp in plan.ranks]
    bad = dataclasses.replace(plan, ranks=ranks)

    def run(rank: int, world: int) -> str:
        from megatron.dynapipe import cpu_compat
        from megatron.dynapipe import parallel_state as ps
        from megatron.dynapipe.executor import PlanExecutor, PlanRejected
        from megatron.dynapipe.model import build_stage_model

        cpu_compat.install()
        ps.initialize(1, 2, 1)
        try:
            config, model = build_stage_model(SPEC, 64)
            executor = PlanExecutor.for_this_rank(
                model, config, device=torch.device("cpu"), timeout_s=5
            )
            with pytest.raises(PlanRejected, match="mb") as err:
                executor.run(bad, {})
            return str(err.value)
        finally:
            ps.destroy()

    messages = run_ranks(run, 2)
    assert all("rejected before running" in m for m in messages)
