"""A Megatron-LM training program as its users write one for megatron.training 0.19, plus the
one line that enables DynaPipe, placed before the program's other imports. `main(argv, model)`
trains a GPT from a classic `model_provider`, or a Llama from a `ModelConfig` in the config
container (megatron.training 0.19's preferred form), with Megatron's own `pretrain` loop,
optimiser, logging and checkpoints. `get_batch` is Megatron-LM's: tensor-parallel rank 0 reads
the iterator and megatron-core's `get_batch_on_this_tp_rank` broadcasts the batch. Nothing here
knows about DynaPipe but the import.
"""

# ruff: noqa: I001  (the DynaPipe line stays above the imports it patches)
from __future__ import annotations

import megatron.dynapipe.enable  # noqa: F401  (the one line a Megatron-LM program adds)

import os
import sys
from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_tp_rank
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args


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


def get_batch(data_iterator):
    """Megatron's batch dict on the first and last stages, read on tensor-parallel rank 0 and
    broadcast to the others; with --dataloader-inter-document-masking, packed sequences and
    their PackedSeqParams, which the middle stages need too (they read nothing else)."""
    args = get_args()
    middle = not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage())
    if middle and not args.dataloader_inter_document_masking:
        return None, None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = next(data_iterator) if tp_rank == 0 else {}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=args.dataloader_inter_document_masking,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    packed = None
    if batch.get("cu_seqlens") is not None:
        bounds, longest = batch["cu_seqlens"][0], int(batch["max_seqlen"][0])
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    return [*(batch.get(key) for key in keys), packed]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=packed)
    return output, partial(loss_func, loss_mask)


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
