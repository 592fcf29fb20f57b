"""Builds this rank's pipeline stage of a megatron-core GPTModel from the planner's model shape.

The planner and the runtime must agree on which layers each stage holds, or the plan's costs
describe a different model than the one that runs; so the layer split comes from the planner's
own `split_layers` and is handed to megatron-core as first/last-stage layer counts. On CPU the
local (pure megatron-core) layer spec is used; the TransformerEngine spec when it is installed
and a GPU is present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from dynapipe_planner.cost.table import split_layers
from dynapipe_planner.model_spec import ModelSpec

from . import parallel_state as ps

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelOptions:
    """Training-time choices that are not part of the model's shape."""

    dtype: str = "fp32"
    position_embedding: str = "learned_absolute"  # Megatron's default; "rope" also works
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seed: int = 1234
    recompute: str = "none"  # "selective": core attention; "full": whole layers


def _recompute_kwargs(mode: str) -> dict[str, object]:
    """megatron-core's switches for the planner's recompute modes (seed dynapipe.txt §7)."""
    if mode == "none":
        return {}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    if mode == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    raise ValueError(f"recompute must be none, selective or full, got {mode!r}")


def layout_free_tp(world_size: int) -> int:
    """The lcm of every TP degree up to one node (8) that divides `world_size`: heterogeneous
    jobs pad the vocabulary for all of them, not only for their own layouts' degrees, so a
    full-state checkpoint has the same embedding shape under any layout of as many ranks."""
    return math.lcm(*(t for t in range(1, min(8, world_size) + 1) if world_size % t == 0))


def padded_vocab_size(dataset_vocab: int, tp: int) -> int:
    """Megatron pads the vocabulary so each tensor-parallel shard is a multiple of 128 rows."""
    multiple = 128 * tp
    return math.ceil(dataset_vocab / multiple) * multiple


def stage_layer_counts(spec: ModelSpec, num_stages: int) -> list[int]:
    """Transformer layers per stage, exactly as the planner's cost model splits them."""
    return split_layers(len(spec.layer_kinds()), num_stages)


def _layer_split_kwargs(counts: list[int]) -> dict[str, int]:
    """megatron-core expresses an uneven split only through the first and last stage's counts."""
    if len(set(counts)) == 1:
        return {}
    middle = counts[1:-1]
    if len(set(middle)) > 1:
        raise ValueError(
            f"layers per stage {counts}: megatron-core needs equal middle stages; choose a "
            "layer count that splits evenly over the middle stages"
        )
    return {
        "num_layers_in_first_pipeline_stage": counts[0],
        "num_layers_in_last_pipeline_stage": counts[-1],
    }


def _pipeline_layout(counts: list[int]) -> str:
    """Any layers-per-stage split as megatron-core's pipeline layout string: embedding (E) on
    the first stage, `counts[j]` decoder layers (t) on stage j, the loss (L) on the last."""
    stages = ["t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def transformer_config(
    spec: ModelSpec,
    tp: int,
    pp: int,
    options: ModelOptions,
    layer_counts: list[int] | None = None,
) -> TransformerConfig:
    """The megatron-core config of `spec` with DynaPipe's runtime choices.

    `calculate_per_token_loss` makes megatron's DDP sum (not average) gradients over replicas:
    the executor already divides each loss by the global batch's real token count.
    `variable_seq_lengths` is set because every micro-batch has its own shape.
    `layer_counts` (layers per stage of this pipeline) replaces the planner's even split: a
    heterogeneous plan's layouts give each stage any layer range, which megatron-core takes as
    a pipeline layout.
    """
    if layer_counts is None:
        split = _layer_split_kwargs(stage_layer_counts(spec, pp))
    else:
        if len(layer_counts) != pp or sum(layer_counts) != spec.num_layers:
            raise ValueError(
                f"layers per stage {layer_counts} do not split the {spec.num_layers} layers of "
                f"model {spec.name!r} over {pp} stage(s)"
            )
        split = {"pipeline_model_parallel_layout": _pipeline_layout(layer_counts)}
    if spec.is_encoder_decoder:
        raise ValueError(f"model {spec.name!r} is encoder-decoder; the runtime trains GPT models")
    dtype = DTYPES[options.dtype]
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.kv_channels,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=options.dtype == "bf16",
        fp16=options.dtype == "fp16",
        hidden_dropout=options.hidden_dropout,
        attention_dropout=options.attention_dropout,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # "allgather" rejects variable_seq_lengths
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **_recompute_kwargs(options.recompute),
        **split,
    )


def _layer_spec():
    if torch.cuda.is_available():
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec()


def build_stage_model(
    spec: ModelSpec, max_seqlen: int, options: ModelOptions = ModelOptions()
) -> tuple[TransformerConfig, GPTModel]:
    """This rank's stage of `spec` (parallel state must be initialised first); in a
    heterogeneous job, the layers its layout gives it, with its stage's TP degree."""
    return build_gpt_model(
        spec,
        max_seqlen,
        options,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
    )


def build_gpt_model(
    spec: ModelSpec,
    max_seqlen: int,
    options: ModelOptions,
    *,
    pre_process: bool,
    post_process: bool,
) -> tuple[TransformerConfig, GPTModel]:
    """A GPTModel of `spec` with or without the embedding (`pre_process`) and the output layer
    with the loss (`post_process`); the cost profiler builds its components this way."""
    if max_seqlen > spec.max_position_embeddings:
        raise ValueError(
            f"sequences of {max_seqlen} tokens exceed the {spec.max_position_embeddings} "
            f"position embeddings of model {spec.name!r}"
        )
    tp = mpu.get_tensor_model_parallel_world_size()
    pp = mpu.get_pipeline_model_parallel_world_size()
    counts = ps.pipeline_layer_counts() if ps.is_initialized() else None
    config = transformer_config(spec, tp, pp, options, counts)
    tensor_parallel.model_parallel_cuda_manual_seed(options.seed)
    torch.manual_seed(options.seed)
    model = GPTModel(
        config,
        _layer_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=options.tie_embeddings,
        position_embedding_type=options.position_embedding,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return config, model
