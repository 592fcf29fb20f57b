"""The parameter tensors of a megatron-core transformer layer, listed from the layer's definition
(local spec names), for tests that count `ModelSpec`'s parameters and FLOPs directly."""

from __future__ import annotations

import math
from collections.abc import Iterable

from dynapipe_planner.model_spec import ModelSpec


def layer_tensors(m: ModelSpec, kind: str = "decoder") -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter tensor of one megatron-core transformer layer, by name and shape; a T5
    decoder layer's cross-attention projects Q from its own tokens and K, V from the encoder's."""
    h, d, n, g, f = m.hidden_size, m.kv_channels, m.num_heads, m.num_query_groups, m.ffn_hidden_size
    norm = [("weight", (h,))] + ([("bias", (h,))] if m.normalization == "LayerNorm" else [])
    qkv_bias = m.add_bias_linear or m.add_qkv_bias

    def linear(name: str, out: int, inp: int, bias: bool) -> list:
        return [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if bias else [])

    tensors = [(f"input_layernorm.{w}", s) for w, s in norm]
    tensors += linear("self_attention.linear_qkv", n * d + 2 * g * d, h, qkv_bias)
    tensors += linear("self_attention.linear_proj", h, n * d, m.add_bias_linear)
    if kind == "decoder" and m.is_encoder_decoder:
        tensors += [(f"pre_cross_attn_layernorm.{w}", s) for w, s in norm]
        tensors += linear("cross_attention.linear_q", n * d, h, qkv_bias)
        tensors += linear("cross_attention.linear_kv", 2 * g * d, h, qkv_bias)
        tensors += linear("cross_attention.linear_proj", h, n * d, m.add_bias_linear)
    tensors += [(f"pre_mlp_layernorm.{w}", s) for w, s in norm]
    fc1_out = 2 * f if m.gated_linear_unit else f
    tensors += linear("mlp.linear_fc1", fc1_out, h, m.add_bias_linear)
    tensors += linear("mlp.linear_fc2", h, f, m.add_bias_linear)
    return tensors


def count(tensors: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    """Entries of all `tensors` together."""
    return sum(math.prod(shape) for _, shape in tensors)
