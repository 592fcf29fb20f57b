"""Train a megatron-core GPT with DynaPipe's per-iteration plans (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 1024 --pipeline-model-parallel-size 2 \
        --dynamic-micro-batching --tokens-per-global-batch 16384 --train-iters 10 --lr 1e-3

This is a Megatron-LM program: a model provider, `forward_step` with Megatron-LM's `get_batch`
and a dataset provider, driven by megatron.training's own `pretrain` loop (its optimiser, LR
schedule, logging, evaluation and checkpoints). The first import is the only DynaPipe line; a
user's Megatron-LM program gains DynaPipe by adding the same line (`megatron.dynapipe.enable`).
With `--dynamic-micro-batching` DynaPipe plans every global batch of variable-length samples and
its executor runs the plan in place of megatron-core's schedule; without it Megatron trains its
fixed-length samples as Megatron-LM does (what `--baseline megatron-1f1b` names).

Every Megatron-LM flag parses with Megatron's meaning (Megatron's own parser); the ones this
runtime cannot honour stop with one line. Data (`--data-path`: Megatron `.bin/.idx` prefixes,
`.jsonl`, `synthetic:<preset>`, or none for the built-in corpus with the byte tokenizer) is
read by DynaPipe's datasets, which Megatron's samples here are windows of. Jobs Megatron's loop
cannot express, `--dynamic-strategies` (a strategy per iteration, Hydraulis), `--hetero-plan
FILE` (an asymmetric layout, HexiScale) and `--parallel-plan FILE` (per-layer SDP/DP/TP/CKPT,
Galvatron-BMW), run in DynaPipe's own loop with the same flags (`megatron_loop`).

A user error (bad data, tokenizer files, checkpoint, plan file, a model that fits nowhere) ends
the job with exit status 2 and one line on rank 0. A fault of the running job (a peer that
died, a plan that never came or was refused, a failed transfer) ends it with exit status 1 and
one line on each rank that saw it, naming that rank. `--debug` (or DYNAPIPE_DEBUG=1) adds the
traceback to either.
"""

# ruff: noqa: I001  (the DynaPipe line stays above the imports it patches)
import megatron.dynapipe.enable  # noqa: F401  (the one line a Megatron-LM program adds)

from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_tp_rank
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.models.gpt import GPTModelBuilder

from megatron.dynapipe.data.datasets import job_datasets
from megatron.dynapipe.data.megatron_samples import DocumentSamples, fixed_length_samples
from megatron.dynapipe.exits import run_or_exit
from megatron.dynapipe.job_config import JobConfig


def model_provider(
    pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **_
):
    """This pipeline stage of the GPT the flags describe, built by megatron.training's GPT
    builder (TransformerEngine's layers with `--transformer-impl transformer_engine`, the local
    ones otherwise); Llama shapes come from the flags (RMSNorm, SwiGLU, GQA, RoPE, untied)."""
    args = get_args()
    model_config = gpt_config_from_args(args, config or core_transformer_config_from_args(args))
    return GPTModelBuilder(model_config).build_model(
        pg_collection or ProcessGroupCollection.use_mpu_process_groups(),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
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
    batch = {}
    if tp_rank == 0:  # megatron-core broadcasts from the device, where the others receive
        batch = {
            key: value.cuda(non_blocking=True) if torch.is_tensor(value) else value
            for key, value in next(data_iterator).items()
        }
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
    """The micro-batch's summed loss over its real tokens and their count (Megatron sums both
    over the global batch with `--calculate-per-token-loss`, which DynaPipe turns on when it
    plans; otherwise Megatron averages each micro-batch's loss, as without DynaPipe)."""
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


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Each split of the flags' documents (`data.megatron_samples`): megatron-core GPTDatasets
    of `--seq-length` windows where DynaPipe does not plan (training without
    `--dynamic-micro-batching`, and evaluation), and the variable-length samples themselves
    for DynaPipe to plan over (`DocumentSamples`)."""
    args = get_args()
    planned = JobConfig.of(args).plans
    splits = job_datasets(args)
    windows = [
        None if data is None or not count else fixed_length_samples(data, args, count, split)
        for data, count, split in zip(
            splits, train_val_test_num_samples, ("train", "valid", "test"), strict=True
        )
        if split != "train" or not planned
    ]
    if planned:
        return DocumentSamples(splits.train), *windows
    return tuple(windows)


train_valid_test_datasets_provider.is_distributed = True


if __name__ == "__main__":
    parse_and_validate_args()
    run_or_exit(lambda: job_datasets(get_args()))  # bad data flags stop before any group exists
    pretrain(
        pretrain_cfg_container_from_args(get_args()),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider,
    )
