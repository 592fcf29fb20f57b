"""Where each training iteration's forward and backward passes come from.

`training.pretrain` runs one loop for every method (optimiser step, log line, checkpoints,
evaluation, early exits); the methods differ in how an iteration's work is made:

- `PlannedIterations`: the sampler's next global batch (variable-length samples), its plan
  from the planning rank (`pipeline.plan_source`), this rank's micro-batch tensors, run by
  `PlanExecutor`, or with `--baseline packing-1f1b` by megatron-core's schedule
  (`MegatronPackingBaseline`);
- `MegatronIterations` (`--baseline megatron-1f1b`): global batch k of Megatron's fixed-length
  samples (`data.megatron_samples`) run by megatron-core's schedule; no planner runs.

Both offer the same: `bind` (the runner, once the model exists), `next(iteration)`, the data
position a checkpoint keeps (`data_position`) and the held-out evaluators.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.plan import ExecutionPlan

from . import parallel_state as ps
from .checkpointing import CheckpointError, ResumePoint
from .data.datasets import DataSplits
from .data.megatron_samples import fixed_length_samples
from .data.megatron_samples import rank_microbatches as fixed_length_microbatches
from .data.microbatches import MicroBatchTensors, rank_microbatches
from .data.sampler import GlobalBatchSampler
from .device_speed import parse_device_speed
from .evaluation import Evaluator, FixedLengthEvaluator
from .pipeline.executor import (
    ForwardStepFunc,
    IterationResult,
    PlanExecutor,
    gpt_forward_step,
)
from .pipeline.megatron_baseline import MegatronFixedLengthBaseline, MegatronPackingBaseline
from .pipeline.plan_source import PLANNING_RANK, open_plan_source, open_store, planner_recipe


@dataclass
class Iteration:
    """One iteration's work on this rank. `stats`: the log line's fields (a plan's stats);
    `waited_s`: how long the loop waited for the plan; `plan`: None without a planner."""

    run: Callable[[], IterationResult]
    stats: dict[str, Any]
    samples: int
    waited_s: float = 0.0
    plan: ExecutionPlan | None = None


def global_batch_sampler(
    args: argparse.Namespace, lengths: np.ndarray, samples: int | None = None
) -> GlobalBatchSampler:
    """Global batches as the flags define them: a token budget (--tokens-per-global-batch) or
    `samples` samples (default: Megatron's --global-batch-size)."""
    if args.tokens_per_global_batch is not None:
        return GlobalBatchSampler(lengths, args.tokens_per_global_batch, args.seed)
    samples = samples or args.global_batch_size
    return GlobalBatchSampler(lengths, seed=args.seed, samples_per_batch=samples)


class PlannedIterations:
    """DynaPipe's iterations (and packing-1f1b's): one plan per global batch.

    Rank 0's planner workers start when this is built and plan ahead of training while the
    model is built. `resume` continues the data order of a checkpoint: at DynaPipe's saved
    sampler place, or (a checkpoint written by Megatron-LM) after as many global batches as it
    trained."""

    def __init__(
        self,
        args: argparse.Namespace,
        splits: DataSplits,
        spec: ModelSpec,
        resume: ResumePoint | None = None,
    ) -> None:
        self.args, self.splits, self.spec = args, splits, spec
        self.dataset = splits.train
        self.sampler = global_batch_sampler(args, self.dataset.lengths())
        if resume is not None and resume.data_position is not None:
            self.sampler.load_state_dict(resume.data_position)
        elif resume is not None:
            for _ in range(resume.state.iteration):
                next(self.sampler)
        self.plans = open_plan_source(
            self._recipe(),
            self.sampler,
            self.dataset.lengths(),
            stop_iteration=args.train_iters,
            num_workers=args.planner_workers,
            timeout_s=args.dynapipe_timeout,
        )
        self.store = self.plans.store
        self.runner: PlanExecutor | MegatronPackingBaseline | None = None
        self._megatron_batches_on: torch.device | None = None

    def __enter__(self) -> PlannedIterations:
        self.plans.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.plans.__exit__(*exc)

    def _documents(self) -> bool:
        """Whether the program reads every batch as Megatron's inter-document-masking form."""
        return bool(getattr(self.args, "dataloader_inter_document_masking", False))

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
    ) -> None:
        """Run plans on `model`. With a program's own `forward_step_func` (Megatron-LM's
        loop), each micro-batch reaches it as the dict Megatron's `get_batch` returns."""
        args = self.args
        if args.baseline == "packing-1f1b":  # the plans' packed rows, megatron-core's schedule
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
            timeout_s=args.dynapipe_timeout,
            forward_step_func=forward_step_func or gpt_forward_step,
        )
        self._megatron_batches_on = device if forward_step_func is not None else None
        speeds = parse_device_speed(getattr(args, "device_speed", None), dist.get_world_size())
        executor.slowdown = speeds[dist.get_rank()]
        executor.all_thd = forward_step_func is not None and self._documents()
        self.runner = executor

    def next(self, iteration: int) -> Iteration:
        _, batch = next(self.sampler)
        plan, waited_s = self.plans.get(iteration, batch)
        batches = rank_microbatches(plan, ps.replica(), self.dataset)
        if self._megatron_batches_on is not None:
            batches = _MegatronBatches(batches, self._megatron_batches_on, self._documents())
        return Iteration(
            lambda: self.runner.run(plan, batches, iteration=iteration),
            plan.stats,
            len(batch),
            waited_s,
            plan,
        )

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
                timeout_s=args.dynapipe_timeout,
            )
            for name, data in held_out.items()
            if data is not None and args.eval_iters > 0
        }


