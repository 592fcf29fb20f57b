"""The training loop of heterogeneous jobs: `--dynamic-strategies` and `--hetero-plan`.

Hydraulis (seed `hydraulis.txt` §4, §5.2) picks each iteration's parallel strategy, pipelines
of different TP/PP side by side, and keeps the fp32 master weights and optimiser states in one
fixed partition over all ranks, so a switch moves no optimiser state. HexiScale (`hexiscale.txt`
§3.2) runs one fixed asymmetric layout with a batch share per pipeline. Both run here as one
loop over the `DisaggregatedOptimizer` (a static layout is a set of one strategy):

1. start-up: every candidate strategy's layouts (`dynapipe_planner.strategy.candidates`, from
   what `hetero_job` derives from the flags, or the `--hetero-plan` file), all their process
   groups in one order on every rank, strategy 0's stage model (the others are built on first
   use, `strategy_models`); master weights from strategy 0's fresh layers or a checkpoint;
2. per iteration: rank 0's planner (planning ahead in worker processes,
   `pipeline.plan_source`) selects and plans a strategy for the global batch; every rank reads
   the strategy from the plan's layouts, switches to it (`parallel_state.use_strategy`), pulls
   its working weights, runs the plan, pushes gradients to the owners (the executor's finalize
   step), and the owners step.

Why the disaggregated optimiser also for a static layout (instead of Megatron's optimiser with
`grad_sync.AsymmetricGradSync`): one code path, the push is the asymmetric sync (pieces summed
at the owners, weighted by real tokens), the optimiser state is sharded over every rank rather
than replicated on every holder, and checkpoints are the same layout-independent full state
(`layouts.checkpointing`) whichever mode saved them.

Each iteration's line names the strategy and splits the time into pull, propagation, push and
optimiser step (slowest rank of each), Hydraulis Table 1's decomposition. Gradients are clipped
to `--clip-grad` by their global norm (every element has one owner after the push), weight
decay is decoupled and spares biases and norms, as Megatron's optimiser does.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_planner.cluster import GpuSpec, get_gpu
from dynapipe_planner.devices import emulated_cluster
from dynapipe_planner.megatron_model import spec_from_args
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.plan import ReplicaLayout
from dynapipe_planner.planner import PlannerConfig
from dynapipe_planner.static_hetero import StaticHeteroRecipe
from dynapipe_planner.strategy.candidates import (
    CandidateSet,
    load_candidates,
    mixed_candidates,
    propose_candidates,
    realisable,
)
from dynapipe_planner.strategy.mixed import PlacedSchemeModels
from dynapipe_planner.strategy.schemes import AnalyticSchemeModels
from dynapipe_planner.strategy.selection import SelectionConfig, StrategyRecipe

from .. import cpu_compat
from .. import parallel_state as ps
from ..checkpointing import TrainState
from ..data.datasets import datasets
from ..data.microbatches import rank_microbatches
from ..iterations import global_batch_sampler
from ..job_config import JobConfig
from ..log import log_rank0
from ..model import build_stage_model, layout_free_tp, padded_vocab_size
from ..model_flags import dtype_name
from ..pipeline.executor import PlanExecutor
from ..pipeline.liveness import Liveness
from ..pipeline.plan_source import PLANNING_RANK, open_plan_source
from . import checkpointing, megatron_export
from .plan_file import load_hetero_plan
from .strategy_models import StrategyModels
from .switch import DisaggregatedOptimizer

TIMES = ("pull", "propagation", "push", "optimizer")


@dataclasses.dataclass
class HeteroJob:
    """What every rank derives alike from the flags and the data before any group exists."""

    spec: ModelSpec
    candidates: CandidateSet
    recipe: object  # the planning rank's planner recipe (StrategyRecipe or StaticHeteroRecipe)
    dropped: list[str]  # candidate strategies the job cannot run, for the log
    config: JobConfig  # what DynaPipe decided from the flags (`JobConfig.of(args)`)


def describe(layouts: list[ReplicaLayout]) -> str:
    """A layout in a few characters: each pipeline's stages as TP x layers."""
    return " + ".join(
        "[" + "|".join(f"TP{s.tp}:L{s.layers[0]}-{s.layers[1]}" for s in r.stages) + "]"
        for r in layouts
    )


