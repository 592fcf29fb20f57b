"""Data-distribution-aware strategy proposal: Hydraulis (seed hydraulis.txt) §7.

Before training, the dataset's length distribution proposes the few heterogeneous strategies
S = sum_k d_k x P_k worth evaluating every iteration: for each maximum length L, the strategy
that processes the dataset's sequences of length <= L fastest on N GPUs (Problem 1), rounded to
whole pipelines.

The paper's DP (Eq. 4): t[n][l] is the best latency with n GPUs for the sequences up to length
l, each block of length intervals (l - l', l] going to d pipelines of one scheme P_k with
MaxLen(P_k) >= l, at latency sum_{x in block} T(x, P_k) / d; the slowest block decides.
`proposal_dp` runs it with n and d on a grid: step 0.1, the paper's relaxation, which
`propose_strategies(method="paper_dp")` rounds as the paper does; step 1, whole GPUs and
pipelines (`integer_proposal_dp`, exact; tests hold both to exhaustive enumeration).

Our heuristic (`method="closed_form"`) replaces the DP: the continuous relaxation lets n and
d be fractional, and then its optimum has a closed form, which `relaxed_proposal` computes in
O(L K) instead of the DP's O(K N^2 L^2): with fractional d every
block runs at the same latency T (a faster block could give GPUs to the slowest), so a block of
work W on P_k takes W * N(P_k) / T GPUs, and sum over blocks of N(P_k) * W_block(P_k) = N * T.
That sum is additive over length intervals and a block may always be split into its intervals,
so each interval goes to the feasible scheme with the fewest GPU-seconds, T = (sum of those
GPU-seconds) / N, and scheme k gets d_k = W_k / T pipelines. Rounding each d_k down or up (the
"nearby integer solutions"), keeping a pipeline that holds the longest sequence and filling
the GPUs left over, gives the candidates, which a hill climb then refines (our addition). The
DP's step-0.1 grid only approximates that optimum from above, yet its roundings are better at
a few maximum lengths (by up to 10%), so the default (`method="auto"`) runs both wherever the
DP is tractable and keeps the best candidates of either; `hydraulis_solve_time.py` measures
the methods' candidates against each other.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .. import _core
from ..errors import PlanningError
from .schemes import ParallelScheme, SchemeProfile


@dataclass(frozen=True)
class Strategy:
    """A heterogeneous strategy: `pipelines` lists (scheme, number of pipelines)."""

    pipelines: tuple[tuple[ParallelScheme, int], ...]

    @classmethod
    def of(cls, counts: dict[ParallelScheme, int]) -> Strategy:
        return cls(tuple(sorted((s, d) for s, d in counts.items() if d > 0)))

    @classmethod
    def homogeneous(cls, scheme: ParallelScheme, num_gpus: int) -> Strategy:
        """The one-scheme strategy with as many pipelines as fit on `num_gpus`."""
        return cls.of({scheme: num_gpus // scheme.num_gpus})

    @property
    def num_gpus(self) -> int:
        return sum(s.num_gpus * d for s, d in self.pipelines)

    @property
    def num_pipelines(self) -> int:
        return sum(d for _, d in self.pipelines)

    @property
    def schemes(self) -> list[ParallelScheme]:
        """One scheme per pipeline, in the strategy's own (scheme) order: how plans and the
        runtime's groups lay the pipelines out."""
        return [s for s, d in self.pipelines for _ in range(d)]

    def __str__(self) -> str:
        return " + ".join(f"{d}x{s}" for s, d in sorted(self.pipelines, reverse=True))


