"""The systems Hydraulis is measured against (seed hydraulis.txt §8.1), and the steps of its
ablation (§8.4, Fig. 13), priced with the same cost models and planner core so a comparison
isolates the strategy and assignment choices.

- Megatron-LM style (`megatron_iteration`): one homogeneous strategy sized for the context
  length; sequences packed into rows of the context length (first-fit decreasing), the rows
  split evenly over the pipelines, one row per micro-batch, 1F1B.
- dp_balanced, re-implemented (`megatron_dp_balanced_iteration`): the packing scheduler upstream
  Megatron-LM ships under that name (`DpBalancedScheduler`), re-implemented from issue #21's
  description, not upstream's code: sequences packed in arrival order (no sorting) up to the
  context length, packs split until their number is a multiple of the data-parallel size,
  packs dealt round-robin to the pipelines; no cost model. The split step differs: upstream
  moves the last sequences of the last packs into packs of their own, ours halves the fullest
  pack (`split_to_multiple`). `shares_of` takes upstream's own split instead
  (`benchmarks/hydraulis_quality.py --megatron-lm`).
- Cost-aware DP-balanced (`cost_balanced_iteration`, our own baseline, no system ships it):
  Megatron-style's rows given to the pipelines longest-processing-time first by their
  attention-aware cost (sum of T(l) of their sequences), so pipelines get different numbers of
  micro-batches. It knows the cost model dp_balanced lacks, yet prices a pipeline by its
  sequences alone, not its rows' schedule, so it does not always beat dp_balanced.
- HotSPa style (`hotspa_iteration`): a few homogeneous strategies for increasing length ranges;
  each range's sequences run on all GPUs under its strategy in turn, with a hot switch
  (re-sharding the bf16 weights) between strategies.
- Hydraulis's own steps (`dispatched_iteration`): any strategy with the greedy dispatch, and
  packing either to MaxLen (first-fit decreasing) or by Eq. 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..microbatch.baselines import Group, first_fit_decreasing
from .dispatch import dispatch
from .packing import Packing, pack_pipeline
from .proposal import Strategy
from .schemes import ParallelScheme, SchemeProfile
from .selection import PipelinePlanners, packed_groups


@dataclass(frozen=True)
class IterationLatency:
    """One iteration's propagation time and how long each GPU of the job was busy in it."""

    latency: float
    gpu_busy: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """(busiest - idlest GPU) / busiest: 0 when every GPU works until the end."""
        return (max(self.gpu_busy) - min(self.gpu_busy)) / max(self.gpu_busy)


def per_gpu(
    latencies: Sequence[float], schemes: Sequence[ParallelScheme], num_gpus: int
) -> np.ndarray:
    """Each pipeline's latency on each of its GPUs, GPUs given out in pipeline order; GPUs no
    pipeline uses stay at 0."""
    busy = np.zeros(num_gpus)
    spread = np.repeat(latencies, [s.num_gpus for s in schemes])
    busy[: len(spread)] = spread
    return busy


def fixed_rows(lengths: np.ndarray, row_len: int) -> list[list[int]]:
    """Sequences (truncated to `row_len`) packed first-fit decreasing into rows of `row_len`."""
    return first_fit_decreasing(np.minimum(lengths, row_len), row_len)


def rows_latency(
    lengths: np.ndarray, rows: Sequence[Sequence[int]], row_len: int, planner
) -> float:
    """1F1B over fixed-length packed rows (one row per micro-batch, attention inside samples)."""
    if not rows:
        return 0.0
    members = [i for row in rows for i in row]
    local = {i: k for k, i in enumerate(members)}
    own = lengths[members]
    groups = []
    for row in rows:
        idx = [local[i] for i in row]
        saved = float(row_len**2 - np.sum(own[idx].astype(np.float64) ** 2))
        groups.append(Group(np.array(idx), row_len, rows=[idx], attention_saved=saved))
    return planner.predict(own, groups)


def arrival_order_packs(lengths: np.ndarray, row_len: int) -> list[list[int]]:
    """Sequences (truncated to `row_len`) in arrival order, each joining the open pack while
    the pack's tokens stay within `row_len` and opening a new pack otherwise (next fit)."""
    packs: list[list[int]] = []
    room = 0
    for i, length in enumerate(np.minimum(lengths, row_len).tolist()):
        if not packs or length > room:
            packs.append([])
            room = row_len
        packs[-1].append(i)
        room -= length
    return packs


def split_to_multiple(
    packs: Sequence[Sequence[int]], lengths: np.ndarray, multiple: int
) -> list[list[int]]:
    """`packs` split in two until their number is a multiple of `multiple`, or no pack holds
    two sequences. The description says only that packs are split; we split the pack with the
    most tokens (the first such among ties) at the sequence boundary nearest half of them (the
    earlier boundary among ties), the two halves taking its place."""
    out = [list(p) for p in packs]
    while len(out) % multiple:
        tokens = [int(lengths[p].sum()) if len(p) > 1 else -1 for p in out]
        k = int(np.argmax(tokens))
        if tokens[k] < 0:
            break
        prefix = np.cumsum(lengths[out[k]])[:-1]
        cut = int(np.argmin(np.abs(2 * prefix - tokens[k]))) + 1
        out[k : k + 1] = [out[k][:cut], out[k][cut:]]
    return out


