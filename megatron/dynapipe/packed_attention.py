"""Per-sample attention for packed rows on megatron-core's local attention path.

A packed micro-batch (several samples in one row: the packing baseline, Hydraulis' packed
micro-batches; seed `hydraulis.txt` §4, Eq. 1) reaches megatron-core as Megatron-LM runs packed
sequences: one sequence of all its tokens with the samples' cumulative boundaries
(`PackedSeqParams`, qkv_format "thd"). On GPU, TransformerEngine's attention computes each
sample's causal attention from those boundaries. megatron-core's local `DotProductAttention`,
the one CPU ranks run, refuses THD; `PackedDotProductAttention` takes its place and computes
each sample's causal attention alone with torch's `scaled_dot_product_attention`. That costs
the sum of the samples' squared lengths, what a variable-length kernel costs and what the
planner prices packed rows at, never a [tokens x tokens] score matrix or mask. Inputs without
boundaries take megatron-core's own path unchanged.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class PackedDotProductAttention(DotProductAttention):
    """megatron-core's local attention, plus per-sample causal attention for THD inputs."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, None
            )
        self._check_packed(packed_seq_params, attention_bias)
        # THD: query [t, heads, head_dim], key/value [t, groups, head_dim] of this TP shard.
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        dropout = self.attention_dropout.p if self.training else 0.0
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        # One split per tensor: its backward concatenates the segments' gradients once, where
        # slicing each segment out would add a full-size gradient per segment (O(segments x
        # tokens): a 16,384-token row of 42 samples spent 2x its compute there).
        lengths = [b - a for a, b in itertools.pairwise(bounds) if b > a]
        with rng:
            context = torch.cat(
                [
                    self._sample_attention(q, k, v, dropout)
                    for q, k, v in zip(
                        *(x.split(lengths) for x in (query, key, value)), strict=True
                    )
                ]
            )
        return context.reshape(context.shape[0], self.hidden_size_per_partition)

    def _sample_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float
    ) -> torch.Tensor:
        """Causal attention within one sample: [l, heads, head_dim] -> the same shape. The
        inputs go in as [1, heads, l, head_dim]: torch's fused kernels (flash attention, on the
        CPU too) take 4-D inputs only, and 3-D ones fall back to the math path, which stores
        the [heads, l, l] probabilities (4-8x the time and O(l^2) memory on the CPU)."""
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            dropout_p=dropout,
            is_causal=True,
            scale=self._effective_scale(),
        )
        return out.squeeze(0).transpose(0, 1)

    def _effective_scale(self) -> float:
        """megatron-core divides its softmax scale by the layer number under
        `apply_query_key_layer_scaling` and multiplies the scores back in its softmax."""
        if self.config.apply_query_key_layer_scaling:
            return self.softmax_scale * self.layer_number
        return self.softmax_scale

    def _check_packed(self, params: PackedSeqParams, attention_bias: torch.Tensor | None) -> None:
        if params.qkv_format != "thd":
            raise ValueError(f"packed sequences in {params.qkv_format!r} format: only 'thd' runs")
        if params.cu_seqlens_q_padded is not None or not torch.equal(
            params.cu_seqlens_q, params.cu_seqlens_kv
        ):
            raise ValueError("packed sequences: queries and keys must share unpadded boundaries")
        if attention_bias is not None or self.config.softmax_type != "vanilla":
            raise ValueError(
                "packed sequences on the local attention path take plain causal softmax "
                "attention (no attention bias, --softmax-type vanilla)"
            )
        if self.config.window_size is not None:
            raise ValueError("packed sequences on the local attention path: no sliding window")


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Give every megatron-core local attention of `model` the per-sample THD path (in place;
    the class adds behaviour, no state, so weights and checkpoints are unchanged)."""
    for module in model.modules():
        if type(module) is DotProductAttention:
            module.__class__ = PackedDotProductAttention
    return model
