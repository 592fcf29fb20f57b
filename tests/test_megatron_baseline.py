"""The in-program baseline: fixed-length packing through megatron-core's own 1F1B schedule.

On forked gloo ranks with PP=2, one global batch packed into rows of the full sequence length
and run by `get_forward_backward_func()` gives the loss and every parameter gradient of the
single-process non-pipelined reference, with one row per micro-batch and with three (the last
micro-batch then topped up with a padding row); megatron-core's 1F1B schedule is what ran.
`pretrain_gpt.py --baseline megatron-1f1b` trains (the loss falls on PP=2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    MAX_SEQLEN,
    assert_matches_reference,
    make_plan,
    stage_gradients,
    stage_model_like_reference,
)
from gpt_reference import reference as _reference  # noqa: E402

from dynapipe_planner.plan import ExecutionPlan  # noqa: E402

CALL_SITES_FILE = Path(__file__).parent / "data" / "cuda_call_sites.txt"
ONE_F_ONE_B = (
    "megatron/core/pipeline_parallel/schedules.py:forward_backward_pipelining_without_interleaving"
)


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict, dict]:
    return run_ranks(_reference, 1)[0]


def _megatron_baseline(rank: int, world: int, pp: int, mbs: int, plan: ExecutionPlan, weights):
    """One iteration through megatron-core's schedule: (loss sum, tokens), grads, call sites."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data import rank_microbatches
    from megatron.dynapipe.megatron_baseline import MegatronPackingBaseline

    cpu_compat.install()
    ps.initialize(1, pp, world // pp)
    try:
        config, model, names = stage_model_like_reference(1, pp, weights)
        baseline = MegatronPackingBaseline(
            model, config, seq_length=MAX_SEQLEN, micro_batch_size=mbs, pad_id=DATA.pad_id
        )
        model.zero_grad_buffer()
        result = baseline.run(plan, rank_microbatches(plan, ps.replica(), DATA))
        grads = stage_gradients(model, names, 1)
        return (result.loss_sum, result.num_tokens), grads, cpu_compat.recorded_call_sites()
    finally:
        ps.destroy()


@pytest.mark.parametrize("mbs", [1, 3])
def test_megatron_1f1b_packing_equals_reference(reference, mbs: int) -> None:
    plan = make_plan(1, 2, 1, "packing", micro_batch_size=mbs)
    assert all(mb.seqlen == MAX_SEQLEN and mb.num_rows <= mbs for mb in plan.microbatches)
    if mbs == 3:
        assert any(mb.num_rows < mbs for mb in plan.microbatches), "no filler row exercised"
    results = run_ranks(_megatron_baseline, 2, 2, mbs, plan, reference[1])
    assert_matches_reference(reference, [(r[0], r[1]) for r in results], 1)
    sites = set().union(*(r[2] for r in results))
    assert ONE_F_ONE_B in sites
    unknown = sorted(sites - set(CALL_SITES_FILE.read_text().split()))
    assert not unknown, f"new CUDA call sites, add them to {CALL_SITES_FILE.name}: {unknown}"


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


def test_pretrain_with_megatron_baseline_learns() -> None:
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "128", "--pipeline-model-parallel-size", "2",
        "--baseline", "megatron-1f1b", "--micro-batch-size", "2",
        "--tokens-per-global-batch", "2048", "--data-path", "synthetic:flan",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-2", "--lr-decay-style", "constant", "--train-iters", "4", "--log-interval", "1",
    ]  # fmt: skip
    losses = run_ranks(_train, 2, argv, timeout_s=120)
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0] - 0.1, losses[0]


def test_baseline_flag_implies_packing_and_rejects_other_batching() -> None:
    from megatron.dynapipe.arguments import parse_args

    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    common += ["--seq-length", "128", "--global-batch-size", "8", "--train-iters", "1"]
    assert parse_args([*common, "--baseline", "megatron-1f1b"]).batching == "packing"
    with pytest.raises(SystemExit):
        parse_args([*common, "--baseline", "megatron-1f1b", "--dynamic-micro-batching"])
