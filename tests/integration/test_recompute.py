"""Recomputation switched per iteration by the plan (DynaPipe §7, dynamic recomputation).

On forked PP=2 ranks one model runs the same micro-batches under plans whose `recompute` is
"none", "full", "selective", "none" again, and one mode per stage (stage 0 "full", stage 1
"none", as a HexiScale plan may choose): the loss and every parameter gradient are equal,
and forward hooks show the mode really changed each time (full recomputation runs every
transformer layer twice per micro-batch, selective runs the core attention twice). A mode the
runtime does not know is rejected before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from gpt_reference import DATA, SPEC, make_plan  # noqa: E402

MODES = ["none", "full", "selective", "none", ["full", "none"]]


def _run_modes(rank: int, world: int, plan) -> list[tuple[float, dict, dict, int]]:
    from gpt_reference import build_stage
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.pipeline.executor import PlanExecutor, PlanRejected

    cpu_compat.install()
    ps.initialize(1, 2, 1)
    try:
        config, model = build_stage()
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.finalize_model_grads_func = finalize_model_grads
        executor = PlanExecutor.for_this_rank(model, config, device=torch.device("cpu"))
        calls: Counter[str] = Counter()
        for module in model.modules():
            for kind, name in ((TransformerLayer, "layer"), (DotProductAttention, "core_attn")):
                if isinstance(module, kind):
                    module.register_forward_hook(lambda *_, name=name: calls.update([name]))
        batches = rank_microbatches(plan, 0, DATA)
        runs = []
        for mode in MODES:
            calls.clear()
            model.zero_grad_buffer()
            stats = {**plan.stats, "recompute": mode}
            result = executor.run(dataclasses.replace(plan, stats=stats), batches)
            grads = {n: p.main_grad.numpy().copy() for n, p in model.module.named_parameters()}
            runs.append((result.loss_sum, grads, dict(calls), len(batches)))
        unknown = dataclasses.replace(plan, stats={**plan.stats, "recompute": "partial"})
        with pytest.raises(PlanRejected, match="for recompute='partial'"):
            executor.run(unknown, batches)
        return runs
    finally:
        ps.destroy()


def test_recompute_mode_follows_the_plan_and_keeps_gradients() -> None:
    plan = make_plan(1, 2, 1)
    expected = {"none": (1, 1), "full": (2, 2), "selective": (1, 2)}  # x micro-batches, x layers
    for stage, stage_runs in enumerate(run_ranks(_run_modes, 2, plan)):
        (loss, grads, _, num_mb), layers = stage_runs[0], SPEC.num_layers // 2
        for mode, (run_loss, run_grads, calls, _) in zip(MODES, stage_runs, strict=True):
            assert run_loss == pytest.approx(loss, rel=1e-6), mode
            for name, grad in grads.items():
                np.testing.assert_allclose(run_grads[name], grad, rtol=1e-5, atol=1e-7)
            mine = mode if isinstance(mode, str) else mode[stage]
            per_layer, per_attn = expected[mine]
            assert calls["layer"] == per_layer * num_mb * layers, (stage, mode)
            assert calls["core_attn"] == per_attn * num_mb * layers, (stage, mode)
