"""Packed rows as megatron-core's THD sequences (`data.microbatches`, `packed_attention`): a
packed micro-batch's loss and every gradient equal those of its samples run one by one, for a
GPT and a Llama shape (RoPE, grouped-query attention, SwiGLU), with tensor parallelism too, on
CPU and in the GPU lane; attention gets sample boundaries and no dense mask; bad THD inputs are
refused.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402

from dynapipe_planner.model_spec import ModelSpec  # noqa: E402
from dynapipe_planner.plan import MicroBatch  # noqa: E402
from megatron.dynapipe.data.variable_length import in_memory_dataset  # noqa: E402

VOCAB, EOD, PAD = 64, 62, 63
LENGTHS = [5, 3, 9, 2, 6]  # training tokens per sample
ROWS = [[0, 1], [2], [3, 4]]  # packed into rows of 10 tokens, with padding at each row's end
SEQLEN = 10
SHAPES = {
    "gpt": ("--position-embedding-type", "learned_absolute"),
    "llama": (
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ),
}


def _dataset():
    rng = np.random.default_rng(3)
    documents = [np.array([*rng.integers(0, EOD, n), EOD]) for n in LENGTHS]
    return in_memory_dataset("packed", documents, 16, vocab_size=VOCAB, eod_id=EOD, pad_id=PAD)


def _loss_and_grads(model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    from megatron.dynapipe.pipeline.executor import gpt_forward_step

    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        output, loss_func = gpt_forward_step(iter([batch]), model)
        loss_sum, _, _ = loss_func(output)
        loss_sum.backward()
        total += float(loss_sum)
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_vs_alone(rank: int, world: int, shape: str) -> dict:
    """Loss and gradients of the rows packed vs each sample alone, and what attention saw."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import microbatch_tensors
    from megatron.dynapipe.model import build_stage_model
    from megatron.dynapipe.model_flags import spec_args
    from megatron.dynapipe.packed_attention import PackedDotProductAttention

    cpu_compat.install()
    ps.initialize(world, 1, 1)
    spec = ModelSpec("tiny", "gpt", 2, 32, 4, 64, VOCAB, max_position_embeddings=16)
    flags = ("--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "5")
    args = spec_args(spec, 16, *SHAPES[shape], *flags, "--tensor-model-parallel-size", str(world))
    model = build_stage_model(args, VOCAB)[1]
    seen = []
    for module in model.modules():
        if isinstance(module, PackedDotProductAttention):
            module.register_forward_pre_hook(
                lambda _m, a, kw: seen.append((a[3] is None, kw["packed_seq_params"] is not None)),
                with_kwargs=True,
            )
    dataset = _dataset()
    samples = [s for row in ROWS for s in row]
    packed = MicroBatch(0, 0, samples, SEQLEN, row_sizes=[len(r) for r in ROWS])
    packed_loss, packed_grads = _loss_and_grads(model, [microbatch_tensors(packed, dataset)])
    alone = [MicroBatch(1, 0, [s], LENGTHS[s]) for s in samples]
    saw_packed = list(seen)
    alone_loss, alone_grads = _loss_and_grads(
        model, [microbatch_tensors(mb, dataset) for mb in alone]
    )
    worst = max(
        float((packed_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        for n, g in alone_grads.items()
    )
    ps.destroy()
    return {
        "loss": (packed_loss, alone_loss),
        "worst_grad_rel": worst,
        "same_params": sorted(packed_grads) == sorted(alone_grads),
        "packed_attention_calls": saw_packed,
    }


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_rows_train_as_their_samples_alone(shape: str, tp: int) -> None:
    for result in run_ranks(_packed_vs_alone, tp, shape):
        packed, alone = result["loss"]
        assert packed == pytest.approx(alone, rel=1e-5)
        assert result["same_params"] and result["worst_grad_rel"] < 1e-4
        # every layer's attention got the sample boundaries and no [tokens x tokens] mask
        assert result["packed_attention_calls"] == [(True, True)] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_packed_rows_on_gpu_train_as_their_samples_alone(shape: str) -> None:
    """On CUDA the model takes TransformerEngine's spec when it is installed: its attention
    must honour the THD boundaries the same way (the layers it runs are whatever it built)."""
    (result,) = run_ranks(_packed_vs_alone, 1, shape, backend="nccl")
    packed, alone = result["loss"]
    assert packed == pytest.approx(alone, rel=1e-4)
    assert result["same_params"] and result["worst_grad_rel"] < 1e-3


def test_packed_attention_refuses_what_it_cannot_compute() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.dynapipe.packed_attention import PackedDotProductAttention

    attention = PackedDotProductAttention.__new__(PackedDotProductAttention)
    bounds = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="'sbhd' format"):
        attention._check_packed(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds), None)
    other = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds + 1)
    with pytest.raises(ValueError, match="share unpadded boundaries"):
        attention._check_packed(other, None)
