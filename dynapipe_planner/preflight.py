"""Whether a dataset can be trained at all, decided before the first iteration.

The micro-batching DP refuses a batch whose sample fits in no micro-batch under the memory
limit at any recomputation mode (seed `dynapipe.txt` §4, the memory constraint of the DP; §5,
memory-aware scheduling). Every sample's length is known before training, so the longest one
is tried up front in the batch that stresses it most: as many copies of it as one global
batch can hold, enough to fill every pipeline's in-flight window. A job whose longest sample
cannot be planned then stops at start with the planner's reason, instead of at the iteration
that first draws that sample.
"""

from __future__ import annotations

import numpy as np

from .data.batching import sample_tokens
from .errors import PlanningError
from .planner import IterationPlanner

# Copies of the longest sample tried, per pipeline stage and replica: each stage's in-flight
# window holds at most as many micro-batches as there are stages after it, so this fills every
# window and leaves the batch small enough to plan in milliseconds.
_COPIES_PER_STAGE = 2


def batch_capacity(lengths: np.ndarray, token_budget: int | None, samples_per_batch: int) -> int:
    """How many copies of the longest sample one global batch holds: a token budget over its
    tokens, or the samples of a batch."""
    if token_budget is None:
        return samples_per_batch
    return token_budget // int(sample_tokens(np.asarray(lengths)).max())


def longest_sample_refusal(
    planner: IterationPlanner, lengths: np.ndarray, batch_capacity: int, name: str = "dataset"
) -> str | None:
    """Why the longest sample of `lengths` (per sample, or (N, 2) input and target lengths)
    cannot be planned, or None when it can. `batch_capacity`: how many copies of it one global
    batch may hold (a token budget over its length, or the samples per batch)."""
    lengths = np.asarray(lengths)
    longest = int(np.argmax(sample_tokens(lengths)))
    window = _COPIES_PER_STAGE * planner.num_stages * planner.config.num_replicas
    copies = max(1, min(batch_capacity, window))
    probe = np.repeat(lengths[longest : longest + 1], copies, axis=0)
    try:
        planner.plan(probe, sample_ids=np.full(copies, longest))
    except PlanningError as error:
        shape = lengths[longest].tolist()
        return (
            f"{name}: before training, a global batch of {copies} copies of its longest "
            f"sample, {longest} (length {shape}), cannot be planned: {error}"
        )
    return None