class _MegatronBatches(Mapping[int, dict]):
    """A rank's planned micro-batches as Megatron's batch dicts, built when first read; all in
    the `--dataloader-inter-document-masking` form when `documents`."""

    def __init__(
        self, batches: Mapping[int, MicroBatchTensors], device: torch.device, documents: bool
    ) -> None:
        self._batches, self._device, self._documents = batches, device, documents

    def __getitem__(self, mb: int) -> dict:
        return self._batches[mb].megatron_batch(self._device, self._documents)

    def __iter__(self) -> Iterator[int]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


class MegatronIterations:
    """`--baseline megatron-1f1b`: Megatron's fixed-length samples, global batch k = samples
    [k B, (k + 1) B) of megatron-core's GPTDataset, B = --global-batch-size."""

    def __init__(
        self, args: argparse.Namespace, splits: DataSplits, resume: ResumePoint | None = None
    ) -> None:
        self.args, self.splits = args, splits
        self.batch_size = args.global_batch_size
        self.samples = fixed_length_samples(
            splits.train, args, args.train_iters * self.batch_size, "train"
        )
        if resume is not None and resume.data_position is not None:
            raise CheckpointError(
                f"--baseline megatron-1f1b: {resume.directory} holds DynaPipe's variable-length "
                "data order, not Megatron's fixed-length samples"
            )
        self.store, _ = open_store(dist.get_rank(), dist.get_world_size(), args.dynapipe_timeout)
        self.runner: MegatronFixedLengthBaseline | None = None

    def __enter__(self) -> MegatronIterations:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, model: torch.nn.Module, config, device: torch.device) -> None:
        recompute = self.args.dynapipe_recompute
        self.runner = MegatronFixedLengthBaseline(
            model,
            config,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            recompute="none" if recompute in (None, "auto") else recompute,
        )

    def next(self, iteration: int) -> Iteration:
        microbatches = fixed_length_microbatches(
            self.samples,
            iteration,
            global_batch_size=self.batch_size,
            micro_batch_size=self.args.micro_batch_size,
            dp_rank=ps.replica(),
            dp_size=ps.num_replicas(),
        )
        stats = {
            "padding_efficiency": 1.0,  # every position of a window is a real token
            "num_microbatches": self.batch_size // self.args.micro_batch_size,
            "recompute": self.runner.recompute,
        }
        return Iteration(lambda: self.runner.run(microbatches), stats, self.batch_size)

    def data_position(self) -> None:
        """Megatron's data position is its consumed sample count (global batch k is samples
        [k B, (k + 1) B)): nothing beyond Megatron's own checkpoint fields."""
        return None

    def evaluators(self) -> dict[str, FixedLengthEvaluator]:
        """An evaluator per held-out split with data, over its own fixed-length samples: every
        evaluation (each --eval-interval and the final one) takes the next --eval-iters
        global batches of them, as Megatron's validation iterator does."""
        args = self.args
        if args.eval_iters <= 0:
            return {}
        evaluations = 1 + (args.train_iters // args.eval_interval if args.eval_interval else 0)
        num_samples = evaluations * args.eval_iters * self.batch_size
        held_out = {"validation": (self.splits.valid, "valid"), "test": (self.splits.test, "test")}
        return {
            name: FixedLengthEvaluator(
                name,
                fixed_length_samples(data, args, num_samples, split),
                self.runner,
                global_batch_size=self.batch_size,
                micro_batch_size=args.micro_batch_size,
                iterations=args.eval_iters,
            )
            for name, (data, split) in held_out.items()
            if data is not None
        }


def iterations_for(
    args: argparse.Namespace, splits: DataSplits, spec: ModelSpec, resume: ResumePoint | None
) -> PlannedIterations | MegatronIterations:
    """The iterations the flags ask for."""
    if args.baseline == "megatron-1f1b":
        return MegatronIterations(args, splits, resume)
    return PlannedIterations(args, splits, spec, resume)