@dataclass(frozen=True)
class IntervalWork:
    """The dataset per length interval, priced on each scheme.

    `upper[i]` is interval i's longest length ((i * step, (i + 1) * step]); `work[i, k]` the
    expected seconds per iteration of its sequences on one stage of scheme k (sum of T(x, P_k)
    scaled to `tokens_per_iteration`), inf where the scheme's MaxLen is shorter than upper[i].
    """

    upper: np.ndarray
    work: np.ndarray
    counts: np.ndarray  # sequences per interval
    profiles: tuple[SchemeProfile, ...]

    @cached_property
    def gpus(self) -> np.ndarray:
        return np.array([p.scheme.num_gpus for p in self.profiles], dtype=np.float64)

    @cached_property
    def column(self) -> dict[ParallelScheme, int]:
        """Column of `work` of each scheme."""
        return {p.scheme: k for k, p in enumerate(self.profiles)}

    @cached_property
    def occupied(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Over the intervals that hold sequences: their GPU-seconds per scheme (inf: cannot
        hold), the GPUs of one pipeline of each scheme that can hold each (one extra row of
        zeros: no scheme), and how many of them lie in the first i intervals, for every i;
        what every maximum length's `_EstimateTable` slices instead of rebuilding."""
        rows = np.flatnonzero(self.counts)
        gpu_seconds = self.work[rows] * self.gpus[None, :]
        capacity = np.zeros((len(self.profiles) + 1, len(rows)))
        capacity[:-1] = (np.isfinite(gpu_seconds) * self.gpus[None, :]).T
        within = np.concatenate([[0], np.cumsum(self.counts > 0)])
        return gpu_seconds, capacity, within


def interval_work(
    lengths: np.ndarray,
    profiles: list[SchemeProfile],
    *,
    step: int = 128,
    tokens_per_iteration: float = 0.0,
) -> IntervalWork:
    """Histogram `lengths` into intervals of `step` tokens and price each on every scheme.

    `tokens_per_iteration` scales the dataset to one iteration (0: the whole dataset once).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not profiles:
        raise PlanningError("empty scheme space: no scheme to propose strategies from")
    if lengths.size == 0 or lengths.sum() <= 0:
        raise PlanningError("length histogram holds no tokens: nothing to propose for")
    if (lengths <= 0).any():
        bad = int(np.flatnonzero(lengths <= 0)[0])
        raise PlanningError(f"sample {bad} has non-positive length {lengths[bad]}")
    longest_fit = max(profiles, key=lambda p: p.max_len)
    if lengths.max() > longest_fit.max_len:
        bad = int(np.argmax(lengths))
        raise PlanningError(
            f"sample {bad} (length {lengths[bad]}) is longer than every scheme's MaxLen "
            f"(largest: {longest_fit.scheme} holds {longest_fit.max_len}); truncate the data "
            f"or allow larger TP / PP"
        )
    histogram = np.bincount(lengths)  # T once per distinct length; O(n), no sort
    distinct = np.flatnonzero(histogram)
    multiplicity = histogram[distinct]
    index = (distinct - 1) // step
    num_intervals = int(index.max()) + 1
    upper = (np.arange(num_intervals) + 1) * step
    scale = tokens_per_iteration / lengths.sum() if tokens_per_iteration else 1.0
    work = np.empty((num_intervals, len(profiles)))
    for k, profile in enumerate(profiles):
        per_length = profile.time(distinct.astype(np.float64)) * multiplicity * scale
        work[:, k] = np.bincount(index, weights=per_length, minlength=num_intervals)
        work[upper > profile.max_len, k] = math.inf
    counts = np.bincount(index, weights=multiplicity, minlength=num_intervals).astype(np.int64)
    return IntervalWork(upper, work, counts, tuple(profiles))


@dataclass(frozen=True)
class RelaxedSolution:
    """The continuous relaxation for sequences up to upper[`intervals` - 1]: latency, fractional
    pipelines per scheme, and the scheme each length interval went to."""

    latency: float
    pipelines: np.ndarray
    scheme_of_interval: np.ndarray


def relaxed_proposal(iw: IntervalWork, intervals: int, num_gpus: float) -> RelaxedSolution:
    """Closed-form optimum of Eq. 4 with fractional GPUs and pipelines (module docstring)."""
    gpu_seconds = iw.work[:intervals] * iw.gpus[None, :]
    choice = np.argmin(gpu_seconds, axis=1)  # inf for infeasible schemes; ties: first scheme
    best = gpu_seconds[np.arange(intervals), choice]
    total = float(best.sum())
    pipelines = np.zeros(len(iw.profiles))
    if total == 0.0:
        return RelaxedSolution(0.0, pipelines, choice)
    latency = total / num_gpus
    np.add.at(pipelines, choice, iw.work[np.arange(intervals), choice] / latency)
    return RelaxedSolution(latency, pipelines, choice)


@dataclass(frozen=True)
class Proposal:
    """Candidates for global batches whose longest sequence falls in (max_len - step, max_len],
    best first, with their estimated latency (`estimate_latency`)."""

    max_len: int
    relaxed: RelaxedSolution
    strategies: tuple[Strategy, ...]
    estimates: tuple[float, ...]


PROPOSAL_METHODS = ("auto", "closed_form", "paper_dp")
# `method="auto"` also runs the paper's DP while K (N / step) L^2 (schemes x grid points x
# intervals squared) stays within this: about a minute of one core in the C++ core, once
# before training (1,024 GPUs, 57 schemes, 256 intervals of 128 tokens: 3.8e10, 59 s; 64 GPUs,
# 39 schemes: 1.6e9, 1.3 s; `benchmarks/hydraulis_solve_time.py`). Beyond it the closed form
# alone, whose gap to the DP reached 1.56x at 1,024 GPUs.
PAPER_DP_WORK_LIMIT = 4e10


def paper_dp_tractable(iw: IntervalWork, num_gpus: int, step: float = 0.1) -> bool:
    """Whether `method="auto"` runs the paper's DP on this histogram (`PAPER_DP_WORK_LIMIT`)."""
    num_intervals, num_schemes = iw.work.shape
    return num_schemes * (num_gpus / step) * num_intervals**2 <= PAPER_DP_WORK_LIMIT


def propose_strategies(
    iw: IntervalWork,
    num_gpus: int,
    *,
    keep: int = 3,
    method: str = "auto",
    dp_step: float = 0.1,
) -> list[Proposal]:
    """For every maximum length the histogram holds, the `keep` best rounded strategies (§7).

    `method="closed_form"` (ours): the relaxation's closed form, rounded, then hill-climbed
    (`refine_strategies`). `method="paper_dp"`: the paper's own steps, the DP (Eq. 4) over the
    relaxation in steps of `dp_step` GPUs and pipelines (`proposal_dp`), its S[N][l] rounded to
    the nearby integer strategies (`round_strategy`), no climb. Both rank their candidates by
    `estimate_latency`. `method="auto"` (the default): both where the DP is tractable
    (`paper_dp_tractable`), their candidates merged and ranked, so the best estimate is never
    worse than either method's (the closed form wins at most maximum lengths, the DP at a few,
    by up to 10%: `hydraulis_solve_time.py`); the closed form alone beyond."""
    if method == "auto":
        closed = propose_strategies(iw, num_gpus, keep=keep, method="closed_form")
        if not paper_dp_tractable(iw, num_gpus, dp_step):
            return closed
        paper = propose_strategies(iw, num_gpus, keep=keep, method="paper_dp", dp_step=dp_step)
        return [_merged(a, b, keep) for a, b in zip(closed, paper, strict=True)]
    if method not in PROPOSAL_METHODS:
        raise PlanningError(f"proposal method must be one of {PROPOSAL_METHODS}, got {method!r}")
    dp = proposal_dp(iw, num_gpus, step=dp_step) if method == "paper_dp" else None
    proposals: list[Proposal] = []
    for intervals in np.flatnonzero(iw.counts) + 1:
        if dp is None:
            relaxed = relaxed_proposal(iw, intervals, num_gpus)
        else:
            relaxed = RelaxedSolution(
                float(dp.latency[intervals - 1]),
                dp.pipelines[intervals - 1],
                dp.scheme_of_interval[intervals - 1, :intervals],
            )
        longest = int(iw.upper[intervals - 1])
        strategies = round_strategy(relaxed.pipelines, iw.profiles, num_gpus, longest, 2)
        if not strategies:
            raise PlanningError(
                f"no whole-pipeline strategy on {num_gpus} GPUs holds sequences of {longest} "
                f"tokens; relaxed: {_describe(relaxed.pipelines, iw.profiles)}"
            )
        if dp is not None:
            estimates = estimate_latencies(list(strategies), iw, intervals)
            ranked = sorted(zip(estimates.tolist(), strategies, strict=True), key=lambda x: x[0])
            ranked = ranked[:keep]
        else:
            # The previous length's candidates, already climbed from, are re-priced with the
            # new roundings; a climb starts only where a new rounding beats them all.
            previous = proposals[-1].strategies if proposals else ()
            ranked = refine_strategies(
                list(strategies), iw, intervals, num_gpus, keep=keep, climbs=1, settled=previous
            )
        proposals.append(
            Proposal(longest, relaxed, tuple(s for _, s in ranked), tuple(e for e, _ in ranked))
        )
    return proposals


def _merged(closed: Proposal, paper: Proposal, keep: int) -> Proposal:
    """One maximum length's candidates of both methods, the `keep` best by estimate (the
    closed form's first on ties), with the closed form's relaxation (the exact optimum of the
    fractional problem, which the DP's grid approaches from above)."""
    ranked = sorted(
        zip(
            [*closed.estimates, *paper.estimates],
            [*closed.strategies, *paper.strategies],
            strict=True,
        ),
        key=lambda pair: pair[0],
    )
    best: dict[Strategy, float] = {}
    for estimate, strategy in ranked:
        if len(best) == keep:
            break
        best.setdefault(strategy, estimate)
    return Proposal(closed.max_len, closed.relaxed, tuple(best), tuple(best.values()))


def batch_proposals(
    lengths: np.ndarray,
    profiles: list[SchemeProfile],
    num_gpus: int,
    *,
    starts: list[Strategy] = (),
    keep: int = 10,
    step: int = 128,
) -> list[Strategy]:
    """The proposal redone for one global batch (our extension of §7): the relaxation of
    the batch's own length histogram, rounded and refined (`refine_strategies`, also from
    `starts`), best estimate first. A batch's long tail differs from the dataset's - one
    batch holds two 16K sequences, the next none - so the dataset's candidates leave its
    large pipelines over- or under-loaded; the closed form makes a per-batch proposal cost
    milliseconds, where the paper's DP took minutes and had to run offline."""
    iw = interval_work(lengths, profiles, step=step)
    intervals = len(iw.upper)
    relaxed = relaxed_proposal(iw, intervals, num_gpus)
    rounded = round_strategy(relaxed.pipelines, iw.profiles, num_gpus, int(np.max(lengths)))
    found = refine_strategies([*rounded, *starts], iw, intervals, num_gpus, keep=keep)
    return [strategy for _, strategy in found]


def unique_candidates(proposals: list[Proposal]) -> list[Strategy]:
    """The proposed subset S^ (union over maximum lengths), in order of first appearance."""
    return list(dict.fromkeys(s for p in proposals for s in p.strategies))


def estimate_latency(strategy: Strategy, iw: IntervalWork, intervals: int) -> float:
    """Expected latency of a whole-pipeline strategy on the sequences up to interval
    `intervals`: the relaxation restricted to its pipelines. Intervals from u upwards can only
    run on the schemes that hold interval u (capability is nested in length), so
    T >= (their cheapest GPU-seconds) / (those schemes' GPUs) for every u; the largest such
    bound is the estimate (exact for the unrestricted relaxation at u = 0)."""
    return float(estimate_latencies([strategy], iw, intervals)[0])


def estimate_latencies(strategies: list[Strategy], iw: IntervalWork, intervals: int) -> np.ndarray:
    """`estimate_latency` of several strategies at once (one array pass per maximum length)."""
    table = _EstimateTable(iw, intervals)
    return table.of_counts(np.array([table.counts_of(s) for s in strategies]))


class _EstimateTable:
    """`estimate_latency` over whole-pipeline counts per scheme, for one maximum length.

    `neighbourhood` prices every strategy one move away from a base in O(R) each instead of
    O(R K): a move drops at most one scheme from the base's set and adds at most one, so the
    cheapest holder of each row is the base's minimum without the dropped scheme (kept per
    used scheme) against the added scheme's own, and the capacity changes by two columns."""

    def __init__(self, iw: IntervalWork, intervals: int) -> None:
        self.iw = iw
        gpu_seconds, capacity, within = iw.occupied
        rows = within[intervals]
        self.gpu_seconds = gpu_seconds[:rows]  # (R, K), inf: cannot hold
        self.capacity_of = capacity[:, :rows]  # (K + 1, R); row K: no scheme
        self.none = len(iw.profiles)

    @cached_property
    def own(self) -> np.ndarray:
        """Each scheme's GPU-seconds per row; row K (no scheme added) is inf."""
        return np.vstack([self.gpu_seconds.T, np.full(self.gpu_seconds.shape[0], math.inf)])

    def counts_of(self, strategy: Strategy) -> np.ndarray:
        counts = np.zeros(len(self.iw.profiles), dtype=np.int64)
        for scheme, d in strategy.pipelines:
            counts[self.iw.column[scheme]] = d
        return counts

    def of_counts(self, counts: np.ndarray) -> np.ndarray:
        used = counts > 0
        cheapest = np.where(used[:, None, :], self.gpu_seconds[None, :, :], math.inf).min(axis=2)
        return self._bound(cheapest, counts @ self.capacity_of[:-1])

    def neighbourhood(self, count: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
        """Every strategy within `num_gpus` one move from `count` (one pipeline more, one
        fewer, or one swapped for another scheme) and its estimate."""
        gpus = self.iw.gpus
        used = np.flatnonzero(count)
        spare = num_gpus - float(count @ gpus)
        held = self.gpu_seconds[:, used]
        base = held.min(axis=1) if len(used) else np.full(len(held), math.inf)
        nothing = np.full_like(base, math.inf)
        without = [  # row minimum over the base's schemes but one
            np.delete(held, i, axis=1).min(axis=1) if len(used) > 1 else nothing
            for i in range(len(used))
        ]
        minima = np.vstack([base, *without])  # row 0: the base; row 1 + i: without used[i]
        drop, minus, plus = [], [], []
        for b in np.flatnonzero(gpus <= spare):
            drop.append(0), minus.append(self.none), plus.append(b)
        for i, a in enumerate(used):
            keeps_a = count[a] > 1
            for b in [self.none, *np.flatnonzero(gpus <= spare + gpus[a])]:
                if b == a:
                    continue
                drop.append(0 if keeps_a else 1 + i), minus.append(a), plus.append(b)
        drop, minus, plus = np.array(drop), np.array(minus), np.array(plus)
        counts = np.repeat(count[None, :], len(drop), axis=0)
        rows = np.arange(len(drop))
        counts[rows[minus < self.none], minus[minus < self.none]] -= 1
        counts[rows[plus < self.none], plus[plus < self.none]] += 1
        cheapest = np.minimum(minima[drop], self.own[plus])
        capacity = count @ self.capacity_of[:-1] + self.capacity_of[plus] - self.capacity_of[minus]
        return counts, self._bound(cheapest, capacity)

    @staticmethod
    def _bound(cheapest: np.ndarray, capacity: np.ndarray) -> np.ndarray:
        suffix = np.cumsum(cheapest[:, ::-1], axis=1)[:, ::-1]  # inf once a row has no holder
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = np.where(capacity > 0, suffix / capacity, math.inf)
        return bound.max(axis=1)


def refine_strategies(
    starts: list[Strategy],
    iw: IntervalWork,
    intervals: int,
    num_gpus: int,
    *,
    keep: int = 8,
    climbs: int = 2,
    settled: tuple[Strategy, ...] = (),
) -> list[tuple[float, Strategy]]:
    """The `keep` best strategies by `estimate_latency` met while hill-climbing from the
    `climbs` best starts over their integer neighbours: one more pipeline of any scheme that
    fits the spare GPUs, one pipeline fewer, or one pipeline of a scheme replaced by one of
    another scheme that fits. Rounding alone can strand GPUs that no used scheme fits (29 of
    32 GPUs for 8 + 6 + 6 + 5 + 4-GPU pipelines); a neighbour that swaps schemes puts them to
    work. The estimate is a relaxation, so more than the single best is kept for exact
    pricing. `settled` strategies (local optima of a nearby problem) are priced and kept but
    not climbed from, and no climb starts from a start they beat."""
    table = _EstimateTable(iw, intervals)
    offered = list(dict.fromkeys([*starts, *settled]))
    counts = np.array([table.counts_of(s) for s in offered])
    estimates = table.of_counts(counts)
    met_counts, met_estimates = [counts], [estimates]
    floor = min(estimates[len(offered) - len(settled) :], default=math.inf)
    climbing = [k for k in range(len(offered) - len(settled)) if estimates[k] < floor]
    for k in sorted(climbing, key=lambda k: estimates[k])[:climbs]:
        count, current = counts[k], float(estimates[k])
        while math.isfinite(current):
            around, values = table.neighbourhood(count, num_gpus)
            met_counts.append(around)
            met_estimates.append(values)
            best = int(np.argmin(values))
            if not values[best] < current * (1 - 1e-9):
                break
            count, current = around[best], float(values[best])
    every, values = np.vstack(met_counts), np.concatenate(met_estimates)
    found: dict[Strategy, float] = {}
    for i in np.argsort(values, kind="stable"):
        if len(found) == keep or not math.isfinite(values[i]):
            break
        strategy = Strategy.of({iw.profiles[k].scheme: int(d) for k, d in enumerate(every[i]) if d})
        found.setdefault(strategy, float(values[i]))
    return [(value, strategy) for strategy, value in found.items()]


def round_strategy(
    pipelines: np.ndarray,
    profiles: tuple[SchemeProfile, ...],
    num_gpus: int,
    longest: int,
    max_choices: int = 3,
) -> tuple[Strategy, ...]:
    """Every floor/ceil rounding of the fractional pipeline counts, adjusted to `num_gpus`: a
    rounding that holds no `longest`-token sequence is dropped, one over the GPU count gives up
    pipelines where the relaxation put the least work per pipeline (never the last pipeline
    that holds `longest`), and leftover GPUs get one more pipeline at a time where it put the
    most."""
    used = [k for k in range(len(profiles)) if pipelines[k] > 1e-9]
    holds = {k for k in used if profiles[k].max_len >= longest}
    # Floor and ceiling for the schemes that hold the longest sequence and the `max_choices`
    # others whose rounding is least clear (fraction nearest 1/2); the rest round to nearest,
    # keeping the enumeration small.
    others = sorted(set(used) - holds, key=lambda k: abs(pipelines[k] % 1 - 0.5))
    unclear = holds | set(others[:max_choices])
    options = [
        sorted({math.floor(pipelines[k]), math.ceil(pipelines[k])})
        if k in unclear
        else [round(pipelines[k])]
        for k in used
    ]
    gpus_of = {k: profiles[k].scheme.num_gpus for k in used}

    def load(k: int, count: dict[int, int], extra: int) -> float:
        return pipelines[k] / max(count[k] + extra, 1e-9)

    found: dict[tuple[tuple[int, int], ...], None] = {}
    for counts in itertools.product(*options):
        count = dict(zip(used, counts, strict=True))
        if not any(count[k] for k in holds):
            continue
        gpus = sum(gpus_of[k] * d for k, d in count.items())
        while gpus > num_gpus:
            holders = sum(count[h] for h in holds)
            spare = [k for k in used if count[k] > (1 if k in holds and holders == 1 else 0)]
            if not spare:
                break
            k = min(spare, key=lambda k: (load(k, count, -1), k))
            count[k] -= 1
            gpus -= gpus_of[k]
        if gpus > num_gpus:
            continue
        fits = [k for k in used if gpus_of[k] <= num_gpus - gpus]
        while fits:
            k = max(fits, key=lambda k: (load(k, count, 1), -k))
            count[k] += 1
            gpus += gpus_of[k]
            fits = [k for k in fits if gpus_of[k] <= num_gpus - gpus]
        found[tuple(sorted((k, d) for k, d in count.items() if d))] = None
    return tuple(Strategy.of({profiles[k].scheme: d for k, d in key}) for key in found)


def _describe(pipelines: np.ndarray, profiles: tuple[SchemeProfile, ...]) -> str:
    return " + ".join(
        f"{pipelines[k]:.2f}x{profiles[k].scheme}"
        for k in range(len(profiles))
        if pipelines[k] > 1e-9
    )


@dataclass(frozen=True)
class DpSolution:
    """Eq. 4 solved on a grid of `step` GPUs and pipelines: t[N][l] for every number of
    intervals l (`latency[l - 1]`), and S[N][l] as pipelines per scheme (`pipelines[l - 1]`,
    multiples of `step`, columns in `IntervalWork.profiles` order) and the scheme of each
    interval (`scheme_of_interval[l - 1][:l]`; -1: none, only where t is inf)."""

    step: float
    latency: np.ndarray
    pipelines: np.ndarray
    scheme_of_interval: np.ndarray


def proposal_dp(
    iw: IntervalWork,
    num_gpus: int,
    *,
    step: float = 0.1,
    tables: Callable[[IntervalWork, int, float], tuple[np.ndarray, np.ndarray]] | None = None,
) -> DpSolution:
    """The paper's DP (§7, Eq. 4) with n (GPUs) and d (pipelines) on a grid of `step`.

    step = 0.1 is the paper's continuous relaxation (its footnote 4); step = 1 is the DP over
    whole GPUs and pipelines, exact for the restricted problem (`integer_proposal_dp`).
    t[n][l] = min(t[n - step][l], min over schemes k holding interval l, block starts s < l and
    d of max(t[n - d N(P_k)][s], W_k(s, l] / d)), t[n][0] = 0, t[0][l > 0] = inf.

    Exact, but faster than the recurrence read literally: t[m][s] never increases with m, so
    over d the first term rises while W / d falls, and the best d is where they cross.
    The C++ core keeps each crossing from one n to the next, where it only moves up:
    O(K (N / step) L^2) in all. `tables` fills t and the choices instead (the tests pass the
    Python twin, `dynapipe_planner._reference.proposal.proposal_dp_tables_reference`, which
    bisects for the crossing with array operations, a log factor more and about two orders of
    magnitude slower). Both give the same t and choices."""
    units = round(num_gpus / step)
    if units < 1 or abs(units * step - num_gpus) > 1e-9 * max(1, num_gpus):
        raise PlanningError(f"DP step {step} must divide the {num_gpus} GPUs into whole steps")
    if tables is None:
        gpus = np.array([p.scheme.num_gpus for p in iw.profiles], dtype=np.int64)
        t, choice = _core.proposal_dp(iw.work, gpus, units, step)
    else:
        t, choice = tables(iw, units, step)
    return _dp_solution(t, choice, iw, units, step)


def _dp_solution(
    t: np.ndarray, choice: np.ndarray, iw: IntervalWork, units: int, step: float
) -> DpSolution:
    """S[N][l] for every l, by walking the DP's choices back from (N, l)."""
    num_intervals, num_schemes = iw.work.shape
    pipelines = np.zeros((num_intervals, num_schemes))
    scheme_of = np.full((num_intervals, num_intervals), -1, dtype=np.int64)
    for top in range(1, num_intervals + 1):
        if not math.isfinite(t[units, top]):
            continue
        n, ell = units, top
        while ell > 0:
            k, d, start = choice[n, ell]
            if k < 0:
                n -= 1
                continue
            pipelines[top - 1, k] += d * step
            scheme_of[top - 1, start:ell] = k
            n, ell = n - d * iw.profiles[k].scheme.num_gpus, start
    return DpSolution(step, t[units, 1:].copy(), pipelines, scheme_of)


def integer_proposal_dp(iw: IntervalWork, num_gpus: int) -> tuple[np.ndarray, list[Strategy]]:
    """Eq. 4 over whole GPUs and pipelines (`proposal_dp` with step 1): t[N][l] and S[N][l] for
    l = 1..L intervals. Exact for the problem the paper's DP solves before its relaxation
    (each pipeline serves one block of length intervals); the tests hold it to exhaustive
    enumeration."""
    solution = proposal_dp(iw, num_gpus, step=1.0)
    strategies = [
        Strategy.of({p.scheme: round(d) for p, d in zip(iw.profiles, row, strict=True)})
        for row in solution.pipelines
    ]
    return solution.latency, strategies
