"""Where each planned training iteration's forward and backward passes come from, in
Megatron's loop (`megatron_loop.DynaPipeSchedule`) and in DynaPipe's own (`training.pretrain`).

`PlannedIterations`: the sampler's next global batch (variable-length samples), its plan from
the planning rank (`pipeline.plan_source`), this rank's micro-batch tensors, run by
`PlanExecutor`, or with `--baseline packing-1f1b` by megatron-core's schedule
(`MegatronPackingBaseline`). It offers `bind` (the runner, once the model exists),
`next(iteration)`, the data position a checkpoint keeps (`data_position`) and the held-out
evaluators. (`--baseline megatron-1f1b` is Megatron's loop without DynaPipe: no planner runs.)
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.online_fit import IterationTimeFit, PlanFeatures
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.preflight import batch_capacity, longest_sample_refusal

from . import parallel_state as ps
from .checkpointing import ResumePoint
from .data.datasets import DataSplits
from .data.microbatches import MicroBatchTensors, rank_microbatches
from .data.sampler import GlobalBatchSampler
from .evaluation import Evaluator
from .job_config import JobConfig
from .pipeline.executor import (
    ForwardStepFunc,
    IterationResult,
    PlanExecutor,
    gpt_forward_step,
)
from .pipeline.megatron_baseline import MegatronPackingBaseline
from .pipeline.plan_source import PLANNING_RANK, open_plan_source, planner_recipe


@dataclass
class Iteration:
    """One iteration's work on this rank. `stats`: the log line's fields (a plan's stats);
    `waited_s`: how long the loop waited for the plan; `plan`: None without a planner;
    `fitted_s`: the plan's time as the job's online fit predicted it before it ran (None
    until the fit has seen enough iterations)."""

    run: Callable[[], IterationResult]
    stats: dict[str, Any]
    samples: int
    waited_s: float = 0.0
    plan: ExecutionPlan | None = None
    fitted_s: float | None = None


def global_batch_sampler(
    args: argparse.Namespace,
    lengths: np.ndarray,
    samples: int | None = None,
    shuffle: bool = True,
) -> GlobalBatchSampler:
    """Global batches as the flags define them: a token budget (--tokens-per-global-batch) or
    `samples` samples (default: Megatron's --global-batch-size); seeded shuffled epochs, or
    the samples in their order without `shuffle`."""
    if args.tokens_per_global_batch is not None:
        return GlobalBatchSampler(lengths, args.tokens_per_global_batch, args.seed, shuffle=shuffle)
    samples = samples or args.global_batch_size
    return GlobalBatchSampler(lengths, seed=args.seed, samples_per_batch=samples, shuffle=shuffle)


class PlannedIterations:
    """DynaPipe's iterations (and packing-1f1b's): one plan per global batch.

    Rank 0's planner workers start when this is built and plan ahead of training while the
    model is built. `resume` continues the data order of a checkpoint: at DynaPipe's saved
    sampler place, or (a checkpoint written by Megatron-LM) after as many global batches as it
    trained. `shuffle`: seeded shuffled epochs of the training samples (DynaPipe's datasets),
    or their own order (a Megatron-LM program's dataset, read as Megatron reads it)."""

    def __init__(
        self,
        args: argparse.Namespace,
        job: JobConfig,
        splits: DataSplits,
        spec: ModelSpec,
        resume: ResumePoint | None = None,
        shuffle: bool = True,
    ) -> None:
        self.args, self.job, self.splits, self.spec = args, job, splits, spec
        self.dataset = splits.train
        self.sampler = global_batch_sampler(args, self.dataset.lengths(), shuffle=shuffle)
        if resume is not None and resume.data_position is not None:
            self.sampler.load_state_dict(resume.data_position)
        elif resume is not None:
            for _ in range(resume.state.iteration):
                next(self.sampler)
        recipe = self._recipe()
        self._check_longest_sample(recipe)
        self.plans = open_plan_source(
            recipe,
            self.sampler,
            self.dataset.lengths(),
            stop_iteration=args.train_iters,
            num_workers=job.planner_workers,
            timeout_s=job.timeout_s,
        )
        self.store = self.plans.store
        self.runner: PlanExecutor | MegatronPackingBaseline | None = None
        self._row_multiple = 1  # the runner's sequence-parallel degree
        self._batch_form: Callable[[MicroBatchTensors], Any] | None = None
        self.fit = IterationTimeFit()  # what the plans really take on this job (online_fit)
        self._warmed_up = False

    def __enter__(self) -> PlannedIterations:
        self.plans.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.plans.__exit__(*exc)

    def _check_longest_sample(self, recipe) -> None:
        """Stop every rank before training when the dataset's longest sample cannot be planned
        (`dynapipe_planner.preflight`): the planning rank tries it and tells the others. The
        try gets half the job's timeout (the others wait for it in a collective bounded by the
        whole): a planner that does not answer by then is left to the planning service, whose
        own wait names the iteration."""
        refusal: list[str | None] = [None]
        if recipe is not None:
            args, lengths = self.args, self.dataset.lengths()
            capacity = batch_capacity(lengths, args.tokens_per_global_batch, args.global_batch_size)
            found: list[str | None] = []

            def try_longest() -> None:
                try:
                    planner = recipe.build()
                    found.append(longest_sample_refusal(planner, lengths, capacity, name))
                except Exception:  # the planning service meets it again and reports it
                    found.append(None)

            name = self.dataset.name
            probe = threading.Thread(target=try_longest, name="dynapipe-preflight", daemon=True)
            probe.start()
            probe.join(self.job.timeout_s / 2)
            refusal[0] = found[0] if found else None
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(refusal, src=PLANNING_RANK)
        if refusal[0] is not None:
            raise PlanningError(refusal[0])

    def _recipe(self):
        """The planner recipe on the planning rank, None elsewhere."""
        if dist.get_rank() != PLANNING_RANK:
            return None
        return planner_recipe(self.args, self.spec, ps.num_replicas())

    def bind(
        self,
        model: torch.nn.Module,
        config,
        device: torch.device,
        forward_step_func: ForwardStepFunc | None = None,
        core_batches: bool = False,
    ) -> None:
        """Run plans on `model`. With a program's own `forward_step_func`, each micro-batch
        reaches it as the dict Megatron's `get_batch` returns (Megatron-LM's loop), or with
        `core_batches` as one THD sequence and its `PackedSeqParams` (a megatron-core-only
        loop, `MicroBatchTensors.core_batch`)."""
        args, job = self.args, self.job
        if job.baseline == "packing-1f1b":  # the plans' packed rows, megatron-core's schedule
            self.runner = MegatronPackingBaseline(
                model,
                config,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                pad_id=self.dataset.pad_id,
            )
            return
        executor = PlanExecutor.for_this_rank(
            model,
            config,
            device=device,
            timeout_s=job.timeout_s,
            forward_step_func=forward_step_func or gpt_forward_step,
            slowdown=job.slowdowns(dist.get_world_size())[dist.get_rank()],
        )
        if forward_step_func is not None:
            form = (
                MicroBatchTensors.core_batch if core_batches else MicroBatchTensors.megatron_batch
            )
            self._batch_form = lambda batch: form(batch, device)
        self._row_multiple = executor.sequence_shards
        self.runner = executor

    def next(self, iteration: int) -> Iteration:
        _, batch = next(self.sampler)
        plan, waited_s = self.plans.get(iteration, batch)
        batches = rank_microbatches(plan, ps.replica(), self.dataset, self._row_multiple)
        if self._batch_form is not None:
            batches = _FormedBatches(batches, self._batch_form)
        return Iteration(
            lambda: self.runner.run(plan, batches, iteration=iteration),
            plan.stats,
            len(batch),
            waited_s,
            plan,
            self.fit.predict(PlanFeatures.of(plan)),
        )

    def measured(self, work: Iteration, measured_s: float) -> None:
        """Teach the online fit that `work` took `measured_s`. The process's first iteration
        is left out: it also pays one-time work (allocations, first calls, the planner's
        start)."""
        if not self._warmed_up:
            self._warmed_up = True
            return
        self.fit.observe(PlanFeatures.of(work.plan), measured_s, work.fitted_s)

    def data_position(self) -> dict:
        """The sampler's place, kept in a checkpoint's arguments."""
        return self.sampler.state_dict()

    def evaluators(self) -> dict[str, Evaluator]:
        """A planned evaluator per held-out split that has data, when --eval-iters asks."""
        args = self.args
        held_out = {"validation": self.splits.valid, "test": self.splits.test}
        return {
            name: Evaluator(
                name,
                data,
                global_batch_sampler(args, data.lengths(), args.eval_global_batch_size),
                self._recipe(),
                self.plans.channel,
                self.runner,
                iterations=args.eval_iters,
                timeout_s=self.job.timeout_s,
            )
            for name, data in held_out.items()
            if data is not None and args.eval_iters > 0
        }


class _FormedBatches(Mapping[int, Any]):
    """A rank's planned micro-batches in the form the program's `forward_step` reads, built
    when first read."""

    def __init__(
        self, batches: Mapping[int, MicroBatchTensors], form: Callable[[MicroBatchTensors], Any]
    ) -> None:
        self._batches, self._form = batches, form

    def __getitem__(self, mb: int) -> Any:
        return self._form(self._batches[mb])

    def __iter__(self) -> Iterator[int]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)
