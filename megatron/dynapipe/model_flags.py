"""The planner's `ModelSpec` of the model Megatron's flags describe, and the flags of a spec.

The plan must price the model that runs, so the planner's shape is derived from the same
parsed flags the model is built from (`model_spec`). The other direction (`spec_flags`) lets
tools and tests that start from a `ModelSpec` build the model through Megatron's parser too,
so there is one way to build a model.
"""

from __future__ import annotations

import argparse

from dynapipe_planner.model_spec import ModelSpec


def model_spec(args: argparse.Namespace, vocab_size: int, name: str = "pretrain_gpt") -> ModelSpec:
    """The shape `args` (Megatron's parsed flags) describe, with an already padded vocabulary."""
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
    )


def dtype_name(args: argparse.Namespace) -> str:
    """The plan's dtype name for the job's precision flags."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def spec_flags(spec: ModelSpec) -> list[str]:
    """Megatron flags that describe `spec` (a GPT: learned positions, GeLU, LayerNorm)."""
    if spec.is_encoder_decoder:
        raise ValueError(f"model {spec.name!r} is encoder-decoder; the runtime trains GPT models")
    return [
        "--num-layers", str(spec.num_layers),
        "--hidden-size", str(spec.hidden_size),
        "--num-attention-heads", str(spec.num_heads),
        "--ffn-hidden-size", str(spec.ffn_hidden_size),
        "--kv-channels", str(spec.kv_channels),
        "--max-position-embeddings", str(spec.max_position_embeddings),
    ]  # fmt: skip


def spec_args(spec: ModelSpec, seq_length: int, *flags: str) -> argparse.Namespace:
    """Megatron's parsed and validated flags for a GPT of shape `spec` (plus `flags`), for
    tools and tests that start from a `ModelSpec`."""
    from .arguments import parse_args

    return parse_args(
        [*spec_flags(spec), "--seq-length", str(seq_length), "--train-iters", "1", *flags]
    )
