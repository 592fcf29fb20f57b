"""Validation and test loss, as Megatron's `--eval-interval` / `--eval-iters` define them.

Every `--eval-interval` iterations (and once after training) the model runs `--eval-iters`
global batches of a held-out split, continuing through that split from one evaluation to the
next as Megatron's validation iterator does. The batches are planned like training batches, by
the planning rank, and each rank runs its plan forward only (`PlanExecutor.run(...,
forward_only=True)`: no autograd, no backward passes or gradient transfers), with dropout off.
The loss is the per-token loss over all evaluated tokens, printed in Megatron's validation
line with its perplexity. (In Megatron's loop, evaluation is Megatron's own.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_planner.service import PlannerRecipe

from . import parallel_state as ps
from .data.microbatches import rank_microbatches
from .data.variable_length import VariableLengthDataset
from .pipeline.executor import IterationResult, PlanExecutor
from .pipeline.plan_distribution import PlanChannel
from .pipeline.plan_source import PLANNING_RANK


class Evaluator:
    """Evaluates one held-out split (`name`: "validation" or "test") on every rank.

    `recipe` builds the planner on the planning rank (None elsewhere); `training` is the job's
    plan channel, whose store and secret evaluation plans share under their own keys; `runner`
    runs plans (`PlanExecutor`, or `MegatronPackingBaseline`).
    """

    def __init__(
        self,
        name: str,
        dataset: VariableLengthDataset,
        sampler,
        recipe: PlannerRecipe | None,
        training: PlanChannel,
        runner: PlanExecutor,
        *,
        iterations: int,
        timeout_s: float,
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.name, self.dataset, self.sampler, self.iterations = name, dataset, sampler, iterations
        self.runner = runner
        self._planner = recipe.build() if recipe is not None else None
        self._channel = PlanChannel(
            training.store,
            rank,
            world,
            secret=training.secret,
            publisher_rank=PLANNING_RANK,
            timeout_s=timeout_s,
            prefix=f"dynapipe/{name}-plan",
        )
        self._planned = 0  # plans published so far: the keys of this split's channel

    def evaluate(self, model: torch.nn.Module) -> float:
        """The per-token loss of the next `iterations` batches of the split."""

        def batches() -> Iterator[IterationResult]:
            for _ in range(self.iterations):
                _, batch = next(self.sampler)
                plan = self._plan(batch)
                rows = rank_microbatches(plan, ps.replica(), self.dataset)
                yield self.runner.run(plan, rows, iteration=self._planned, forward_only=True)

        return _loss(model, batches())

    def _plan(self, batch: np.ndarray):
        key = self._planned
        self._planned += 1
        if self._planner is not None:
            lengths = self.dataset.lengths()[batch]
            self._channel.publish(key, self._planner.plan(lengths, batch))
        return self._channel.fetch(key)


def _loss(model: torch.nn.Module, results: Iterator[IterationResult]) -> float:
    """Per-token loss over `results` of every rank, run with the model in evaluation mode."""
    loss_sum, tokens = 0.0, 0
    model.eval()
    try:
        for result in results:
            loss_sum += result.loss_sum
            tokens += result.num_tokens
    finally:
        model.train()
    totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=ps.device())
    dist.all_reduce(totals)
    return float(totals[0]) / max(float(totals[1]), 1.0)  # TP shards repeat both alike


def validation_line(name: str, where: str, loss: float) -> str:
    """Megatron's validation report: the loss and its perplexity (capped where exp overflows),
    framed by dashes."""
    ppl = math.exp(min(20.0, loss))
    text = f" {name} loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * len(text)
    return f"{rule}\n{text}\n{rule}"