def hetero_job(args: argparse.Namespace, vocab_size: int, lengths: np.ndarray, world: int):
    """The candidate strategies (or the static layout), the model spec with a vocabulary every
    strategy's TP degrees divide, and the planner recipe."""
    job_config = JobConfig.of(args)
    base = spec_from_args(args, padded_vocab_size(args, vocab_size, 1))
    memory = job_config.memory_limit_bytes
    dtype = dtype_name(args)
    dropped: list[str] = []
    speeds = job_config.slowdowns(world)
    hetero = job_config.hetero
    mixed = hetero.dynamic_strategies and not hetero.strategy_candidates and len(set(speeds)) > 1
    if hetero.hetero_plan:
        plan_file = load_hetero_plan(hetero.hetero_plan, base, world)
        layouts, fractions = plan_file.layouts, plan_file.fractions
        candidates = CandidateSet([f"hetero-plan {describe(layouts)}"], [layouts], [None])
    elif mixed:  # the selector knows each rank's speed: schemes typed by speed class
        cluster = emulated_cluster(_gpu(job_config), speeds, memory or None)
        profiles, candidates = mixed_candidates(
            PlacedSchemeModels(cluster, base, world),
            lengths,
            max_seqlen=args.seq_length,
            recompute=_profile_recompute(job_config),
            dropped=dropped,
        )
        proposals, homogeneous = [], False
    else:
        models = AnalyticSchemeModels(
            base, _gpu(job_config), world, gpus_per_node=world, memory_limit_bytes=memory
        )
        if hetero.strategy_candidates:
            profiles, proposals = load_candidates(hetero.strategy_candidates, base, world)
        else:
            profiles, proposals = propose_candidates(
                base,
                lengths,
                models,
                max_seqlen=args.seq_length,
                tokens_per_iteration=_tokens_per_batch(args, lengths),
                recompute=_profile_recompute(job_config),
            )
        homogeneous = not hetero.strategy_candidates  # a file is the whole candidate set
        candidates = realisable(
            profiles, proposals, world, base.num_layers, homogeneous=homogeneous, dropped=dropped
        )
    spec = dataclasses.replace(
        base,
        vocab_size=padded_vocab_size(
            args, vocab_size, math.lcm(layout_free_tp(world), candidates.vocab_multiple_tp)
        ),
    )
    if hetero.hetero_plan:
        config = PlannerConfig(
            num_replicas=1,
            batching=job_config.batching,
            schedule=job_config.schedule,
            recompute=job_config.recompute,
            dtype=dtype,
            max_seqlen=args.seq_length,
            micro_batch_size=args.micro_batch_size if job_config.batching != "dynamic" else 0,
        )
        # The file's per-stage modes apply unless a mode was asked for explicitly.
        stage_modes = plan_file.recompute if job_config.recompute == "auto" else ()
        recipe = StaticHeteroRecipe(
            spec, job_config.gpu, tuple(layouts), tuple(fractions), config, memory, stage_modes
        )
    else:
        selection = SelectionConfig(
            inside="dynapipe" if job_config.batching == "dynamic" else "packing",
            window=hetero.strategy_window,
            homogeneous=homogeneous,
            batch_candidates=0,  # strategies from the batch itself would need new groups
            recompute=job_config.recompute,
            dtype=dtype,
            seed=args.seed,
            allowed=frozenset(candidates.strategies),
        )
        if mixed:
            placed = PlacedSchemeModels(cluster, spec, world)
            recipe = StrategyRecipe(
                tuple(profiles),
                (),
                placed,
                world,
                selection,
                fixed=tuple(candidates.strategies),
                placement=placed.layouts,
            )
        else:
            scheme_models = AnalyticSchemeModels(
                spec, _gpu(job_config), world, gpus_per_node=world, memory_limit_bytes=memory
            )
            recipe = StrategyRecipe(
                tuple(profiles), tuple(proposals), scheme_models, world, selection
            )
    return HeteroJob(spec, candidates, recipe, dropped, job_config)


def _gpu(job_config: JobConfig) -> GpuSpec:
    return get_gpu(job_config.gpu)


def _profile_recompute(job_config: JobConfig) -> str:
    return "none" if job_config.recompute == "auto" else job_config.recompute


