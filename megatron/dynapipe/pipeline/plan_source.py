"""Where every rank gets each iteration's plan: planned once, on rank 0, ahead of training.

DynaPipe plans on CPUs while the GPUs train (seed `dynapipe.txt` §3, last paragraph) and hands
the plans to the executors through an instruction store (§3, §7). Here rank 0 alone runs a
`dynapipe_planner.service.PlanningService` over the data sampler's global batches
(`--planner-workers` processes planning `lookahead` iterations ahead; 0 plans inline) and
publishes each plan through a `plan_distribution.PlanChannel`; every other rank fetches it and
builds no planner at all.

Plans must not depend on where or when they were made: the DP's budget counts work, not
seconds (`PlannerConfig.dp_work_budget`), so a plan is a function of the seed and the batch
alone, and the service reads batches from a copy of the sampler taken at its current, possibly
resumed, position, so a run resumed from a checkpoint plans exactly the batches the
uninterrupted run would have planned. Each rank still advances its own sampler, which is what
checkpoints record, and `PlanSource.get` checks that the plan covers that batch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterator

import numpy as np
import torch.distributed as dist

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel, ProfiledCostModel
from dynapipe_planner.errors import iteration_name
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import PlannerConfig
from dynapipe_planner.service import PlannerRecipe, PlanningService

from ..data.sampler import GlobalBatchSampler
from ..job_config import JobConfig
from ..local_costs import local_cost_table
from ..model_flags import dtype_name
from .job_store import JobStore
from .plan_distribution import PlanChannel, new_job_secret, open_plan_store

PLANNING_RANK = 0


class PlanMismatch(RuntimeError):
    """A plan covers other samples than the sampler's batch of its iteration."""


def planner_recipe(args: argparse.Namespace, spec: ModelSpec, num_replicas: int) -> PlannerRecipe:
    """What the planning rank's planners are built from (picklable for worker processes): the
    job's DynaPipe choices (`JobConfig.of(args)`) over Megatron's sizes in `args`."""
    job = JobConfig.of(args)
    cluster = ClusterSpec(
        get_gpu(job.gpu),
        num_stages=args.pipeline_model_parallel_size,
        num_replicas=num_replicas,
        tp=args.tensor_model_parallel_size,
        memory_limit_bytes=job.memory_limit_bytes,
    )
    table = cost_table(args, spec)
    if table is None:
        cost_model = AnalyticCostModel(spec, cluster)
    else:
        cost_model = ProfiledCostModel.load(table, spec, cluster)
    config = PlannerConfig(
        num_replicas=num_replicas,
        batching=job.batching,
        schedule=job.schedule,
        recompute=job.recompute,  # the executor applies each plan's choice
        dtype=dtype_name(args),
        max_seqlen=args.seq_length,
        micro_batch_size=args.micro_batch_size if job.batching != "dynamic" else 0,
        packed_rows=job.packed_rows != "off",
        dp_packing=job.packed_rows == "dp",
    )
    return PlannerRecipe(cost_model, cluster.num_stages, config)


def cost_table(args: argparse.Namespace, spec: ModelSpec) -> str | None:
    """The cost table `--dynapipe-cost-model` names: a file, or with 'local' this machine's
    (`local_costs`, profiled on first use; at TP 1 only, where one rank runs the whole layer);
    None for the analytic model of `--dynapipe-gpu`."""
    choice = JobConfig.of(args).cost_model
    if choice == "analytic" or (choice == "local" and args.tensor_model_parallel_size > 1):
        return None
    if choice == "local":
        return str(local_cost_table(args, spec.vocab_size))
    return choice


class PlanSource:
    """Each iteration's plan on this rank, from `channel` (fed by `service` on rank 0)."""

    def __init__(self, channel: PlanChannel, service: PlanningService | None = None) -> None:
        self.channel, self.service = channel, service

    @property
    def store(self) -> JobStore:
        """The store the plans travel through (other job-wide bookkeeping may share it)."""
        return self.channel.store

    def get(self, iteration: int, batch: np.ndarray) -> tuple[ExecutionPlan, float]:
        """The plan of `iteration` and the seconds this rank waited for it; `batch` is the
        sampler's global batch of that iteration, which the plan must cover exactly."""
        started = time.perf_counter()
        plan = self.channel.fetch(iteration)
        waited_s = time.perf_counter() - started
        planned = np.sort(np.concatenate([mb.samples for mb in plan.microbatches]))
        if not np.array_equal(planned, np.sort(batch)):
            raise PlanMismatch(
                f"rank {self.channel.rank}: the plan of {iteration_name(iteration)} covers "
                f"{len(planned)} samples that differ from the sampler's batch of {len(batch)}; "
                f"the planning rank and this rank disagree on the data order"
            )
        return plan, waited_s

    def close(self) -> None:
        """Stop the planner workers (rank 0); the store lives as long as the process, for
        ranks that still read it after this one is done."""
        if self.service is not None:
            self.service.close()

    def __enter__(self) -> PlanSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_plan_source(
    recipe: PlannerRecipe | None,
    sampler: GlobalBatchSampler,
    lengths: np.ndarray,
    *,
    stop_iteration: int,
    num_workers: int,
    timeout_s: float,
    lookahead: int = 2,
) -> PlanSource:
    """This rank's plan source. On the planning rank `recipe` builds the planners, which start
    planning the sampler's batches from its current position up to `stop_iteration`; the other
    ranks pass None. Every rank must call this together (it exchanges the store's port)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store, secret = open_store(rank, world, timeout_s)
    service = None
    if rank == PLANNING_RANK:
        if recipe is None:
            raise ValueError(f"rank {rank} plans for the job and needs a planner recipe")
        work = _work_items(sampler.reader(), np.asarray(lengths), stop_iteration)
        service = PlanningService(
            recipe, work, num_workers=num_workers, lookahead=lookahead, timeout_s=timeout_s
        )
    channel = PlanChannel(
        store,
        rank,
        world,
        secret=secret,
        service=service,
        publisher_rank=PLANNING_RANK,
        timeout_s=timeout_s,
    )
    return PlanSource(channel, service)


def _work_items(
    sampler: GlobalBatchSampler, lengths: np.ndarray, stop_iteration: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    for iteration, batch in itertools.takewhile(lambda item: item[0] < stop_iteration, sampler):
        yield iteration, lengths[batch], batch


def open_store(rank: int, world: int, timeout_s: float) -> tuple[JobStore, bytes]:
    """The plan store and the job's secret, which opens the store and seals its entries. The
    planning rank draws the secret and serves the store on MASTER_ADDR, on a port the OS picks
    (a fixed one such as MASTER_PORT + 1 may be taken); port and secret reach the others over
    the world group, never through the store itself."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1") if world > 1 else "127.0.0.1"
    store = None
    if rank == PLANNING_RANK:
        secret = new_job_secret()
        store = open_plan_store(rank, secret=secret, host=host, port=0, timeout_s=timeout_s)
    if world > 1:
        job = [(store.port, secret) if store is not None else None]
        dist.broadcast_object_list(job, src=PLANNING_RANK)
        port, secret = job[0]
    if store is None:
        store = open_plan_store(rank, secret=secret, host=host, port=port, timeout_s=timeout_s)
    return store, secret
