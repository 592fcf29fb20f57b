"""Shared by the gradient-equality tests: a tiny GPT, one global batch of known lengths, the
planner's plan of it, and the single-process non-pipelined reference every pipelined run must
match (loss and every parameter gradient, within fp32 tolerance).

The reference runs each sample alone through the whole model, so it checks micro-batching,
packing masks, the schedule, p2p and the per-token loss normalisation all at once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig

SPEC = ModelSpec("tiny", "gpt", 4, 32, 4, 64, 64, max_position_embeddings=64)
MAX_SEQLEN = 64
# Megatron flags of the reference models on top of SPEC's shape: a GPT, and a Llama of the same
# size (RMSNorm, SwiGLU, 4 query heads in 2 K/V groups, RoPE, untied, no biases).
GPT = ("--hidden-dropout", "0", "--attention-dropout", "0")
LLAMA = (
    *GPT,
    "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
    "--num-query-groups", "2", "--position-embedding-type", "rope", "--rotary-base", "10000",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
)  # fmt: skip
LENGTHS = np.array([5, 37, 12, 3, 29, 18, 8, 44, 21, 6, 15, 33])


def _dataset():
    """Random documents whose samples have exactly LENGTHS (vocabulary 64: 62 = EOD, 63 = pad)."""
    from megatron.dynapipe.data.variable_length import in_memory_dataset

    rng = np.random.default_rng(0)
    documents = [np.append(rng.integers(0, 62, n), 62) for n in LENGTHS]
    return in_memory_dataset("test", documents, MAX_SEQLEN, vocab_size=64, eod_id=62, pad_id=63)


DATA = _dataset()


def make_plan(
    tp: int,
    pp: int,
    dp: int,
    batching: str = "dynamic",
    micro_batch_size: int = 0,
    memory: int | None = None,
) -> ExecutionPlan:
    """The planner's plan; a memory limit of about a megabyte makes this tiny model need several
    micro-batches (and packed rows for the packing baseline). A fixed `micro_batch_size` (rows)
    makes packing megatron-core's fixed-shape micro-batches, priced under the device's memory."""
    if memory is None:
        memory = 1_000_000 if batching == "dynamic" else 0 if micro_batch_size else 1_200_000
    cluster = ClusterSpec(
        get_gpu("A100-80GB"), num_stages=pp, num_replicas=dp, tp=tp, memory_limit_bytes=memory
    )
    config = PlannerConfig(
        num_replicas=dp,
        batching=batching,
        schedule="adaptive" if batching == "dynamic" else "1f1b",
        recompute="none",
        dtype="fp32",
        max_seqlen=MAX_SEQLEN,
        micro_batch_size=micro_batch_size,
    )
    plan = IterationPlanner(AnalyticCostModel(SPEC, cluster), pp, config).plan(LENGTHS)
    assert len(plan.microbatches) >= 2 * dp, "the test needs several micro-batches per pipeline"
    return plan


def build_stage(flags: tuple[str, ...] = GPT):
    """This rank's stage of the reference model (parallel state initialised): (config, model)."""
    from megatron.dynapipe.model import build_stage_model
    from megatron.dynapipe.model_flags import spec_args

    return build_stage_model(spec_args(SPEC, MAX_SEQLEN, *flags), SPEC.vocab_size)


def sample_by_sample_loss(model, device: torch.device | str = "cpu") -> torch.Tensor:
    """The loss per real token of every sample of DATA run alone through `model` (PP=1)."""
    total = torch.zeros((), device=device)
    for i in range(len(LENGTHS)):
        t = torch.as_tensor(DATA.tokens(i), dtype=torch.int64, device=device)[None]
        n = t.shape[1] - 1
        mask = torch.ones(1, 1, n, n, dtype=torch.bool, device=device).triu(1)
        positions = torch.arange(n, device=device)[None]
        total = total + model(t[:, :-1], positions, mask, labels=t[:, 1:]).sum()
    return total / int(LENGTHS.sum())