def megatron_dp_balanced_shares(
    lengths: np.ndarray, row_len: int, num_pipelines: int
) -> list[list[list[int]]]:
    """dp_balanced as re-implemented here: arrival-order packs of `row_len`, split to a
    multiple of `num_pipelines` (`split_to_multiple`), pack k to pipeline k mod
    `num_pipelines`; each pipeline's packs in order."""
    packs = arrival_order_packs(lengths, row_len)
    packs = split_to_multiple(packs, np.minimum(lengths, row_len), num_pipelines)
    return [packs[j::num_pipelines] for j in range(num_pipelines)]


def _pipelines_latency(
    lengths: np.ndarray,
    shares: Sequence[Sequence[Sequence[int]]],
    scheme: ParallelScheme,
    num_gpus: int,
    context: int,
    planners,
) -> IterationLatency:
    """Each pipeline of `scheme` runs its share of rows (1F1B, one row per micro-batch)."""
    planner = planners.of(scheme, "packing")
    per = [rows_latency(lengths, rows, context, planner) for rows in shares]
    return IterationLatency(max(per), tuple(per_gpu(per, [scheme] * len(per), num_gpus).tolist()))


def megatron_iteration(
    lengths: np.ndarray, scheme: ParallelScheme, num_gpus: int, context: int, planners
) -> IterationLatency:
    """Fixed-length packing to `context`, rows dealt out evenly (Megatron-LM's data-parallel
    split of a global batch), 1F1B with one row per micro-batch."""
    rows = fixed_rows(lengths, context)
    count = num_gpus // scheme.num_gpus
    shares = [rows[j::count] for j in range(count)]
    return _pipelines_latency(lengths, shares, scheme, num_gpus, context, planners)


def megatron_dp_balanced_iteration(
    lengths: np.ndarray,
    scheme: ParallelScheme,
    num_gpus: int,
    context: int,
    planners,
    shares_of=megatron_dp_balanced_shares,
) -> IterationLatency:
    """dp_balanced packs, 1F1B per pipeline: `shares_of(lengths, context, num_pipelines)`
    gives each pipeline's packs (default: our re-implementation)."""
    shares = shares_of(lengths, context, num_gpus // scheme.num_gpus)
    return _pipelines_latency(lengths, shares, scheme, num_gpus, context, planners)


def cost_balanced_iteration(
    lengths: np.ndarray, profile: SchemeProfile, num_gpus: int, context: int, planners
) -> IterationLatency:
    """Our cost-aware DP-balanced: Megatron-style's rows, each (costliest first) to the
    pipeline with the least attention-aware work so far."""
    rows = fixed_rows(lengths, context)
    times = profile.time(np.minimum(lengths, context).astype(np.float64))
    cost = [float(times[row].sum()) for row in rows]
    count = num_gpus // profile.scheme.num_gpus
    load, shares = [0.0] * count, [[] for _ in range(count)]
    for r in sorted(range(len(rows)), key=lambda r: (-cost[r], r)):
        j = min(range(count), key=lambda j: (load[j], j))
        load[j] += cost[r]
        shares[j].append(rows[r])
    return _pipelines_latency(lengths, shares, profile.scheme, num_gpus, context, planners)


def hotspa_iteration(
    lengths: np.ndarray,
    stages: Sequence[tuple[int, SchemeProfile]],
    num_gpus: int,
    planners,
    switch_s: float,
) -> IterationLatency:
    """`stages` lists (length cap, scheme) by increasing cap; each sequence runs in the first
    stage whose cap holds it, all GPUs per stage, stages one after another, `switch_s` per
    switch; a GPU's busy time adds up over the stages."""
    caps = np.array([cap for cap, _ in stages])
    which = np.searchsorted(caps, lengths)
    total, busy, used = 0.0, np.zeros(num_gpus), 0
    for k, (cap, profile) in enumerate(stages):
        mine = lengths[which == k]
        if len(mine) == 0:
            continue
        step = megatron_iteration(mine, profile.scheme, num_gpus, cap, planners)
        total += step.latency
        busy += np.array(step.gpu_busy)
        used += 1
    return IterationLatency(total + switch_s * max(used - 1, 0), tuple(busy.tolist()))


def dispatched_iteration(
    lengths: np.ndarray,
    strategy: Strategy,
    profiles: list[SchemeProfile],
    planners: PipelinePlanners,
    *,
    packing: str = "eq1",
    trials: int = 100,
    dispatch_pricing: str = "full",
) -> IterationLatency:
    """Hydraulis's assignment on a fixed strategy: greedy dispatch (App. D.2, its `pricing`
    `dispatch_pricing`), then packing to MaxLen (`packing="max"`, first-fit decreasing) or by
    Eq. 1 (`"eq1"`), 1F1B per pipeline."""
    placed = dispatch(lengths, strategy, profiles, trials=trials, pricing=dispatch_pricing)
    by_scheme = {p.scheme: p for p in profiles}
    per = []
    for j, scheme in enumerate(placed.pipelines):
        own = lengths[placed.assignment == j]
        if len(own) == 0:
            per.append(0.0)
            continue
        profile = by_scheme[scheme]
        if packing == "max":
            bins = first_fit_decreasing(own, profile.max_len)
            chosen = Packing(tuple(tuple(b) for b in bins), 0.0)
        else:
            chosen = pack_pipeline(own, profile)
        per.append(planners.of(scheme, "packing").predict(own, packed_groups(own, chosen)))
    num_gpus = strategy.num_gpus
    return IterationLatency(max(per), tuple(per_gpu(per, placed.pipelines, num_gpus).tolist()))