def pretrain_hetero(
    args: argparse.Namespace,
    *,
    initial_weights: dict[str, np.ndarray] | None = None,
    strategies_out: list[str] | None = None,
) -> list[float]:
    """Train `args.train_iters` iterations of a heterogeneous job; returns the per-iteration
    losses (every rank). `initial_weights` (whole-model names) replace the fresh layers (the
    tests' reference); `strategies_out` collects each iteration's strategy name."""
    cpu_compat.install()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    splits = datasets(args)
    dataset = splits.train
    job = hetero_job(args, dataset.vocab_size, dataset.lengths(), world)
    ps.initialize_strategies(
        job.candidates.layouts,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        timeout_s=job.config.timeout_s,
    )
    if splits.valid is not None and args.eval_iters > 0:
        log_rank0(
            dist.get_rank(),
            "evaluation (--eval-iters) is not implemented for --dynamic-strategies and "
            "--hetero-plan jobs yet; training without it",
        )
    try:
        return _train(args, job, dataset, initial_weights, strategies_out)
    finally:
        ps.destroy()


def _train(args, job: HeteroJob, dataset, initial_weights, strategies_out) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    for line in job.dropped:
        log_rank0(rank, line)
    names = job.candidates.names
    listed = "; ".join(f"{k}: {n}" for k, n in enumerate(names))
    log_rank0(rank, f"{len(names)} strategies: {listed}")
    if rank == 0 and args.save:
        checkpointing.remove_interrupted_saves(args.save)
    sampler = global_batch_sampler(args, dataset.lengths())
    checkpoint = checkpointing.read_latest(args)
    if checkpoint is not None:
        sampler.load_state_dict(checkpoint.sampler_state)
    plans = open_plan_source(
        job.recipe if rank == PLANNING_RANK else None,
        sampler,
        dataset.lengths(),
        stop_iteration=args.train_iters,
        num_workers=job.config.planner_workers,
        timeout_s=job.config.timeout_s,
    )
    liveness = Liveness(plans.store, rank, world, server_rank=PLANNING_RANK)
    export = _megatron_export(args, job.spec.vocab_size, job.config.timeout_s)
    with plans, liveness:
        optimizer, models = _build(args, job)
        scheduler = _scheduler(args, optimizer)
        state = TrainState()
        if checkpoint is not None:
            for note in checkpoint.restore(optimizer):
                log_rank0(rank, note)
            state = checkpoint.state
            scheduler.step(increment=state.iteration * args.global_batch_size)
            log_rank0(rank, f"resumed from {args.load} at iteration {state.iteration}")
        elif initial_weights is not None:
            optimizer.load_full(initial_weights)
        else:
            optimizer.load_from(0)
        shape = job.spec.to_dict()
        log_rank0(rank, f"dataset {dataset.name}: {len(dataset)} samples; model {shape}")
        losses = []
        while state.iteration < args.train_iters:
            iteration = state.iteration
            _, batch = next(sampler)
            plan, waited_s = plans.get(iteration, batch)
            k = job.candidates.index_of(plan)
            ps.use_strategy(k)
            stage = models.get(k)
            started = time.perf_counter()
            with liveness.step(iteration):
                optimizer.pull(k)
                stage.model.zero_grad(set_to_none=True)
                batches = rank_microbatches(plan, ps.replica(), dataset)
                result = stage.executor.run(plan, batches, iteration=iteration)
                ran = time.perf_counter()
                grad_norm = optimizer.clip_grad_norm(args.clip_grad)
                optimizer.step()
                scheduler.step(increment=args.global_batch_size)
                measured_s = time.perf_counter() - started
                timer = {
                    "pull": optimizer.times["pull"],
                    "push": optimizer.times["push"],
                    "optimizer": measured_s - (ran - started),
                }
                timer["propagation"] = measured_s - sum(timer.values())
                loss, tokens, slowest = _global_report(result, timer)
            losses.append(loss)
            if strategies_out is not None:
                strategies_out.append(names[k])
            state.iteration += 1
            state.consumed_tokens += tokens
            if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
                line = _line(args, state, names[k], plan.stats, loss, tokens, measured_s, slowest)
                line += f" (waited {waited_s * 1e3:,.1f} ms) | grad norm {grad_norm:.3f}"
                log_rank0(rank, line)
            if args.save and (
                state.iteration % args.save_interval == 0 or state.iteration == args.train_iters
            ):
                with liveness.step(iteration):
                    checkpointing.save(args.save, state, optimizer, sampler, export)
    return losses