def reference(rank: int, world: int, flags: tuple[str, ...] = GPT) -> tuple[float, dict, dict]:
    """Every sample alone through a PP=1 model: (loss, weights, gradients) by parameter name.

    Run it on one forked rank. Results cross the process boundary as numpy arrays: torch
    tensors would be shared through file descriptors that die with the forked rank."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps

    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        _, model = build_stage(flags)  # on the GPU where there is one
        device = next(model.parameters()).device
        weights = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
        loss = sample_by_sample_loss(model, device)
        loss.backward()
        grads = {n: p.grad.cpu().numpy().copy() for n, p in model.named_parameters()}
        return float(loss), weights, grads
    finally:
        ps.destroy()


def _reference_name(local: str, layer_offset: int, tied: bool = True) -> str:
    """Name of a stage-local parameter in the PP=1 reference model."""
    if local == "output_layer.weight" and tied:
        return "embedding.word_embeddings.weight"  # the last stage's copy
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def tp_slice(full: np.ndarray, name: str, tp_rank: int, tp: int, dim: int) -> np.ndarray:
    """Tensor-parallel rank `tp_rank`'s part of the reference's `full` tensor.

    A gated MLP's first projection holds [gate; up] stacked along `dim`, and megatron-core shards
    each half separately, so a rank holds its slice of both halves."""
    gated = name.endswith(("linear_fc1.weight", "linear_fc1.bias"))
    gated = gated and full.shape[0] == 2 * SPEC.ffn_hidden_size
    halves = np.split(full, 2, axis=dim) if gated else [full]
    return np.concatenate([np.split(half, tp, axis=dim)[tp_rank] for half in halves], dim)


def _shard(full: np.ndarray, param: torch.Tensor, name: str, tp_rank: int, tp: int):
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return torch.from_numpy(full)
    return torch.from_numpy(tp_slice(full, name, tp_rank, tp, param.partition_dim))


def stage_model_like_reference(
    tp: int,
    pp: int,
    weights: dict,
    flags: tuple[str, ...] = GPT,
    overlap_grad_reduce: bool = False,
):
    """This rank's stage (parallel state initialised) with the reference's weights, wrapped in
    Megatron DDP with `finalize_model_grads` and its no-sync rule, as training wraps it;
    returns (config, model, {local: reference name})."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.model import stage_layer_counts

    config, model = build_stage(flags)
    counts = ps.pipeline_layer_counts() or stage_layer_counts(SPEC.num_layers, pp)
    offset = sum(counts[: ps.stage()])
    tied = "output_layer.weight" not in weights
    names = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            names[name] = _reference_name(name, offset, tied)
            param.copy_(_shard(weights[names[name]], param, names[name], ps.tp_rank(), tp))
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce)
    model = DistributedDataParallel(config, ddp, model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return config, model, names


def stage_gradients(model, names: dict, tp: int) -> dict:
    """{reference name: (main grad, tp rank, tp size, partition dim)} of this rank's stage."""
    from megatron.dynapipe import parallel_state as ps

    return {
        names[n]: (p.main_grad.cpu().numpy(), ps.tp_rank(), tp, getattr(p, "partition_dim", 0))
        for n, p in model.module.named_parameters()
    }


def assert_matches_reference(ref: tuple[float, dict, dict], results: list, tp: int) -> None:
    """`results` of every rank, each ((loss sum, real tokens), stage_gradients(...)), give the
    reference's loss and gradients."""
    ref_loss, _, ref_grads = ref
    loss_sum = sum(r[0][0] for r in results if r[0][1]) / tp  # each TP shard reports it
    tokens = sum(r[0][1] for r in results) / tp
    assert tokens == LENGTHS.sum()
    assert loss_sum / tokens == pytest.approx(ref_loss, rel=1e-5)
    seen = set()
    for _, grads in results:
        for name, (grad, tp_rank, tp_size, dim) in grads.items():
            expected = ref_grads[name]
            if grad.shape != expected.shape:
                expected = tp_slice(expected, name, tp_rank, tp_size, dim)
            np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6, err_msg=name)
            seen.add(name)
    assert seen == set(ref_grads)
