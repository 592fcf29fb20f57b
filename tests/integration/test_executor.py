"""The plan executor against a single-process, non-pipelined reference (forked gloo ranks).

For one global batch planned by the real planner, the loss and every parameter gradient of
pipelined runs (PP=2, PP=4, TP=2 x PP=2, DP=2 x PP=2) with dynamic micro-batches equal a
reference that runs each sample alone through the whole model, within fp32 tolerance; so does
the packing baseline's plan, and a Llama-style model built from Megatron's flags (RMSNorm,
SwiGLU, 4 query heads in 2 K/V groups, RoPE, untied, no biases) at TP=2 x PP=2 x DP=2. The
same plan run forward only (evaluation) gives the reference's loss and no gradient. A plan whose
communication order is wrong is rejected before anything runs.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    GPT,
    LLAMA,
    assert_matches_reference,
    make_plan,
    stage_gradients,
    stage_model_like_reference,
)
from gpt_reference import reference as _reference  # noqa: E402

from dynapipe_planner.plan import ExecutionPlan, RankPlan  # noqa: E402


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict, dict]:
    return run_ranks(_reference, 1)[0]


def _pipelined(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    plan: ExecutionPlan,
    weights: dict,
    flags: tuple[str, ...] = GPT,
    forward_only: bool = False,
    first_plan: ExecutionPlan | None = None,
):
    """One iteration of `plan`; returns ((loss sum, real tokens), stage gradients).

    With a `first_plan`, an iteration of it runs first (its gradients are then zeroed) under
    `--overlap-grad-reduce`, whose DDP learns in its first iteration how many gradients each
    parameter receives before its bucket may start reducing."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.pipeline.executor import PlanExecutor

    cpu_compat.install()
    ps.initialize(tp, pp, world // (tp * pp))
    try:
        overlap = first_plan is not None
        config, model, names = stage_model_like_reference(tp, pp, weights, flags, overlap)
        executor = PlanExecutor.for_this_rank(
            model, config, device=torch.device("cpu"), timeout_s=30
        )
        if first_plan is not None:
            executor.run(first_plan, rank_microbatches(first_plan, ps.replica(), DATA))
        model.zero_grad_buffer()
        batches = rank_microbatches(plan, ps.replica(), DATA)
        result = executor.run(plan, batches, forward_only=forward_only)
        return (result.loss_sum, result.num_tokens), stage_gradients(model, names, tp)
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
    plan = make_plan(tp, pp, dp, batching)
    results = run_ranks(_pipelined, tp * pp * dp, tp, pp, plan, reference[1])
    assert_matches_reference(reference, results, tp)


def test_llama_from_megatron_flags_equals_reference() -> None:
    llama = run_ranks(_reference, 1, LLAMA)[0]
    assert "output_layer.weight" in llama[1]  # untied
    assert not any(name.endswith(".bias") for name in llama[1])  # --disable-bias-linear
    plan = make_plan(2, 2, 2, memory=500_000)  # TP=2 halves each rank's share of the model
    results = run_ranks(_pipelined, 8, 2, 2, plan, llama[1], LLAMA)
    assert_matches_reference(llama, results, 2)


def test_overlapped_gradient_reduction_equals_reference(reference) -> None:
    """--overlap-grad-reduce: DDP starts reducing buckets in each stage's last backward pass,
    also when an iteration has more micro-batches than the first one had."""
    few, many = make_plan(1, 2, 2), make_plan(1, 2, 2, memory=600_000)
    assert len(many.microbatches) > len(few.microbatches)
    results = run_ranks(_pipelined, 4, 1, 2, many, reference[1], GPT, False, few)
    assert_matches_reference(reference, results, 1)


def test_forward_only_gives_the_reference_loss_and_no_gradient(reference) -> None:
    plan = make_plan(1, 2, 2)
    results = run_ranks(_pipelined, 4, 1, 2, plan, reference[1], GPT, True)
    loss_sum = sum(r[0][0] for r in results)
    tokens = sum(r[0][1] for r in results)
    assert loss_sum / tokens == pytest.approx(reference[0], rel=1e-5)
    for _, grads in results:
        assert all(not grad.any() for grad, *_ in grads.values())


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
        from gpt_reference import build_stage

        from megatron.dynapipe import cpu_compat
        from megatron.dynapipe import parallel_state as ps
        from megatron.dynapipe.pipeline.executor import PlanExecutor, PlanRejected

        cpu_compat.install()
        ps.initialize(1, 2, 1)
        try:
            config, model = build_stage()
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
