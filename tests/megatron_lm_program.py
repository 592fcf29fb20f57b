"""A Megatron-LM training program as its users write one for megatron.training 0.19, plus the
one line that enables DynaPipe, placed before the program's other imports. `main(argv, model)`
trains a GPT from a classic `model_provider`, or a Llama from a `ModelConfig` in the config
container (megatron.training 0.19's preferred form), with Megatron's own `pretrain` loop,
optimiser, logging and checkpoints, on megatron-core's own datasets. `forward_step` is
pretrain_gpt.py's, reused as Megatron-LM programs reuse Megatron-LM's: its `get_batch` reads the
iterator on tensor-parallel rank 0 and megatron-core's `get_batch_on_this_tp_rank` broadcasts
the batch. Nothing here knows about DynaPipe but the import.
"""

# ruff: noqa: I001  (the DynaPipe line stays above the imports it patches)
from __future__ import annotations

import megatron.dynapipe.enable  # noqa: F401  (the one line a Megatron-LM program adds)

import os
import sys
from pathlib import Path

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's pretrain_gpt.py
from pretrain_gpt import forward_step


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, **kwargs):
    args = get_args()
    config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        inter_document_masking=args.dataloader_inter_document_masking,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    kind = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(
        kind, train_val_test_num_samples, lambda: True, config
    ).build()


datasets_provider.is_distributed = True


def main(argv: list[str], model: str = "gpt") -> None:
    sys.argv = ["megatron_lm_program.py", *argv]
    parse_and_validate_args()
    args = get_args()
    if model == "gpt":
        container = pretrain_cfg_container_from_args(args)
        pretrain(
            container, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider
        )
    else:
        model_cfg = gpt_config_from_args(args, core_transformer_config_from_args(args))
        container = pretrain_cfg_container_from_args(args, model_cfg)
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":  # torchrun tests/megatron_lm_program.py <Megatron flags>
    main(sys.argv[1:], os.environ.get("MODEL", "gpt"))
