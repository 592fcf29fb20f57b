"""The packing baseline DynaPipe is measured against, inside the same program: megatron-core's
own pipeline schedule over packed rows (seed `dynapipe.txt` §2.2 "packing", §8 baselines).

Measuring DynaPipe against a separate program would compare two code bases; here both share
the model, DDP, optimiser, data and loss, and differ only in what makes an iteration's forward
and backward passes. `--baseline packing-1f1b` (`MegatronPackingBaseline`) runs
`--micro-batch-size` rows of exactly `--seq-length` tokens per micro-batch through
`get_forward_backward_func()` (1F1B when PP > 1), fixed shapes as megatron-core's schedule sends
them (`variable_seq_lengths` off, as in Megatron-LM), with DDP's gradient reduction deferred to
the last micro-batch and Megatron's per-token loss normalised by the global batch's real tokens
in `finalize_model_grads` (`calculate_per_token_loss`), as in `PlanExecutor`. The rows are the
planner's packing baseline (first-fit-decreasing,
`dynapipe_planner.microbatch.baselines.packing_groups`), read from the plan's micro-batch list,
each micro-batch one THD sequence of its rows with per-sample boundaries and position ids
(`data.microbatches`), attention computed per sample (the cost a variable-length kernel has); a
global batch's last micro-batch is topped up with rows of padding (computed like any row; the
logged padding efficiency, real tokens / (packed rows x seq-length), leaves them out); the
plan's schedule and communication are ignored, megatron-core's schedule decides both;
activations are recomputed as the plan's `stats["recompute"]` says. For the same samples it
computes the same gradients as `PlanExecutor`. (`--baseline megatron-1f1b` is Megatron's own
loop, without DynaPipe.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from dynapipe_planner.errors import iteration_name
from dynapipe_planner.plan import ExecutionPlan

from .. import parallel_state as ps
from ..data.microbatches import MicroBatchTensors, with_empty_rows
from .executor import IterationResult, PlanRejected, gpt_forward_step
from .recompute import apply_recompute


class MegatronPackingBaseline:
    """Runs a packing plan's micro-batches on this rank through megatron-core's schedule.

    A drop-in for `PlanExecutor` in the training loop: same `run(plan, batches)` and result.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TransformerConfig,
        *,
        seq_length: int,
        micro_batch_size: int,
        pad_id: int,
    ) -> None:
        self.model, self.config = model, config
        self.row_length, self.rows = seq_length, micro_batch_size
        self.pad_id = pad_id
        # What Megatron-LM's training sets up for its schedule: fixed tensor shapes, and DDP's
        # gradient reduction deferred to the last micro-batch.
        config.variable_seq_lengths = False
        config.no_sync_func = getattr(model, "no_sync", None)
        self._forward_backward = get_forward_backward_func()

    def run(
        self,
        plan: ExecutionPlan,
        batches: Mapping[int, MicroBatchTensors],
        *,
        iteration: int = 0,
        forward_only: bool = False,
    ) -> IterationResult:
        """Forward and backward of this replica's micro-batches of `plan`, in plan order, then
        `finalize_model_grads`; the optimiser step is the caller's. `forward_only`: the
        schedule's evaluation mode (forward passes only, no gradients)."""
        ordered = []
        for mb in plan.microbatches:
            if mb.replica != ps.replica():
                continue
            if mb.seqlen != self.row_length or mb.num_rows > self.rows or not mb.row_sizes:
                raise PlanRejected(
                    f"{iteration_name(iteration)}: micro-batch {mb.id} has {mb.num_rows} rows of "
                    f"{mb.seqlen} tokens; megatron-core's schedule runs at most "
                    f"{self.rows} packed rows of {self.row_length} (use --batching packing)"
                )
            batch = batches[mb.id]
            ordered.append(with_empty_rows(batch, self.rows, self.row_length, self.pad_id))
        if "recompute" in plan.stats and not forward_only:
            apply_recompute(self.model, self.config, plan.stats["recompute"])
        return self._schedule(ordered, forward_only)

    def _schedule(
        self, microbatches: Sequence[MicroBatchTensors], forward_only: bool
    ) -> IterationResult:
        # Each micro-batch runs as one THD sequence of its rows laid end to end (how Megatron-LM
        # runs packed sequences), so megatron-core's schedule sends [rows x seq-length, 1, h].
        reports = self._forward_backward(
            forward_step_func=gpt_forward_step,
            data_iterator=iter(microbatches),
            model=[self.model],
            num_microbatches=len(microbatches),
            seq_length=self.row_length * self.rows,
            micro_batch_size=1,
            forward_only=forward_only,
        )
        # Last stage only: one (loss sum, real tokens) report per micro-batch.
        zero = torch.zeros(2, dtype=torch.float64)
        totals = sum((r["lm loss"].double().cpu() for r in reports), zero)
        return IterationResult(reports, round(float(totals[1])), float(totals[0]))