def _megatron_export(
    args: argparse.Namespace, vocab: int, timeout_s: float
) -> Callable[[Path], None] | None:
    """How each save also writes a Megatron-LM checkpoint (`megatron_export`), or None (said
    once) where the job's flags leave only the layout-independent one."""
    why_not = megatron_export.cannot_export(args) if args.save else None
    if not args.save or why_not:
        if why_not:
            log_rank0(dist.get_rank(), f"checkpoints in {args.save}: no Megatron copy ({why_not})")
        return None
    return partial(
        megatron_export.export_in_child,
        args,
        directory=Path(args.save),
        vocab=vocab,
        timeout_s=timeout_s,
    )


def _tokens_per_batch(args: argparse.Namespace, lengths: np.ndarray) -> int:
    """Tokens a global batch holds: the budget, or --global-batch-size samples of mean length."""
    if args.tokens_per_global_batch is not None:
        return args.tokens_per_global_batch
    return max(1, round(args.global_batch_size * float(np.mean(lengths))))


def _scheduler(args: argparse.Namespace, optimizer: DisaggregatedOptimizer):
    """Megatron's LR and weight-decay schedule, over the disaggregated optimiser's AdamW."""
    from megatron.training.global_vars import set_args
    from megatron.training.training import get_optimizer_param_scheduler

    set_args(args)  # Megatron's scheduler reads the flags from its global
    return get_optimizer_param_scheduler(optimizer.optimizer)


def _build(args, job: HeteroJob) -> tuple[DisaggregatedOptimizer, StrategyModels]:
    """The one optimiser (from strategy 0's stage model) and the cache of stage models."""

    def build(k: int):
        ps.use_strategy(k)
        return build_stage_model(args, job.spec.vocab_size)

    config, model = build(0)
    optimizer = DisaggregatedOptimizer(
        {0: model},
        ps.topologies(),
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        overlap=job.config.hetero.overlap_pull_push,
    )
    slowdown = job.config.slowdowns(dist.get_world_size())[dist.get_rank()]
    device = ps.device()

    def make_executor(k: int, config, model) -> PlanExecutor:
        config.finalize_model_grads_func = optimizer.finalize_func(k)
        return PlanExecutor.for_this_rank(
            model, config, device=device, timeout_s=job.config.timeout_s, slowdown=slowdown
        )

    models = StrategyModels(
        optimizer, build, make_executor, job.config.hetero.max_cached_strategies
    )
    models.add(0, config, model)
    return optimizer, models


def _global_report(result, timer: dict[str, float]) -> tuple[float, int, dict[str, float]]:
    """Loss per real token of the global batch (each pipeline's last-stage TP leader reports
    its pipeline's) and each time's slowest rank."""
    place = ps.topology().place(dist.get_rank())
    leader = place.is_last and place.tp_rank == 0
    totals = torch.tensor(
        [result.loss_sum if leader else 0.0, float(result.num_tokens) if leader else 0.0],
        dtype=torch.float64,
        device=ps.device(),
    )
    dist.all_reduce(totals)
    times = torch.tensor(
        [timer.get(t, 0.0) for t in TIMES], dtype=torch.float64, device=ps.device()
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    tokens = round(float(totals[1]))
    slowest = dict(zip(TIMES, times.tolist(), strict=True))
    return float(totals[0]) / max(tokens, 1), tokens, slowest


def _recompute_modes(stats: dict) -> str:
    """Each pipeline's recomputation, its stages' modes joined by "/" where they differ."""
    modes = [p.get("recompute", "?") for p in stats.get("pipelines", [stats])]
    return " + ".join(m if isinstance(m, str) else "/".join(m) for m in modes)


def _line(args, state, strategy, stats, loss, tokens, measured_s, slowest) -> str:
    width = len(str(args.train_iters))
    split = ", ".join(f"{t} {slowest[t] * 1e3:,.0f}" for t in TIMES)
    return (
        f"iteration {state.iteration:>{width}}/{args.train_iters} | strategy {strategy} | "
        f"lm loss {loss:.4f} | tokens/s {tokens / measured_s:,.0f} | "
        f"micro-batches {stats.get('num_microbatches', 0)} | "
        f"recompute {_recompute_modes(stats)} | "
        f"iteration {measured_s * 1e3:,.0f} ms ({split} ms, slowest rank) | "
        f"predicted {stats.get('predicted_iteration_s', 0.0) * 1e3:,.1f} ms | "
        f"planning {stats.get('planning_time_s', 0.0) * 1e3:,.1f} ms"
    )
