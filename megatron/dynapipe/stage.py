"""This rank's pipeline stage as Megatron trains one: the model in Megatron's DDP, with
Megatron's optimiser and LR/weight-decay schedule, all built from the flags by Megatron's own
helpers. A searched plan's SDP layers are sharded by FSDP2 inside that DDP
(`sharded_layers`). The homogeneous training loop runs it; the Megatron checkpoint export of a
heterogeneous job (`layouts.megatron_export`) builds it unpipelined to write its state.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from .model import build_stage_model
from .pipeline.recompute import checkpoint_layers
from .sharded_layers import MixedDataParallel, fit_optimizer_to_mix, shard_layers


def megatron_optimizer(args: argparse.Namespace, model: torch.nn.Module):
    """Megatron's optimiser and LR/weight-decay schedule, built from the flags by Megatron's own
    helpers (`get_megatron_optimizer_config`, `get_optimizer_param_scheduler`). Megatron's
    scheduler and checkpointing read the flags from its global, and its checkpoint loader
    updates the micro-batch calculator (unused by DynaPipe's plans, kept at the flags' sizes)."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.training.global_vars import set_args
    from megatron.training.training import (
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(config, [model], config_overrides=overrides)
    set_args(args)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(
        args.rank,
        args.rampup_batch_size,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
        args.decrease_batch_size_if_needed,
    )
    return optimizer, get_optimizer_param_scheduler(optimizer)


def stage_in_ddp(
    args: argparse.Namespace,
    vocab_size: int,
    checkpointed: Collection[int] = (),
    sharded: Collection[int] = (),
):
    """This rank's stage of the model in Megatron DDP, its optimiser and LR schedule; the
    layers `checkpointed` names (0-based over the whole model) recompute their activations,
    those `sharded` names are SDP layers (ZeRO-3 over the data-parallel group)."""
    from megatron.training.training import get_megatron_ddp_config

    config, model = build_stage_model(args, vocab_size)
    checkpoint_layers(model, checkpointed)
    if config.fp16 or config.bf16:  # as Megatron's get_model: half-precision inputs and outputs
        model = Float16Module(config, model)
    shard_layers(model, sharded)  # the parameters in their training dtype
    mixed = bool(sharded)  # the whole job's plan: every stage reduces the norm over all ranks
    ddp = MixedDataParallel if mixed else DistributedDataParallel
    model = ddp(config, get_megatron_ddp_config(args), model)
    config.no_sync_func = model.no_sync  # reduce gradients in each stage's last backward only
    config.finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = megatron_optimizer(args, model)
    if mixed:
        fit_optimizer_to_mix(optimizer)
    config.grad_scale_func = optimizer.scale_loss  # fp16's loss scale, as Megatron sets it
    return config, model, optimizer, scheduler
