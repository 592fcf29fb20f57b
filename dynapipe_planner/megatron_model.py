"""The `ModelSpec` Megatron's parsed model flags describe, and the Megatron flags of a spec.

A plan must price the model that runs, so the runtime derives its `ModelSpec` from the same
parsed flags the model is built from (`spec_from_args`), and a plan file that names a model
gives the flags that build it (`model_flags`). Both directions live here, beside each other,
so that they cannot drift apart; neither needs torch: `args` is any object with the attributes
of Megatron's `parse_args` namespace (after `validate_args`, which fills `ffn_hidden_size`,
`kv_channels` and `add_qkv_bias`).
"""

from __future__ import annotations

from typing import Any

from .errors import PlanningError
from .model_spec import ModelSpec

# Flags that change a layer's weights in ways `ModelSpec` does not describe: a plan would price
# another model than the one that runs.
UNPRICED_FLAGS = {
    "qk_layernorm": "--qk-layernorm",
    "attention_output_gate": "--attention-output-gate",
    "num_experts": "--num-experts",
    "multi_latent_attention": "--multi-latent-attention",
    "mtp_num_layers": "--mtp-num-layers",
    "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
}


def spec_from_args(args: Any, vocab_size: int, name: str = "pretrain_gpt") -> ModelSpec:
    """The GPT shape `args` (Megatron's validated flags) describe, with an already padded
    vocabulary of `vocab_size`; a `PlanningError` naming the flag when `args` asks for a layer
    the cost models cannot price.

    Megatron's `num_query_groups` is 1 unless `--group-query-attention` is given, and both
    `--swiglu` and `--quick-geglu` make the MLP gated.
    """
    for attr, flag in UNPRICED_FLAGS.items():
        if getattr(args, attr, None):
            raise PlanningError(f"{flag}: the planner's cost models cannot price this layer")
    return ModelSpec(
        name,
        "gpt",
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.ffn_hidden_size,
        vocab_size,
        kv_channels=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings,
        num_query_groups=args.num_query_groups if args.group_query_attention else 0,
        gated_linear_unit=bool(args.swiglu or getattr(args, "quick_geglu", False)),
        add_bias_linear=bool(args.add_bias_linear),
        # validate_args turns add_qkv_bias on with add_bias_linear; it only adds to it without.
        add_qkv_bias=bool(args.add_qkv_bias and not args.add_bias_linear),
        normalization=args.normalization,
        untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
        position_embedding_type=args.position_embedding_type,
    )


def model_flags(spec: ModelSpec) -> list[str]:
    """Megatron flags that build a GPT of shape `spec` (`spec_from_args` inverted; a gated MLP
    becomes `--swiglu`; Megatron's defaults are left out), one list item per token."""
    if spec.is_encoder_decoder:
        raise PlanningError(f"model {spec.name!r} is encoder-decoder; the flags describe GPTs")
    flags = [
        "--num-layers", str(spec.num_layers),
        "--hidden-size", str(spec.hidden_size),
        "--num-attention-heads", str(spec.num_heads),
        "--ffn-hidden-size", str(spec.ffn_hidden_size),
        "--kv-channels", str(spec.kv_channels),
        "--max-position-embeddings", str(spec.max_position_embeddings),
    ]  # fmt: skip
    if spec.normalization != "LayerNorm":
        flags += ["--normalization", spec.normalization]
    if spec.position_embedding_type != "learned_absolute":
        flags += ["--position-embedding-type", spec.position_embedding_type]
    if spec.num_query_groups != spec.num_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(spec.num_query_groups)]
    if spec.gated_linear_unit:
        flags.append("--swiglu")
    if not spec.add_bias_linear:
        flags.append("--disable-bias-linear")
        if spec.add_qkv_bias:
            flags.append("--add-qkv-bias")
    if spec.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return flags
