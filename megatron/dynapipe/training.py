"""DynaPipe's own training loop: one plan per iteration, run by every rank's executor, for the
jobs megatron.training's loop cannot express (`job_config.runs_in_own_loop`: a searched
`--parallel-plan` with per-layer SDP here; `--dynamic-strategies` and `--hetero-plan` in
`layouts.training`). `pretrain_gpt.py` reaches it through `megatron.training.pretrain`, whose
`enable` wrapper hands such jobs here with the parsed flags.

Each iteration takes the next global batch (a token budget or a sample count), gets its plan
(micro-batches, schedule and communication of every pipeline; seed `dynapipe.txt` §3), planned
ahead of time on rank 0 and fetched by the others (`pipeline.plan_source`), builds this rank's
micro-batch tensors from it (`iterations`), runs it, steps the optimiser and logs what a
Megatron user watches plus what DynaPipe changes: real tokens/s, padding efficiency, the
planner's predicted iteration time next to the measured one, the planner's time for the plan
and how long training waited for it. A step that fails because a peer died names that rank and
the iteration (`pipeline.liveness`); every wait is bounded by `--dynapipe-timeout`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dynapipe_planner.megatron_model import spec_from_args
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.search.plan_file import SearchedPlan

from . import checkpointing, cpu_compat
from . import parallel_state as ps
from .arguments import ArgumentError, check_training_flags
from .checkpointing import TrainState
from .data.datasets import DataSplits, datasets
from .evaluation import validation_line
from .iterations import PlannedIterations
from .job_config import JobConfig
from .log import iteration_line, log_rank0, peak_memory_field
from .memory import every_rank, traced_peak
from .model import padded_vocab_size
from .parallel_plan import apply_parallel_plan, describe
from .pipeline.liveness import Liveness
from .pipeline.plan_source import PLANNING_RANK
from .stage import stage_in_ddp

log = logging.getLogger("dynapipe")


def _global_loss(loss_sum: float, tokens: int, tp: int) -> tuple[float, int]:
    """Loss per real token over the global batch (last stages report it; TP shards repeat it)."""
    totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=ps.device())
    dist.all_reduce(totals)
    loss_sum, tokens = float(totals[0]) / tp, round(float(totals[1]) / tp)
    return loss_sum / max(tokens, 1), tokens


IterationProbe = Callable[[int, ExecutionPlan], contextlib.AbstractContextManager[object]]


def pretrain(args: argparse.Namespace, probe: IterationProbe | None = None) -> list[float]:
    """Train for `args.train_iters` iterations; returns the per-iteration losses (every rank).

    `probe(iteration, plan)`, if given, is a context manager wrapped around each iteration's
    pipeline run (the plan's instructions, up to finalised gradients; not the optimiser step),
    the part the plan predicts: the cost-model accuracy benchmark measures it there. `args`
    are validated by `arguments` (which built their `JobConfig`).
    """
    job = JobConfig.of(args)
    check_training_flags(args)
    if job.baseline == "megatron-1f1b":
        raise ArgumentError("--baseline megatron-1f1b is Megatron's own loop (pretrain_gpt.py)")
    if job.hetero.enabled:
        from .layouts.training import pretrain_hetero

        return pretrain_hetero(args)
    # A searched plan sets TP, PP, the layer split and the batch; it stops a job it does not
    # fit before any group exists.
    plan = apply_parallel_plan(args, _world_size()) if job.parallel_plan else None
    cpu_compat.install()
    # Bad data, tokenizer files or checkpoints stop the job before any group exists.
    splits = datasets(args)
    resume = checkpointing.resume_point(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ps.initialize(
        tp,
        pp,
        max(1, _world_size() // (tp * pp)),
        timeout_s=job.timeout_s,
        layer_counts=list(plan.partition) if plan else None,
    )
    try:
        return _train(args, job, splits, resume, tp, probe, plan)
    finally:
        checkpointing.release_writer_processes()
        ps.destroy()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _train(
    args: argparse.Namespace,
    job: JobConfig,
    splits: DataSplits,
    resume: checkpointing.ResumePoint | None,
    tp: int,
    probe: IterationProbe | None,
    plan: SearchedPlan | None,
) -> list[float]:
    rank = dist.get_rank()
    checkpointed = plan.checkpointed_layers if plan else ()
    searched = None  # the plan file's own prediction, in place of the per-iteration planner's
    if plan is not None and plan.predicted_iteration_s is not None:
        searched = (plan.predicted_iteration_s, plan.priced_on)
    for note in (*job.notes, *([describe(plan)] if plan else [])):
        log_rank0(rank, note)
    if rank == 0 and args.save:
        checkpointing.remove_interrupted_saves(args.save)
    dataset = splits.train
    spec = spec_from_args(args, padded_vocab_size(args, dataset.vocab_size, tp))
    if args.load and resume is None:
        log_rank0(rank, f"no checkpoint in {args.load}: starting from scratch")
    iterations = PlannedIterations(args, job, splits, spec, resume)
    liveness = Liveness(iterations.store, rank, dist.get_world_size(), server_rank=PLANNING_RANK)
    with iterations, liveness:
        config, model, optimizer, scheduler = stage_in_ddp(
            args, spec.vocab_size, checkpointed, plan.sharded_layers if plan else ()
        )
        state = TrainState()
        if resume is not None:
            state = checkpointing.load(args, resume, model, optimizer, scheduler)
            log_rank0(rank, f"resumed from {args.load} at iteration {state.iteration}")
        iterations.bind(model, config, ps.device())
        log_rank0(rank, f"dataset {dataset.name}: {len(dataset)} samples; model {spec.to_dict()}")
        evaluators = iterations.evaluators()
        if args.eval_iters > 0 and splits.valid is None and args.eval_interval:
            log_rank0(rank, "--eval-interval: no validation data (see --split); not evaluating")

        def evaluate(split: str, where: str) -> None:
            loss = evaluators[split].evaluate(model)
            log_rank0(rank, validation_line(split, where, loss))

        losses = []
        started_at = time.monotonic()
        if args.manual_gc:  # Megatron's --manual-gc: collect at chosen iterations only
            gc.disable()
        while state.iteration < args.train_iters:
            iteration = state.iteration
            work = iterations.next(iteration)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            traced = job.log_peak_memory and state.iteration == args.train_iters - 1
            started = time.perf_counter()
            with liveness.step(iteration):
                with traced_peak(ps.device()) if traced else contextlib.nullcontext() as peak:
                    with probe(iteration, work.plan) if probe else contextlib.nullcontext():
                        result = work.run()
                    stepped, grad_norm, _ = optimizer.step()
                if stepped:  # as Megatron: a step skipped for overflow does not advance the LR
                    scheduler.step(increment=args.global_batch_size)
                measured_s = time.perf_counter() - started
                loss, tokens = _global_loss(result.loss_sum, result.num_tokens, tp)
                peaks = every_rank(peak.peak) if traced else None
            iterations.measured(work, measured_s)
            losses.append(loss)
            state.iteration += 1
            state.consumed_samples += work.samples
            state.consumed_tokens += tokens
            if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
                line = iteration_line(
                    state.iteration,
                    args.train_iters,
                    work,
                    loss,
                    tokens,
                    measured_s,
                    checkpointed,
                    searched,
                    iterations.fit,
                )
                lr = optimizer.param_groups[0]["lr"]
                line += f" | learning rate {lr:.3E}"
                if grad_norm is not None:
                    line += f" | grad norm {grad_norm:.3f}"
                if peaks is not None:
                    line += peak_memory_field(peaks)
                if args.fp16:  # Megatron's dynamic loss scaling skips steps that overflow
                    line += f" | loss scale {optimizer.get_loss_scale().item():.1f}"
                    line += "" if stepped else " | skipped (overflow)"
                log_rank0(rank, line)
            if (
                args.manual_gc
                and args.manual_gc_interval
                and (state.iteration % args.manual_gc_interval == 0)
            ):
                gc.collect()
            interval = args.eval_interval
            if "validation" in evaluators and interval and state.iteration % interval == 0:
                evaluate("validation", f"iteration {state.iteration}")
            stop = _exit_reason(args, state.iteration, started_at)
            if args.save and (
                (args.save_interval and state.iteration % args.save_interval == 0)
                or state.iteration == args.train_iters
                or stop
            ):
                with liveness.step(iteration):
                    checkpointing.save(
                        args, state, model, optimizer, scheduler, iterations.data_position()
                    )
            if stop:
                log_rank0(rank, f"exiting after iteration {state.iteration}: {stop}")
                return losses
        for split in evaluators:  # Megatron evaluates both held-out splits after training
            evaluate(split, f"iteration {state.iteration} on {split} set")
    return losses


def _exit_reason(args: argparse.Namespace, iteration: int, started_at: float) -> str | None:
    """Megatron's early exits: --exit-interval iterations, --exit-duration-in-mins minutes."""
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    if args.exit_duration_in_mins:
        elapsed = torch.tensor([(time.monotonic() - started_at) / 60.0], device=ps.device())
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # every rank stops at the same iteration
        if float(elapsed) > args.exit_duration_in_mins:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins}"
    return None
