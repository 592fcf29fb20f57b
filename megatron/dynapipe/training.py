"""The training loop of `pretrain_gpt.py`: one plan per iteration, run by every rank's executor.

Each iteration takes the next global batch (a token budget, not a sample count), gets its plan
(micro-batches, schedule and communication of every pipeline; seed `dynapipe.txt` §3), builds
this rank's micro-batch tensors from it, runs the plan, steps the optimiser and logs what a
Megatron user watches plus what DynaPipe changes: real tokens/s, padding efficiency, the
planner's predicted iteration time next to the measured one, and planning time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dynapipe_planner.cluster import ClusterSpec, GiB, get_gpu
from dynapipe_planner.cost import AnalyticCostModel, ProfiledCostModel
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig

from . import checkpointing, cpu_compat
from . import parallel_state as ps
from .checkpointing import TrainState
from .data import GlobalBatchSampler, build_dataset, rank_microbatches
from .executor import PlanExecutor
from .model import ModelOptions, build_stage_model, padded_vocab_size

log = logging.getLogger("dynapipe")


def _cost_model(args: argparse.Namespace, spec: ModelSpec, cluster: ClusterSpec):
    if args.dynapipe_cost_model:
        return ProfiledCostModel.load(args.dynapipe_cost_model, spec, cluster)
    return AnalyticCostModel(spec, cluster)


def _dtype(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def build_planner(args: argparse.Namespace, spec: ModelSpec, dp: int) -> IterationPlanner:
    """The planner every rank would build identically (plans are deterministic)."""
    memory = int(args.dynapipe_memory_limit * GiB) if args.dynapipe_memory_limit else 0
    cluster = ClusterSpec(
        get_gpu(args.dynapipe_gpu),
        num_stages=args.pipeline_model_parallel_size,
        num_replicas=dp,
        tp=args.tensor_model_parallel_size,
        memory_limit_bytes=memory,
    )
    config = PlannerConfig(
        num_replicas=dp,
        batching=args.batching,
        schedule=args.pipeline_schedule if args.batching == "dynamic" else "1f1b",
        recompute="none",  # the runtime does not switch recomputation per iteration yet
        dtype=_dtype(args),
        max_seqlen=args.seq_length,
        micro_batch_size=args.micro_batch_size if args.batching != "dynamic" else 0,
    )
    return IterationPlanner(_cost_model(args, spec, cluster), cluster.num_stages, config)


def _optimizer(args: argparse.Namespace, model: torch.nn.Module):
    clip = args.clip_grad
    if clip > 0 and not torch.cuda.is_available():
        if dist.get_rank() == 0:
            log.warning("gradient clipping needs CUDA in megatron-core 0.19; disabled on CPU")
        clip = 0.0
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            clip_grad=clip,
            bf16=args.bf16,
            fp16=args.fp16,
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.train_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def _global_loss(loss_sum: float, tokens: int, tp: int) -> tuple[float, int]:
    """Loss per real token over the global batch (last stages report it; TP shards repeat it)."""
    totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
    dist.all_reduce(totals)
    loss_sum, tokens = float(totals[0]) / tp, round(float(totals[1]) / tp)
    return loss_sum / max(tokens, 1), tokens


IterationProbe = Callable[[int, ExecutionPlan], contextlib.AbstractContextManager[object]]


def pretrain(args: argparse.Namespace, probe: IterationProbe | None = None) -> list[float]:
    """Train for `args.train_iters` iterations; returns the per-iteration losses (every rank).

    `probe(iteration, plan)`, if given, is a context manager wrapped around each iteration's
    pipeline run (the plan's instructions, up to finalised gradients; not the optimiser step),
    the part the plan predicts: the cost-model accuracy benchmark measures it there.
    """
    cpu_compat.install()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ps.initialize(tp, pp, max(1, _world_size() // (tp * pp)), timeout_s=args.dynapipe_timeout)
    try:
        return _train(args, tp, probe)
    finally:
        ps.destroy()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _train(args: argparse.Namespace, tp: int, probe: IterationProbe | None) -> list[float]:
    dp, rank = ps.num_replicas(), dist.get_rank()
    dataset = build_dataset(args.data_path, max_seqlen=args.seq_length, seed=args.seed)
    spec = ModelSpec(
        "pretrain_gpt",
        "gpt",
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.ffn_hidden_size,
        padded_vocab_size(dataset.vocab_size, tp),
        max_position_embeddings=args.max_position_embeddings,
    )
    options = ModelOptions(
        dtype=_dtype(args),
        position_embedding=args.position_embedding_type,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        seed=args.seed,
    )
    config, model = build_stage_model(spec, args.seq_length, options)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = _optimizer(args, model)
    planner = build_planner(args, spec, dp)
    sampler = GlobalBatchSampler(dataset.lengths(), args.tokens_per_global_batch, args.seed)
    state = TrainState()
    if args.load:
        state = checkpointing.load(args.load, model, optimizer, scheduler, sampler)
        _log0(rank, f"resumed from {args.load} at iteration {state.iteration}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    executor = PlanExecutor.for_this_rank(
        model, config, device=device, timeout_s=args.dynapipe_timeout
    )
    _log0(rank, f"dataset {dataset.name}: {len(dataset)} samples; model {spec.to_dict()}")
    losses = []
    while state.iteration < args.train_iters:
        iteration = state.iteration
        _, indices = next(sampler)
        lengths = dataset.lengths()[indices]
        started = time.perf_counter()
        plan = planner.plan(lengths, indices)
        planning_s = time.perf_counter() - started
        batches = rank_microbatches(plan, ps.replica(), dataset)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        started = time.perf_counter()
        with probe(iteration, plan) if probe else contextlib.nullcontext():
            result = executor.run(plan, batches, iteration=iteration)
        optimizer.step()
        scheduler.step(increment=1)
        measured_s = time.perf_counter() - started
        loss, tokens = _global_loss(result.loss_sum, result.num_tokens, tp)
        losses.append(loss)
        state.iteration += 1
        state.consumed_tokens += tokens
        if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
            line = _iteration_line(args, state, plan.stats, loss, tokens, measured_s, planning_s)
            _log0(rank, line)
        if args.save and (
            state.iteration % args.save_interval == 0 or state.iteration == args.train_iters
        ):
            checkpointing.save(args.save, state, model, optimizer, scheduler, sampler)
    return losses


def _iteration_line(args, state, stats, loss, tokens, measured_s, planning_s) -> str:
    width = len(str(args.train_iters))
    done = state.iteration / args.train_iters
    bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
    return (
        f"[{bar}] iteration {state.iteration:>{width}}/{args.train_iters} | lm loss {loss:.4f} | "
        f"tokens/s {tokens / measured_s:,.0f} | padding eff {stats['padding_efficiency']:.3f} | "
        f"micro-batches {stats['num_microbatches']} | iteration {measured_s * 1e3:,.0f} ms "
        f"(predicted {stats['predicted_iteration_s'] * 1e3:,.0f} ms on {args.dynapipe_gpu}) | "
        f"planning {planning_s * 1e3:,.1f} ms"
    )


def _log0(rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.stdout, flush=True)
