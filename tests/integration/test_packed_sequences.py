"""Micro-batches as megatron-core's THD sequences (`data.microbatches`, `packed_attention`): a
packed or padded micro-batch's loss and every gradient equal those of its samples run one by
one through megatron-core's own causal attention, for a
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


def _loss_and_grads(model, batches, thd: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
    """Summed loss and gradients of `batches`; `thd` False runs each (one sample, no padding)
    through megatron-core's own causal attention instead, without boundaries or a mask."""
    from megatron.dynapipe.pipeline.executor import gpt_forward_step, masked_token_loss

    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        if thd:
            output, loss_func = gpt_forward_step(iter([batch]), model)
            loss_sum, _, _ = loss_func(output)
        else:
            output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
            loss_sum, _, _ = masked_token_loss(batch.loss_mask, output)
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
    padded = MicroBatch(1, 0, samples, SEQLEN)  # one sample per row, padded to 10
    runs = {
        name: _loss_and_grads(model, [microbatch_tensors(mb, dataset)])
        for name, mb in (("packed", packed), ("padded", padded))
    }
    saw_thd = list(seen)
    alone = [microbatch_tensors(MicroBatch(2, 0, [s], LENGTHS[s]), dataset) for s in samples]
    alone_loss, alone_grads = _loss_and_grads(model, alone, thd=False)
    ps.destroy()
    return {
        name: {
            "loss": (loss, alone_loss),
            "worst_grad_rel": max(
                float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                for n, g in alone_grads.items()
            ),
            "same_params": sorted(grads) == sorted(alone_grads),
        }
        for name, (loss, grads) in runs.items()
    } | {"thd_attention_calls": saw_thd}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_and_padded_rows_train_as_their_samples_alone(shape: str, tp: int) -> None:
    """Per-sample attention: packed rows and padded rows (each a sample and its padding) give
    the loss and gradients of each sample run alone through megatron-core's causal attention."""
    for result in run_ranks(_packed_vs_alone, tp, shape):
        for name in ("packed", "padded"):
            ours, alone = result[name]["loss"]
            assert ours == pytest.approx(alone, rel=1e-5), name
            assert result[name]["same_params"] and result[name]["worst_grad_rel"] < 1e-4, name
        # every layer's attention got the sample boundaries and no [tokens x tokens] mask
        assert result["thd_attention_calls"] == [(True, True)] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_packed_rows_on_gpu_train_as_their_samples_alone(shape: str) -> None:
    """On CUDA the model takes TransformerEngine's spec when it is installed: its attention
    must honour the THD boundaries the same way (the layers it runs are whatever it built)."""
    (result,) = run_ranks(_packed_vs_alone, 1, shape, backend="nccl")
    for name in ("packed", "padded"):
        ours, alone = result[name]["loss"]
        assert ours == pytest.approx(alone, rel=1e-4), name
        assert result[name]["same_params"] and result[name]["worst_grad_rel"] < 1e-3, name


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
