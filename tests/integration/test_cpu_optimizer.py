"""Megatron's precision and optimiser flags take effect on CPU ranks, through megatron-core's own
optimiser (forked gloo ranks):

- `--clip-grad`: on TP=2 x PP=2 the global norm megatron-core computes equals the norm of the
  single-process reference's gradients, and the clipped SGD update equals the reference's
  gradients scaled by clip / norm;
- `--bf16`: bf16 weights with fp32 master copies, training close to fp32;
- `--fp16`: Megatron's dynamic loss scale halves on every overflowing step, which is skipped;
- `--use-distributed-optimizer`: optimiser states sharded over DP=2, the same losses as the
  replicated optimiser.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    make_plan,
    stage_gradients,
    stage_model_like_reference,
    tp_slice,
)
from gpt_reference import reference as _reference  # noqa: E402
from test_training import TINY, _train  # noqa: E402

CLIP = 0.05


def _clipped_sgd_step(rank: int, world: int, plan, weights: dict):
    """One iteration of `plan` and a megatron-core SGD step (lr 1) clipped at CLIP: (grad norm
    megatron-core reports, {reference name: (weight change, tp rank, partition dim)})."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.pipeline.executor import PlanExecutor

    cpu_compat.install()
    ps.initialize(2, 2, 1)
    try:
        config, model, names = stage_model_like_reference(2, 2, weights)
        executor = PlanExecutor.for_this_rank(model, config, device=torch.device("cpu"))
        sgd = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0)
        sgd.clip_grad = CLIP
        optimizer = get_megatron_optimizer(sgd, [model])
        before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        model.zero_grad_buffer()
        executor.run(plan, rank_microbatches(plan, ps.replica(), DATA))
        grads = stage_gradients(model, names, 2)
        _, grad_norm, _ = optimizer.step()
        changes = {
            names[n]: ((p.detach() - before[n]).numpy(), grads[names[n]][1], grads[names[n]][3])
            for n, p in model.module.named_parameters()
        }
        return float(grad_norm), changes
    finally:
        ps.destroy()


def test_gradient_clipping_uses_the_global_norm() -> None:
    _, weights, ref_grads = run_ranks(_reference, 1)[0]
    norm = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in ref_grads.values())))
    assert norm > CLIP  # the step is clipped
    results = run_ranks(_clipped_sgd_step, 4, make_plan(2, 2, 1), weights)
    scale = CLIP / norm
    for grad_norm, changes in results:
        assert grad_norm == pytest.approx(norm, rel=1e-5)
        for name, (change, tp_rank, dim) in changes.items():
            expected = -scale * ref_grads[name]
            if change.shape != expected.shape:
                expected = tp_slice(expected, name, tp_rank, 2, dim)
            # weights near 1 (norms) round each change to fp32 steps of about 1.2e-7
            np.testing.assert_allclose(change, expected, rtol=1e-3, atol=2.5e-7, err_msg=name)


def _run(*flags: str) -> list[float]:
    argv = [*TINY, "--train-iters", "3", "--clip-grad", "1.0", *flags]
    return run_ranks(_train, 2, argv, timeout_s=120)[0]


def test_bf16_trains_like_fp32_with_fp32_master_weights() -> None:
    fp32, bf16 = _run(), _run("--bf16")
    np.testing.assert_allclose(bf16, fp32, rtol=5e-3)
    assert bf16 != fp32  # it did run in bf16


def test_bf16_optimizer_keeps_fp32_masters() -> None:
    def masters(rank: int, world: int):
        from megatron.dynapipe import cpu_compat
        from megatron.dynapipe import parallel_state as ps
        from megatron.dynapipe.arguments import parse_args
        from megatron.dynapipe.stage import stage_in_ddp

        cpu_compat.install()
        ps.initialize(1, 2, 1)
        try:
            args = parse_args([*TINY, "--train-iters", "1", "--bf16"])
            _, model, optimizer, _ = stage_in_ddp(args, 384)
            model_dtypes = {p.dtype for p in model.parameters()}
            master_dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"]}
            return model_dtypes, master_dtypes
        finally:
            ps.destroy()

    for model_dtypes, master_dtypes in run_ranks(masters, 2):
        assert model_dtypes == {torch.bfloat16} and master_dtypes == {torch.float32}


def test_fp16_dynamic_loss_scale_skips_overflowing_steps(capfd) -> None:
    """Megatron's default initial scale (2^32) overflows fp16 gradients: with hysteresis 1 each
    such step is skipped and halves the scale, as on a GPU."""
    _run("--fp16", "--hysteresis", "1", "--log-interval", "1")
    lines = [line for line in capfd.readouterr().out.splitlines() if "| loss scale" in line]
    scales = [float(line.split("| loss scale ")[1].split()[0]) for line in lines]
    assert len(lines) == 3 and scales[0] == 2.0**31 and "skipped (overflow)" in lines[0]
    for line, scale, previous in zip(lines, scales, [2.0**32, *scales], strict=False):
        assert ("skipped (overflow)" in line) == (scale == previous / 2), line


def test_distributed_optimizer_matches_the_replicated_one() -> None:
    at = TINY.index("--pipeline-model-parallel-size")
    argv = [*TINY[:at], *TINY[at + 2 :], "--train-iters", "3", "--clip-grad", "1.0"]  # DP=2
    replicated = run_ranks(_train, 2, argv, timeout_s=120)[0]
    sharded = run_ranks(_train, 2, [*argv, "--use-distributed-optimizer"], timeout_s=120)[0]
    np.testing.assert_allclose(sharded, replicated, rtol=1e-6)
