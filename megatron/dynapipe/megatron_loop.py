"""DynaPipe inside megatron.training's own training loop: `import megatron.dynapipe.enable`.

A Megatron-LM program keeps `megatron.training.pretrain(...)` with its model provider,
`forward_step` and dataset provider (`pretrain_gpt.py` is one). `megatron_hooks` replaces the
start of `pretrain` (`megatron_startup`: parser, tokenizer, CPU initialisation, data loaders,
error endings, pre-checks, DynaPipe's own loop for the jobs Megatron's cannot run) and these
functions of its loop with this module's (group DYNAPIPE):

- the schedule `train()` takes from `get_forward_backward_func()`: when DynaPipe plans (a
  batching flag, `JobConfig.plans`), `DynaPipeSchedule`. Each call takes the next
  global batch of the training dataset the program's provider returned (`data.program_samples`:
  its samples in their order, each as long as the dataset says; `pretrain_gpt.py`'s own datasets
  in DynaPipe's seeded order), gets its plan (planned ahead by rank 0's workers, seed
  `dynapipe.txt` §3, §6), and runs this rank's instruction list with the program's
  `forward_step` (`PlanExecutor`); each planned micro-batch (padded or packed rows) reaches
  `forward_step` as the dict Megatron's data iterator yields under
  `--dataloader-inter-document-masking`, which DynaPipe turns on
  (`arguments.megatron_settings`): its `get_batch` turns `cu_seqlens`/`max_seqlen` into
  `PackedSeqParams`, so every sample attends only within itself. The reports `forward_step`'s
  loss function returns go back to Megatron's `train_step`, which reduces, logs and checkpoints
  as always. Parallel state is Megatron's (`adopt_megatron_groups`). Evaluation (`forward_only`)
  keeps Megatron's schedule on the program's validation data;
- its `train_step` (`train_step`), guarded by DynaPipe's heartbeats (a failed step
  names the ranks that stopped answering, `pipeline.liveness`), timed whole (its memory traced
  on the last iteration with `--log-peak-memory`) and followed, on the last rank where Megatron
  prints, by DynaPipe's iteration line (`log.iteration_line`: per-iteration loss, real
  tokens/s, padding efficiency, predicted and measured time), which Megatron's own line lacks
  and the benchmarks parse, also for `--baseline megatron-1f1b` (Megatron's own schedule);
  Megatron's consumed-samples count then moves by the planned batch's samples;
- its `train` (`train`): its collectives outside `train_step` fail naming the ranks that
  stopped answering too;
- its `training_log` (`training_log`): Megatron's `global batch size` field (and its
  `batch-size` TensorBoard scalar) is the planned batch's samples, and its FLOPs accounting
  (`--log-throughput`'s TFLOP/s, the FLOPs a checkpoint keeps) counts the planned batch's real
  tokens and per-sample attention (`_count_planned_tokens`), not `--micro-batch-size` x
  `--seq-length` per micro-batch;
- megatron-core's `get_batch_on_this_tp_rank` (`get_batch_on_this_tp_rank`): Megatron-LM's
  `get_batch` reads the iterator on tensor-parallel rank 0 and broadcasts to the others into
  buffers of `--micro-batch-size` x `--seq-length`. DynaPipe's micro-batches have their own
  shape, so under DynaPipe rank 0 first broadcasts the shape it holds and the others receive
  into buffers of that shape. The program must import `megatron.dynapipe.enable` before it
  imports `get_batch_on_this_tp_rank` (the patched name is the module's).

A resumed run continues the sampler after as many global batches as the checkpoint trained.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_planner.errors import iteration_name
from dynapipe_planner.megatron_model import spec_from_args
from dynapipe_planner.online_fit import IterationTimeFit

from . import arguments, cpu_compat, megatron_hooks
from . import parallel_state as ps
from .checkpointing import ResumePoint, TrainState
from .data.base import SampleDataset
from .data.datasets import DataSplits
from .data.megatron_samples import DocumentSamples
from .data.program_samples import program_samples
from .iterations import Iteration, PlannedIterations
from .job_config import JobConfig
from .log import iteration_line, iteration_scalars, peak_memory_field
from .megatron_startup import provided_training_dataset
from .memory import every_rank, traced_peak
from .packed_attention import use_packed_attention
from .pipeline.liveness import Liveness, PeerFailure
from .pipeline.plan_source import PLANNING_RANK


class DynaPipeSchedule:
    """Stands where megatron-core's `forward_backward_func` stood in megatron.training's
    `train_step`: same call, same return value (the last stage's loss reports)."""

    def __init__(self, megatron_schedule: Any) -> None:
        self.megatron_schedule = megatron_schedule
        self.iterations: PlannedIterations | None = None
        self.liveness: Liveness | None = None  # heartbeats in the plan store, once it exists
        self.last: Iteration | None = None  # the latest iteration's plan and stats
        self.last_index = -1  # Megatron's `curr_iteration` that `last` was planned for

    def guarded(self, iteration: int) -> contextlib.AbstractContextManager[object]:
        """Megatron's training step of `iteration` (0-based): a failure inside names the
        ranks that stopped answering (`pipeline.liveness`). The first step builds the plan
        store the heartbeats travel in, so it is not guarded."""
        return contextlib.nullcontext() if self.liveness is None else self.liveness.step(iteration)

    def __call__(
        self,
        *,
        forward_step_func: Any,
        data_iterator: Any,
        model: list[torch.nn.Module],
        forward_only: bool = False,
        **kwargs: Any,
    ) -> list[dict[str, torch.Tensor]]:
        from megatron.training import get_args

        if forward_only:
            if get_args().dataloader_inter_document_masking:
                kwargs = thd_shape(kwargs)
            return self.megatron_schedule(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                forward_only=True,
                **kwargs,
            )

        args = get_args()
        if self.iterations is None:
            self.iterations = self._start(args, model, forward_step_func)
        # Megatron's rerun state machine (`--rerun-mode validate_results`, its default) runs a
        # step again when it met a NaN or Inf, to tell a transient fault from a reproducible
        # one: the same iteration then runs the same plan on the same samples.
        if self.last is None or self.last_index != args.curr_iteration:
            self.last = self.iterations.next(args.curr_iteration)
            self.last_index = args.curr_iteration
        reports = self.last.run().reports
        lengths = self.iterations.dataset.lengths()
        _count_planned_tokens(self.last.plan, ps.replica(), lengths, ps.device())
        return reports

    def count_samples(self, args: Any) -> None:
        """Make Megatron's `consumed_train_samples` (its log line, its checkpoints) count the
        planned global batch's samples: after `train_step` Megatron adds data-parallel size x
        `--micro-batch-size` x its micro-batch count, which under DynaPipe say nothing."""
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        if self.last is None:
            return
        megatron_counts = (
            mpu.get_data_parallel_world_size()
            * args.micro_batch_size
            * args.gtp_weight_remat_size
            * get_num_microbatches()
        )
        args.consumed_train_samples += self.last.samples - megatron_counts

    def _start(
        self, args: Any, model: list[torch.nn.Module], forward_step_func: Any
    ) -> PlannedIterations:
        """Adopt Megatron's groups, open DynaPipe's data and planner, bind the executor."""
        from megatron.core.utils import get_model_config

        if len(model) != 1:
            raise ValueError("DynaPipe's schedules do not run virtual pipeline stages")
        ps.adopt_megatron_groups()
        use_packed_attention(model[0])
        train, shuffle = _training_samples(args)
        spec = spec_from_args(args, args.padded_vocab_size)
        check_layer_split(model[0], args)
        resume = None
        if args.iteration > 0:  # Megatron loaded a checkpoint: continue its data order
            resume = ResumePoint(Path(args.load or "."), TrainState(args.iteration), None)
        splits = DataSplits(train, None, None)
        iterations = PlannedIterations(args, JobConfig.of(args), splits, spec, resume, shuffle)
        iterations.__enter__()
        atexit.register(iterations.__exit__, None, None, None)
        self.liveness = Liveness(
            iterations.store, dist.get_rank(), dist.get_world_size(), server_rank=PLANNING_RANK
        )
        self.liveness.start()
        atexit.register(self.liveness.stop)
        if not args.exit_signal_handler:  # Megatron's own handler saves and exits instead
            _name_what_stopped_us(self.liveness, args)
        iterations.bind(model[0], get_model_config(model[0]), ps.device(), forward_step_func)
        return iterations


def _name_what_stopped_us(liveness: Liveness, args: Any) -> None:
    """When one rank dies, torchrun stops the others with SIGTERM, whose default ends them
    without a word. Under DynaPipe a rank so stopped ends as a failed step does: one line
    naming it, the iteration and the ranks that stopped answering (exit status 1); one whose
    failed step is being diagnosed already lets that report end it. A second SIGTERM ends it
    at once."""

    def stopped(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if liveness.diagnosing:
            return
        raise PeerFailure(
            f"rank {liveness.rank}, {iteration_name(args.curr_iteration)}: stopped by its "
            f"launcher (SIGTERM, sent when another rank ends); {liveness.diagnose()}"
        )

    signal.signal(signal.SIGTERM, stopped)


def _training_samples(args: Any) -> tuple[SampleDataset, bool]:
    """What DynaPipe plans over, and whether in seeded shuffled epochs: the training dataset
    the program's provider returned (in its own order), or, from `pretrain_gpt.py`'s provider,
    DynaPipe's own variable-length samples (`data.megatron_samples.DocumentSamples`)."""
    from megatron.core import parallel_state as mpu

    provided = provided_training_dataset()
    if isinstance(provided, DocumentSamples):
        return provided.samples, True
    reads = mpu.get_tensor_model_parallel_rank() == 0
    return program_samples(provided, args, ps.device(), reads), False


def _count_planned_tokens(
    plan: Any, replica: int, lengths: np.ndarray, device: torch.device
) -> None:
    """Megatron's FLOPs accounting of the iteration (`update_seqlen_stats_from_cu_seqlens`,
    read by its `train` after the step) holds pipeline `replica`'s planned samples: their real
    tokens and each sample's attention (L^2). What the program's `forward_step` counted is
    dropped first: its `cu_seqlens` count each row's padding as a sequence. Every rank of a
    pipeline counts the same samples, as Megatron's accounting expects."""
    from megatron.training import training

    training.consume_seqlen_stats_in_iteration()
    samples = [s for mb in plan.microbatches if mb.replica == replica for s in mb.samples]
    bounds = np.concatenate([[0], np.cumsum(lengths[samples], dtype=np.int64)])
    training.update_seqlen_stats_from_cu_seqlens(torch.from_numpy(bounds).to(device))


def thd_shape(schedule_kwargs: dict[str, Any]) -> dict[str, Any]:
    """megatron-core's schedule sends [seq_length, micro_batch_size, hidden] between stages;
    under `--dataloader-inter-document-masking` a Megatron-LM program's `get_batch` flattens a
    micro-batch's rows into one THD sequence, whose activations are [rows x seq_length, 1,
    hidden]: the evaluation schedule is told that shape (same size, the layout the stages
    compute in)."""
    rows = schedule_kwargs.get("micro_batch_size", 1)
    seq_length = schedule_kwargs["seq_length"] * rows
    return {**schedule_kwargs, "seq_length": seq_length, "micro_batch_size": 1}


def _log_step(
    args: Any,
    work: Iteration,
    losses: dict[str, Any],
    measured_s: float,
    peaks: list[int] | None = None,
    fit: IterationTimeFit | None = None,
) -> None:
    """DynaPipe's iteration line for the step Megatron's `train_step` just ran (`work`, taking
    `measured_s`), printed where Megatron prints its own: by the last rank, which holds the
    step's loss per token (`losses`, Megatron's reduced reports), and also holds Megatron's
    TensorBoard and W&B writers, which get the line's metrics (`log.iteration_scalars`) every
    `--tensorboard-log-interval`. Tokens are the real tokens of the whole global batch;
    `peaks`: every rank's traced peak memory (`--log-peak-memory`); `fit`: the job's online fit
    of iteration times (`online_fit`)."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    if dist.get_rank() != dist.get_world_size() - 1:
        return
    iteration = args.curr_iteration + 1
    tokens = int(work.stats["tokens"])
    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    if (writer or wandb_writer) and iteration % args.tensorboard_log_interval == 0:
        scalars = iteration_scalars(work, tokens, measured_s)
        if writer:
            for name, value in scalars.items():
                writer.add_scalar(name, value, iteration)
        if wandb_writer:
            wandb_writer.log(scalars, iteration)
    loss = losses.get("lm loss", next(iter(losses.values()), None))
    due = iteration % args.log_interval == 0 or iteration == args.train_iters
    if not due or loss is None:  # a step Megatron's rerun machinery cut short reports no loss
        return
    line = iteration_line(
        iteration, args.train_iters, work, float(loss), tokens, measured_s, fit=fit
    )
    if peaks is not None:
        line += peak_memory_field(peaks)
    print(line, file=sys.stdout, flush=True)


def _megatron_step(args: Any) -> Iteration:
    """The step megatron-core's own schedule ran (`--baseline megatron-1f1b`), as the line
    describes it: `--global-batch-size` windows of `--seq-length` tokens, every one real."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    stats = {
        "tokens": args.global_batch_size * args.seq_length,
        "padding_efficiency": 1.0,
        "num_microbatches": get_num_microbatches() * args.data_parallel_size,
        "recompute": args.recompute_granularity or "none",
    }
    return Iteration(lambda: None, stats, args.global_batch_size)  # already run by Megatron


def check_layer_split(model: torch.nn.Module, args: Any) -> None:
    """The planner prices stage j with `split_layers`' count; the program's model must hold
    as many layers (Megatron's even split does when the stages divide the layers)."""
    from megatron.core.utils import get_attr_wrapped_model

    from dynapipe_planner.cost.table import split_layers

    expected = split_layers(args.num_layers, args.pipeline_model_parallel_size)[ps.stage()]
    held = len(get_attr_wrapped_model(model, "decoder").layers)
    mismatch = torch.tensor([int(held != expected)], device=ps.device())
    dist.all_reduce(mismatch)  # every rank stops, not only the one that noticed
    if int(mismatch):
        counts = split_layers(args.num_layers, args.pipeline_model_parallel_size)
        raise arguments.ArgumentError(
            f"the model's pipeline stages hold other layer counts than DynaPipe's plans price "
            f"({counts}); pass --decoder-first-pipeline-num-layers {counts[0]} "
            f"--decoder-last-pipeline-num-layers {counts[-1]}"
        )


def get_batch_on_this_tp_rank(*args: Any, **kwargs: Any) -> Any:
    """megatron-core's `get_batch_on_this_tp_rank` that, under DynaPipe, first broadcasts
    the planned micro-batch's `[rows, tokens per row]` from tensor-parallel rank 0 (whichever
    of tokens and labels that stage holds) and receives into buffers of that shape."""
    from megatron.training import get_args

    broadcast_batch = megatron_hooks.original("megatron.core.utils.get_batch_on_this_tp_rank")
    if not JobConfig.of(get_args()).plans:
        return broadcast_batch(*args, **kwargs)
    call = inspect.signature(broadcast_batch).bind(*args, **kwargs)
    given = call.arguments
    shape = torch.zeros(2, dtype=torch.int64, device=ps.device())
    if given["tp_rank"] == 0:
        batch = given["batch"]
        held = batch.get("tokens") if batch.get("tokens") is not None else batch["labels"]
        shape.copy_(torch.tensor(held.shape, dtype=torch.int64))
    dist.broadcast(shape, given["broadcast_src_rank"], group=given["broadcast_group"])
    given["micro_batch_size"], given["seq_length"] = (int(n) for n in shape)
    return broadcast_batch(*call.args, **call.kwargs)


# The schedule `get_forward_backward_func` gives when DynaPipe plans, once it was asked for.
_SCHEDULE: dict[str, DynaPipeSchedule] = {}


def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's `get_forward_backward_func`: when DynaPipe plans, DynaPipe's
    schedule (one per process) in place of megatron-core's."""
    from megatron.training import get_args

    megatron_schedule_for = megatron_hooks.original(
        "megatron.training.training.get_forward_backward_func"
    )
    megatron_schedule = megatron_schedule_for(*args, **kwargs)
    if not JobConfig.of(get_args()).plans:
        return megatron_schedule
    if "dynapipe" not in _SCHEDULE:
        _SCHEDULE["dynapipe"] = DynaPipeSchedule(megatron_schedule)
    return _SCHEDULE["dynapipe"]


def train(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's `train` loop, whose collectives outside `train_step` (its FLOPs
    accounting, logging reductions) also fail naming the ranks that stopped answering, as a
    planned step does (`pipeline.liveness`)."""
    from megatron.training import get_args

    megatron_train = megatron_hooks.original("megatron.training.training.train")
    try:
        return megatron_train(*args, **kwargs)
    except RuntimeError:
        dynapipe = _SCHEDULE.get("dynapipe")
        if dynapipe is None:
            raise
        with dynapipe.guarded(get_args().curr_iteration):
            raise


def training_log(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's `training_log` with, after a planned step, the planned batch's
    samples as its global batch size: it multiplies `--micro-batch-size`, the data-parallel
    size and its micro-batch count, which under DynaPipe say nothing, so for this call they
    are 1, 1 and the planned samples."""
    from megatron.training import get_args

    megatron_training_log = megatron_hooks.original("megatron.training.training.training_log")
    dynapipe = _SCHEDULE.get("dynapipe")
    if dynapipe is None or dynapipe.last is None:
        return megatron_training_log(*args, **kwargs)
    job, samples = get_args(), dynapipe.last.samples
    names = ("micro_batch_size", "data_parallel_size", "gtp_weight_remat_size")
    saved = [getattr(job, name) for name in names]
    for name in names:
        setattr(job, name, 1)
    try:
        with megatron_hooks.swapped(
            "megatron.training.training", "get_num_microbatches", lambda: samples
        ):
            return megatron_training_log(*args, **kwargs)
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(job, name, value)


def train_step(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's `train_step`, timed whole (zeroing, the planned passes, gradient
    sync, optimiser step) and followed by DynaPipe's iteration line when DynaPipe ran it, or
    when the job is `--baseline megatron-1f1b` (measured against DynaPipe's line by line). On
    CPU ranks a resumed run's dropout stream is set first (`cpu_compat.resume_dropout_stream`)."""
    from megatron.training import get_args

    megatron_train_step = megatron_hooks.original("megatron.training.training.train_step")
    job = get_args()
    dynapipe = _SCHEDULE.get("dynapipe")
    job_config = JobConfig.of(job)
    traced = job_config.log_peak_memory and job.curr_iteration == job.train_iters - 1
    started = time.perf_counter()
    with (
        dynapipe.guarded(job.curr_iteration) if dynapipe else contextlib.nullcontext(),
        traced_peak(ps.device()) if traced else contextlib.nullcontext() as peak,
    ):
        cpu_compat.resume_dropout_stream()
        result = megatron_train_step(*args, **kwargs)
    measured_s = time.perf_counter() - started
    peaks = every_rank(peak.peak) if traced else None
    if dynapipe is not None and dynapipe.last is not None:
        dynapipe.iterations.measured(dynapipe.last, measured_s)
        _log_step(job, dynapipe.last, result[0], measured_s, peaks, dynapipe.iterations.fit)
        dynapipe.count_samples(job)
    elif job_config.baseline == "megatron-1f1b":
        _log_step(job, _megatron_step(job), result[0], measured_s, peaks)
    return result
