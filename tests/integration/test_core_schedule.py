"""Issue 33 item 5: a training loop on megatron-core alone takes DynaPipe's schedule
(`megatron.dynapipe.core_schedule`) in place of `get_forward_backward_func()`.

`examples/mcore_train_loop.py` (the upstream example's shape, its changed lines marked) trains
on 2 CPU ranks with PP=2: each iteration is the next run of its dataset's samples, in order, up
to the token budget, and the loss per token falls.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from paths import ROOT

pytest.importorskip("megatron.core")

from distributed import run_ranks

EXAMPLE = ROOT / "examples" / "mcore_train_loop.py"


def _example(rank: int, world: int) -> tuple[list[float], list[list[int]], np.ndarray]:
    """The example's `main` on a forked rank; its losses, each global batch's samples and its
    dataset's lengths."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    sys.argv = ["mcore_train_loop.py", "--dynapipe-cost-model", "analytic"]
    spec = importlib.util.spec_from_file_location("mcore_train_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    from megatron.dynapipe.iterations import PlannedIterations

    batches: list[list[int]] = []
    planned_next = PlannedIterations.next

    def next_iteration(self, iteration):
        work = planned_next(self, iteration)
        batches.append(sorted(s for mb in work.plan.microbatches for s in mb.samples))
        return work

    PlannedIterations.next = next_iteration
    losses = example.main()
    return losses, batches, example.CountingDocuments(2000).lengths


def test_a_megatron_core_loop_trains_with_dynapipes_plans() -> None:
    (_, batches, lengths), (losses, _, _) = run_ranks(_example, 2, timeout_s=240)
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    start = 0
    for batch in batches:  # consecutive samples, as many as fit 2,048 tokens
        assert batch == list(range(start, start + len(batch))), batch
        end = start + len(batch)
        assert lengths[start:end].sum() <= 2048 < lengths[start : end + 1].sum()
        start = end
