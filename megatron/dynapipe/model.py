"""Builds this rank's pipeline stage of a megatron-core GPTModel from Megatron's flags.

The model is Megatron's own: its `TransformerConfig` comes from Megatron's args-to-config path
(`megatron.training.argument_utils.core_transformer_config_from_args`) and the model from
megatron-core's GPT builder and layer specs (`megatron.training.models.gpt.GPTModelBuilder`:
TransformerEngine's spec when `--transformer-impl transformer_engine`, the local spec
otherwise, which is what CPU machines get, see `arguments.cpu_defaults`). So GPT and Llama
shapes (RMSNorm, SwiGLU, grouped-query attention, RoPE, untied embeddings, no biases) are
whatever Megatron's flags say.

On top, DynaPipe sets what its executor needs: each micro-batch has its own shape
(`variable_seq_lengths`), the loss is summed per token over the global batch
(`calculate_per_token_loss`), packed micro-batches run per-sample attention on the local
attention path too (`packed_attention`), recomputation is switched per plan
(`pipeline.recompute`), and the layer split comes from the planner's own `split_layers` (or a
heterogeneous layout's ranges, or a searched plan's partition: `parallel_state`'s
`pipeline_layer_counts`), handed to megatron-core as first/last-stage counts or a pipeline
layout, so the plan's costs describe the model that runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from dynapipe_planner.cost.table import split_layers

from . import parallel_state as ps
from .packed_attention import use_packed_attention


def _recompute_kwargs(mode: str) -> dict[str, object]:
    """megatron-core's switches for the planner's recompute modes (seed dynapipe.txt §7)."""
    if mode == "none":
        return {
            "recompute_granularity": None,
            "recompute_method": None,
            "recompute_num_layers": None,
        }
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


def padded_vocab_size(args: argparse.Namespace, vocab_size: int, tp: int) -> int:
    """The vocabulary padded as Megatron pads it: `--padded-vocab-size` when given, else each
    of the `tp` shards a multiple of `--make-vocab-size-divisible-by` rows."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    if args.padded_vocab_size is not None:
        if args.padded_vocab_size < vocab_size or args.padded_vocab_size % tp:
            from .arguments import ArgumentError

            raise ArgumentError(
                f"--padded-vocab-size {args.padded_vocab_size}: must hold the tokenizer's "
                f"{vocab_size} tokens and split evenly over tensor-parallel degree {tp}"
            )
        return args.padded_vocab_size
    return calculate_padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, tp, logging_enabled=False
    )


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Transformer layers per stage, exactly as the planner's cost model splits them."""
    return split_layers(num_layers, num_stages)


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
    args: argparse.Namespace,
    tp: int,
    pp: int,
    layer_counts: list[int] | None = None,
    recompute: str = "none",
) -> TransformerConfig:
    """Megatron's config for `args` (its own args-to-config path), with DynaPipe's runtime
    choices: this pipeline's TP and PP degrees, its layer split, `recompute`, and

    - `calculate_per_token_loss`: megatron's DDP sums (not averages) gradients over replicas,
      because the executor divides each loss by the global batch's real token count;
    - `variable_seq_lengths`: every micro-batch has its own shape.

    `layer_counts` (layers per stage of this pipeline) replaces the planner's even split: a
    heterogeneous plan's layouts give each stage any layer range, which megatron-core takes as
    a pipeline layout.
    """
    from megatron.training.argument_utils import core_transformer_config_from_args

    if layer_counts is None:
        split = _layer_split_kwargs(stage_layer_counts(args.num_layers, pp))
    else:
        if len(layer_counts) != pp or sum(layer_counts) != args.num_layers:
            raise ValueError(
                f"layers per stage {layer_counts} do not split the {args.num_layers} layers "
                f"over {pp} stage(s)"
            )
        split = {"pipeline_model_parallel_layout": _pipeline_layout(layer_counts)}
    unsplit = {
        "num_layers_in_first_pipeline_stage": None,
        "num_layers_in_last_pipeline_stage": None,
        "pipeline_model_parallel_layout": None,
    }
    return dataclasses.replace(
        core_transformer_config_from_args(args),
        tensor_model_parallel_size=tp,
        tensor_parallel_num_weight_shards=None,  # re-derived from this stage's TP degree
        pipeline_model_parallel_size=pp,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # "allgather" rejects variable_seq_lengths
        **_recompute_kwargs(recompute),
        **{**unsplit, **split},
    )


class _StageLayout(PipelineParallelLayerLayout):
    """A pipeline layout bound to the stage it builds. megatron-core's layout methods read the
    stage from parallel_state's global pipeline group unless given one, and its
    TransformerBlock and TransformerLayer do not pass the rank of their `pg_collection`'s
    pipeline group; a heterogeneous job leaves that global unset, so the rank is bound here."""

    def __init__(self, layout: PipelineParallelLayerLayout, pp_rank: int) -> None:
        self.__dict__.update(vars(layout))
        self.pp_rank = pp_rank

    def get_num_layers_to_build(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        rank = self.pp_rank if pp_rank is None else pp_rank
        return super().get_num_layers_to_build(layer_type, vp_stage, rank)

    def get_layer_offset(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        rank = self.pp_rank if pp_rank is None else pp_rank
        return super().get_layer_offset(layer_type, vp_stage, rank)


def _with_vocab(args: argparse.Namespace, vocab_size: int) -> argparse.Namespace:
    """`args` with Megatron's `padded_vocab_size` set to the vocabulary the runtime padded."""
    copy = argparse.Namespace(**vars(args))
    copy.padded_vocab_size = vocab_size
    return copy


def build_stage_model(
    args: argparse.Namespace, vocab_size: int, recompute: str = "none"
) -> tuple[TransformerConfig, GPTModel]:
    """This rank's stage of the model `args` describe (parallel state must be initialised
    first), with a vocabulary of `vocab_size` rows (already padded); in a heterogeneous job,
    the layers its layout gives it, with its stage's TP degree. The model is built on the
    current layout's groups (`parallel_state.pg_collection`) and keeps them."""
    return build_gpt_model(
        args,
        vocab_size,
        pre_process=ps.stage() == 0,
        post_process=ps.stage() == ps.num_stages() - 1,
        recompute=recompute,
        pg_collection=ps.pg_collection(),
    )


def _seed_as_megatron(args: argparse.Namespace, groups: ProcessGroupCollection) -> None:
    """Seed the generators the weights are drawn from as megatron.training's initialisation
    does (its own `_set_random_seed`: `--seed` + 100 x the pipeline rank, + 10 x the DP rank
    with `--data-parallel-random-init`), so a model built here has the weights a Megatron-LM
    program's provider gets. Megatron seeds the TP RNG tracker only when it sees a GPU; here it
    is seeded on CPU ranks too, with the same seed. The ranks come from `groups`, the layout
    the model is built on."""
    from megatron.training.initialize import _set_random_seed

    ranks = {
        "pp_group": groups.pp,
        "dp_group": groups.dp,
        "tp_group": groups.tp,
        "ep_group": groups.ep,
        "etp_group": groups.expt_tp,
    }
    _set_random_seed(args.seed, args.data_parallel_random_init, **ranks)
    tensor_parallel.model_parallel_cuda_manual_seed(
        torch.initial_seed(),
        tp_rank=groups.tp.rank(),
        ep_rank=groups.ep.rank(),
        etp_rank=groups.expt_tp.rank(),
    )


def build_gpt_model(
    args: argparse.Namespace,
    vocab_size: int,
    *,
    pre_process: bool,
    post_process: bool,
    recompute: str = "none",
    pg_collection: ProcessGroupCollection | None = None,
) -> tuple[TransformerConfig, GPTModel]:
    """A GPTModel of `args` with or without the embedding (`pre_process`) and the output layer
    with the loss (`post_process`), built by megatron-core's GPT builder on `pg_collection`
    (default: the groups megatron-core's initialisation built); the cost profiler builds its
    components this way."""
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    if args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"sequences of {args.seq_length} tokens exceed the {args.max_position_embeddings} "
            "position embeddings (--max-position-embeddings)"
        )
    groups = pg_collection
    if groups is None:
        groups = ProcessGroupCollection.use_mpu_process_groups()
    counts = ps.pipeline_layer_counts() if ps.is_initialized() else None
    config = transformer_config(args, groups.tp.size(), groups.pp.size(), counts, recompute)
    if config.pipeline_model_parallel_layout is not None:
        config.pipeline_model_parallel_layout = _StageLayout(
            config.pipeline_model_parallel_layout, groups.pp.rank()
        )
    model_config = gpt_config_from_args(_with_vocab(args, vocab_size), config)
    _seed_as_megatron(args, groups)
    model = GPTModelBuilder(model_config).build_model(
        groups,
        pre_process=pre_process,
        post_process=post_process,
    )
    use_packed_attention(model)  # packed micro-batches on the local attention path (CPU)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return config, model
