"""Behaviour of the micro-batching DP (DynaPipe seed dynapipe.txt §4, Eq. 1/Eq. 2 with the
|D| replica term): exact optimality against brute force, C++/Python parity, the bucketing
guarantee, partition validity, error messages and the time budget."""

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner import _core
from dynapipe_planner._reference.microbatch_dp import microbatch_dp_kernel
from dynapipe_planner.cluster import GPU_PRESETS, ClusterSpec
from dynapipe_planner.cost.analytic import AnalyticCostModel
from dynapipe_planner.cost.table import PipelineCosts, interp3, locate
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.microbatch.dp import dp_inputs, dynamic_microbatches, validate_lengths
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.numerics import ordered_sum

GiB = 2**30
KERNELS = {"cpp": None, "python": microbatch_dp_kernel}
BACKENDS = tuple(KERNELS)
FAST = settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- random problems -----------------------------------------------------------------------


def make_costs(rng, num_stages, encoder_decoder, one_f_one_b=True):
    """Random PipelineCosts with monotone tables (positive increments cumulatively summed along
    b, s and t), a small grid whose b axis starts at 1, and a memory limit under which every
    single sample fits but large micro-batches may not."""
    nb = int(rng.integers(2, 5))
    b_grid = np.cumsum(np.r_[1, rng.integers(1, 4, nb - 1)]).astype(float)
    ns = int(rng.integers(1, 4))
    s_grid = np.cumsum(rng.integers(4, 40, ns)).astype(float)
    if encoder_decoder:
        nt = int(rng.integers(2, 4))
        t_grid = np.cumsum(np.r_[rng.integers(0, 5), rng.integers(4, 30, nt - 1)]).astype(float)
    else:
        nt, t_grid = 1, np.array([0.0])
    shape = (num_stages, nb, ns, nt)

    def monotone(overhead, scale=1.0):
        x = rng.uniform(0.01, 1.0, shape)
        # A fixed per-micro-batch overhead makes bigger micro-batches cheaper per sample.
        x[:, 0, 0, 0] += rng.uniform(0.0, overhead, num_stages)
        for axis in (1, 2, 3):
            x = np.cumsum(x, axis=axis)
        return x * scale

    forward, backward = monotone(6.0, 1e-3), monotone(6.0, 2e-3)
    activation, transient = monotone(1.0, GiB / 8), monotone(1.0, GiB / 32)
    inflight = np.arange(num_stages, 0, -1).astype(float) if one_f_one_b else np.ones(num_stages)
    static = rng.uniform(0.0, 4.0, num_stages) * GiB
    need = inflight.reshape(-1, 1, 1, 1) * activation + transient
    lo = float(np.max(static + need[:, 0, -1, -1]))
    hi = float(np.max(static + need.reshape(num_stages, -1).max(axis=1))) * 1.2
    limit = float(rng.uniform(lo, max(lo, hi)))
    costs = PipelineCosts(
        b_grid=b_grid,
        s_grid=s_grid,
        t_grid=t_grid,
        forward=forward,
        backward=backward,
        activation=activation,
        transient=transient,
        static=static,
        attention_coef=np.zeros(num_stages),
        hidden_size=16,
        memory_limit=limit,
        p2p_bandwidth=np.full(num_stages - 1, 1e10),
        p2p_latency=1e-5,
    )
    return costs, inflight


def make_lengths(rng, costs, n, encoder_decoder):
    smax = int(costs.s_grid[-1])
    if rng.random() < 0.4:  # few distinct lengths: ties in the sort order
        src = rng.choice(rng.integers(1, smax + 1, 3), n)
    else:
        src = rng.integers(1, smax + 1, n)
    if not encoder_decoder:
        return src.astype(np.int64)
    tgt = rng.integers(1, int(costs.t_grid[-1]) + 1, n)
    return np.stack([src, tgt], axis=1).astype(np.int64)


@st.composite
def problems(draw, max_n, encoder_decoder=None, max_stages=5):
    seed = draw(st.integers(0, 2**32 - 1))
    enc = draw(st.booleans()) if encoder_decoder is None else encoder_decoder
    num_stages = draw(st.integers(1, max_stages))
    replicas = draw(st.integers(1, 3))
    rng = np.random.default_rng(seed)
    # Sizes come from the seed, not from hypothesis, which would favour tiny batches.
    n = (
        int(rng.integers(1, max_n + 1))
        if rng.random() < 0.3
        else int(rng.integers(max(1, max_n // 2), max_n + 1))
    )
    costs, inflight = make_costs(rng, num_stages, enc, one_f_one_b=bool(rng.integers(0, 2)))
    return make_lengths(rng, costs, n, enc), costs, inflight, replicas


# ---- an independent evaluator of micro-batches ---------------------------------------------


class Evaluator:
    """Prices any set of samples the way the DP must: padded to its longest sample (and longest
    target), interpolated on the monotone tables `dp_inputs` returns; infeasible (inf) when it
    leaves the grid or its memory ratio exceeds 1."""

    def __init__(self, lengths, costs, inflight, replicas):
        self.lengths = np.asarray(lengths)
        self.time, self.mem = dp_inputs(costs, inflight)
        self.grids = [costs.b_grid.tolist(), costs.s_grid.tolist(), costs.t_grid.tolist()]
        self.bubble = costs.num_stages - 1
        self.replicas = replicas
        self._priced: dict[tuple[int, ...], float] = {}  # the brute forces meet each set often

    def shape(self, idx):
        sub = self.lengths[list(idx)]
        if sub.ndim == 1:
            return len(idx), int(sub.max()), 0
        return len(idx), int(sub[:, 0].max()), int(sub[:, 1].max())

    def cost(self, idx):
        key = tuple(sorted(int(i) for i in idx))
        if key not in self._priced:
            self._priced[key] = self._price(idx)
        return self._priced[key]

    def _price(self, idx):
        cells = [locate(g, float(x)) for g, x in zip(self.grids, self.shape(idx), strict=True)]
        if any(c is None for c in cells) or interp3(self.mem, *cells) > 1.0:
            return math.inf
        return interp3(self.time, *cells)

    def objective(self, groups):
        costs = [self.cost(g) for g in groups]
        if any(math.isinf(c) for c in costs):
            return math.inf, costs
        total = 0.0
        for c in costs:  # left to right, as the DP accumulates f
            total += c
        return self.bubble * max(costs) + total / self.replicas, costs

    def sorted_order(self):
        if self.lengths.ndim == 1:
            return list(np.argsort(self.lengths, kind="stable"))
        return list(np.lexsort((self.lengths[:, 1], self.lengths[:, 0])))

    def brute_contiguous(self):
        """Optimum of Eq. 1 (with the |D| term) over all 2^(N-1) contiguous partitions."""
        order = self.sorted_order()
        n = len(order)
        best = math.inf
        for mask in range(2 ** (n - 1)):
            cuts = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
            groups = [order[a:b] for a, b in itertools.pairwise(cuts)]
            best = min(best, self.objective(groups)[0])
        return best

    def brute_set_partitions(self):
        """Optimum over every set partition of the samples (Bell(N) of them)."""
        best = math.inf
        for groups in set_partitions(list(range(len(self.lengths)))):
            best = min(best, self.objective(groups)[0])
        return best


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield [*part[:k], [first, *part[k]], *part[k + 1 :]]


def test_set_partition_enumerator_counts_bell_numbers():
    bell = [1, 1, 2, 5, 15, 52, 203, 877]
    for n, expected in enumerate(bell):
        parts = list(set_partitions(list(range(n))))
        assert len(parts) == expected
        assert len({tuple(sorted(tuple(sorted(b)) for b in p)) for p in parts}) == expected


def run(lengths, costs, inflight, replicas, backend="cpp", **kw):
    """The DP on the C++ core ("cpp") or on its Python twin ("python")."""
    kw.setdefault("work_budget", 0)
    kernel = KERNELS[backend]
    return dynamic_microbatches(
        lengths, costs, inflight=inflight, num_replicas=replicas, kernel=kernel, **kw
    )


def assert_valid(result, lengths, costs, inflight, replicas):
    """Every sample once, contiguous in sorted order, memory-feasible on every stage, and the
    returned accounting equal (bit for bit) to the partition's own costs."""
    ev = Evaluator(lengths, costs, inflight, replicas)
    groups = [list(map(int, g)) for g in result.microbatches]
    assert all(groups), "empty micro-batch"
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    obj, group_costs = ev.objective(groups)
    assert all(math.isfinite(c) for c in group_costs)
    assert result.objective == obj
    assert result.max_time == max(group_costs)
    assert result.sum_time == ordered_sum(group_costs)
    avail = costs.available_memory()
    for g in groups:
        b, s, t = ev.shape(g)
        assert b <= costs.b_grid[-1] and s <= costs.s_grid[-1] and t <= costs.t_grid[-1]
        sc = costs.stage_costs(b, s, t)
        need = np.asarray(inflight) * sc.activation + sc.transient
        assert np.all(need <= avail * (1 + 1e-12)), (g, need / avail)
    # Contiguous in the sort order: micro-batches do not interleave.
    key = lengths if lengths.ndim == 1 else lengths[:, 0]
    for g, h in itertools.pairwise(groups):
        assert key[g].max() <= key[h].min()


# ---- exact optimality ----------------------------------------------------------------------


@FAST
@given(problems(max_n=10))
def test_exact_dp_equals_brute_force_over_contiguous_partitions(problem):
    lengths, costs, inflight, replicas = problem
    ev = Evaluator(lengths, costs, inflight, replicas)
    expected = ev.brute_contiguous()
    assert math.isfinite(expected)  # every sample fits alone, so singletons are feasible
    for backend in BACKENDS:
        res = run(lengths, costs, inflight, replicas, bucket_rel=0, bucket_abs=0, backend=backend)
        assert res.objective == pytest.approx(expected, rel=1e-12, abs=0)
        assert not res.budget_exhausted
        assert_valid(res, lengths, costs, inflight, replicas)


@settings(max_examples=examples(120), deadline=None)
@given(problems(max_n=7, encoder_decoder=False))
def test_sorted_contiguous_optimum_equals_set_partition_optimum(problem):
    """Decoder-only with monotone costs: sorting loses nothing against arbitrary grouping."""
    lengths, costs, inflight, replicas = problem
    ev = Evaluator(lengths, costs, inflight, replicas)
    expected = ev.brute_set_partitions()
    res = run(lengths, costs, inflight, replicas, bucket_rel=0, bucket_abs=0)
    assert res.objective == pytest.approx(expected, rel=1e-12, abs=0)


def hand_costs(num_stages, mem_at_4=0.75):
    """b in {1, 2, 4}, one sequence length (16): t(1)=1, t(2)=1.2, t(4)=2 (t(3)=1.6)."""
    t = np.array([1.0, 1.2, 2.0]).reshape(1, 3, 1, 1)
    per_stage = np.repeat(t, num_stages, axis=0) / 2  # forward = backward = t / 2
    act = np.array([0.25, 0.5, mem_at_4]).reshape(1, 3, 1, 1) * GiB  # 1 GiB available
    act = np.repeat(act, num_stages, axis=0)
    return PipelineCosts(
        b_grid=[1, 2, 4],
        s_grid=[16],
        t_grid=[0],
        forward=per_stage,
        backward=per_stage,
        activation=act,
        transient=np.zeros_like(act),
        static=np.zeros(num_stages),
        attention_coef=np.zeros(num_stages),
        hidden_size=8,
        memory_limit=float(GiB),
        p2p_bandwidth=np.ones(num_stages - 1),
        p2p_latency=0.0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("stages", "replicas", "sizes", "objective"),
    [
        (1, 1, [4], 2.0),  # no bubble: fewest, largest micro-batches (t(4)=2 < 2*t(2)=2.4)
        (1, 2, [4], 1.0),  # |D| divides the sum
        (3, 1, [2, 2], 2 * 1.2 + 2.4),  # bubble 2*max: {4} costs 6, singles 6, {2,2} 4.8
        (3, 2, [2, 2], 2 * 1.2 + 1.2),  # {4}: 5, singles: 2 + 2 = 4, {2,2}: 3.6
    ],
)
def test_hand_computed_optima(backend, stages, replicas, sizes, objective):
    costs = hand_costs(stages)
    inflight = np.ones(stages)
    res = run(np.full(4, 16), costs, inflight, replicas, bucket_rel=0, backend=backend)
    assert [len(m) for m in res.microbatches] == sizes
    assert res.objective == pytest.approx(objective, rel=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_limit_forbids_micro_batches_over_ratio_one(backend):
    # b=4 needs 1.5x the memory; b=3 interpolates to exactly 1.0 and is allowed.
    costs = hand_costs(1, mem_at_4=1.5)
    inflight = np.ones(1)
    _, mem = dp_inputs(costs, inflight)
    assert mem[2, 0, 0] == pytest.approx(1.5) and mem[1, 0, 0] == pytest.approx(0.5)
    res = run(np.full(4, 16), costs, inflight, 1, bucket_rel=0, backend=backend)
    assert [len(m) for m in res.microbatches] == [2, 2]  # 2.4 beats {3,1} at 1.6 + 1 = 2.6
    res = run(np.full(3, 16), costs, inflight, 1, bucket_rel=0, backend=backend)
    assert [len(m) for m in res.microbatches] == [3]
    assert res.objective == pytest.approx(1.6)


@FAST
@given(problems(max_n=12, max_stages=1))
def test_single_stage_replicas_only_scale_the_objective(problem):
    lengths, costs, inflight, _ = problem
    one = run(lengths, costs, inflight, 1)
    for replicas in (2, 3):
        many = run(lengths, costs, inflight, replicas)
        assert [m.tolist() for m in many.microbatches] == [m.tolist() for m in one.microbatches]
        assert many.objective == pytest.approx(one.objective / replicas, rel=1e-15)
        assert many.passes == 1


@FAST
@given(problems(max_n=25), st.randoms(use_true_random=False))
def test_objective_does_not_depend_on_input_order(problem, rnd):
    lengths, costs, inflight, replicas = problem
    perm = list(range(len(lengths)))
    rnd.shuffle(perm)
    a = run(lengths, costs, inflight, replicas)
    b = run(lengths[perm], costs, inflight, replicas)
    assert a.objective == b.objective

    def shapes(res, lens):
        return [sorted(map(tuple, lens[m].reshape(len(m), -1).tolist())) for m in res.microbatches]

    assert shapes(a, lengths) == shapes(b, lengths[perm])


# ---- C++ and Python agree ------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_n=30), st.sampled_from([0.0, 1e-3, 1e-2]), st.sampled_from([0.0, 1e-3]))
def test_cpp_and_python_backends_are_bit_identical(problem, bucket_rel, bucket_abs):
    lengths, costs, inflight, replicas = problem
    kw = {"bucket_rel": bucket_rel, "bucket_abs": bucket_abs}
    cpp = run(lengths, costs, inflight, replicas, backend="cpp", **kw)
    py = run(lengths, costs, inflight, replicas, backend="python", **kw)
    assert_backends_agree(cpp, py)
    assert_valid(cpp, lengths, costs, inflight, replicas)


def assert_backends_agree(cpp, py) -> None:
    """The C++ and Python DP results are bit-identical: partition, objective, times, passes,
    and the work counted against the budget (so both stop after the same pass)."""
    assert [m.tolist() for m in cpp.microbatches] == [m.tolist() for m in py.microbatches]
    assert (cpp.objective, cpp.max_time, cpp.sum_time, cpp.passes, cpp.work) == (
        py.objective,
        py.max_time,
        py.sum_time,
        py.passes,
        py.work,
    )


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_n=20, encoder_decoder=True))
def test_backends_agree_on_encoder_decoder_with_default_bucketing(problem):
    lengths, costs, inflight, replicas = problem
    assert lengths.shape[1] == 2 and len(costs.t_grid) >= 2
    cpp = run(lengths, costs, inflight, replicas, backend="cpp")
    py = run(lengths, costs, inflight, replicas, backend="python")
    assert [m.tolist() for m in cpp.microbatches] == [m.tolist() for m in py.microbatches]
    assert (cpp.objective, cpp.max_time, cpp.sum_time) == (py.objective, py.max_time, py.sum_time)
    assert_valid(cpp, lengths, costs, inflight, replicas)


def test_core_rejects_mismatched_tables_and_empty_input():
    grid = np.array([1.0, 2.0])
    table = np.zeros((2, 1, 1))
    args = (grid, np.array([8.0]), np.array([0.0]))
    no_packing = (np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match="table sizes"):
        _core.microbatch_dp(
            np.array([4]), np.zeros(0, np.int64), *args, table[:1], table, 1, 1, 0.0, 0.0, 0,
            *no_packing,
        )  # fmt: skip
    with pytest.raises(ValueError, match="no samples"):
        _core.microbatch_dp(
            np.zeros(0, np.int64), np.zeros(0, np.int64), *args, table, table, 1, 1, 0.0, 0.0, 0,
            *no_packing,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one table per coefficient"):
        _core.microbatch_dp(
            np.array([4]), np.zeros(0, np.int64), *args, table, table, 1, 1, 0.0, 0.0, 0,
            table, np.zeros(2),
        )  # fmt: skip
    with pytest.raises(ValueError, match="sorted by length"):
        _core.microbatch_dp(
            np.array([5, 4]), np.zeros(0, np.int64), *args, table, table, 1, 1, 0.0, 0.0, 0,
            table, np.zeros(1),
        )  # fmt: skip
    with pytest.raises(ValueError, match="coefficients must be >= 0"):
        _core.microbatch_dp(
            np.array([4]), np.zeros(0, np.int64), *args, table, table, 1, 1, 0.0, 0.0, 0,
            table, np.array([-1.0]),
        )  # fmt: skip


# ---- bucketing -----------------------------------------------------------------------------


@FAST
@given(problems(max_n=10), st.sampled_from([1e-3, 1e-2, 0.1, 0.5]))
def test_bucketed_objective_is_within_bucket_rel_of_the_optimum(problem, bucket_rel):
    lengths, costs, inflight, replicas = problem
    exact = Evaluator(lengths, costs, inflight, replicas).brute_contiguous()
    for backend in BACKENDS:
        res = run(lengths, costs, inflight, replicas, bucket_rel=bucket_rel, backend=backend)
        assert exact * (1 - 1e-12) <= res.objective <= exact * (1 + bucket_rel) * (1 + 1e-12)
        assert_valid(res, lengths, costs, inflight, replicas)


@FAST
@given(problems(max_n=10), st.floats(1e-4, 1.0))
def test_bucket_abs_costs_at_most_bubble_times_width(problem, width):
    lengths, costs, inflight, replicas = problem
    scale = float(np.max(costs.forward + costs.backward))
    exact = Evaluator(lengths, costs, inflight, replicas).brute_contiguous()
    res = run(lengths, costs, inflight, replicas, bucket_rel=0, bucket_abs=width * scale)
    bubble = costs.num_stages - 1
    assert res.objective <= exact + bubble * width * scale + 1e-12 * exact


def staircase_problem():
    """32 equal samples where bucket widths taken from the first pass's objective (33.32, about
    eight times the optimum 4.2) overshot: such a DP returned 4.21625, 3.9x bucket_rel above
    the optimum. Widths from a lower bound on the optimum keep it within bucket_rel."""
    b = np.array([1, 2, 4, 8, 12, 16, 24], float)
    t = np.array([0.98, 0.981, 0.99, 1.0, 1.0075, 1.05, 1.1]).reshape(1, -1, 1, 1)
    costs = PipelineCosts(
        b_grid=b,
        s_grid=[8],
        t_grid=[0],
        forward=np.repeat(t, 3, axis=0),
        backward=np.zeros((3, 7, 1, 1)),
        activation=np.ones((3, 7, 1, 1)),
        transient=np.zeros((3, 7, 1, 1)),
        static=np.zeros(3),
        attention_coef=np.zeros(3),
        hidden_size=8,
        memory_limit=10.0,
        p2p_bandwidth=np.ones(2),
        p2p_latency=0.0,
    )
    return np.full(32, 8), costs, np.ones(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bucketing_stays_within_bucket_rel_when_the_first_pass_is_far_off(backend):
    lengths, costs, inflight = staircase_problem()
    exact = run(lengths, costs, inflight, 1, bucket_rel=0, backend=backend)
    assert exact.objective == pytest.approx(4.2)
    assert [len(m) for m in exact.microbatches] == [16, 16]
    first = run(lengths, costs, inflight, 1, work_budget=1, backend=backend)
    assert first.objective == pytest.approx(34 * 0.98)  # all singletons: (2 + 32) * 0.98
    assert first.objective > 7 * exact.objective
    res = run(lengths, costs, inflight, 1, bucket_rel=1e-3, backend=backend)
    assert res.objective <= exact.objective * (1 + 1e-3)
    assert res.passes <= exact.passes


# ---- validity at larger sizes ---------------------------------------------------------------


@settings(max_examples=examples(100), deadline=None)
@given(problems(max_n=80))
def test_partitions_are_valid_at_larger_sizes(problem):
    lengths, costs, inflight, replicas = problem
    res = run(lengths, costs, inflight, replicas)
    assert_valid(res, lengths, costs, inflight, replicas)
    assert res.passes >= 1


# ---- dp_inputs and validate_lengths ---------------------------------------------------------


def test_dp_inputs_are_monotone_and_bound_the_raw_tables():
    rng = np.random.default_rng(7)
    costs, inflight = make_costs(rng, 3, encoder_decoder=True)
    noisy = dataclasses.replace(
        costs,
        forward=costs.forward * rng.uniform(0.5, 1.5, costs.forward.shape),
        activation=costs.activation * rng.uniform(0.5, 1.5, costs.forward.shape),
    )
    raw_time, raw_mem = noisy.dp_tables(inflight)
    assert np.any(np.diff(raw_time, axis=0) < 0)  # the noise broke monotonicity
    time, mem = dp_inputs(noisy, inflight)
    for table in (time, mem):
        assert table.flags.c_contiguous and table.shape == raw_time.shape
        for axis in range(3):
            assert np.all(np.diff(table, axis=axis) >= 0)
    assert np.all(time >= raw_time) and np.all(mem >= raw_mem)
    assert time[0, 0, 0] == raw_time[0, 0, 0]
    # Already monotone tables pass through unchanged: the bottleneck stage and the worst ratio.
    time, mem = dp_inputs(costs, inflight)
    np.testing.assert_array_equal(time, np.max(costs.forward + costs.backward, axis=0))
    avail = (costs.memory_limit - costs.static).reshape(-1, 1, 1, 1)
    ratio = (inflight.reshape(-1, 1, 1, 1) * costs.activation + costs.transient) / avail
    np.testing.assert_allclose(mem, ratio.max(axis=0), rtol=1e-15)


def test_validate_lengths_accepts_whole_numbers_and_returns_int64():
    out = validate_lengths([3, 1, 2])
    assert out.dtype == np.int64 and out.tolist() == [3, 1, 2]
    out = validate_lengths(np.array([[3.0, 1.0], [2.0, 5.0]]))
    assert out.dtype == np.int64 and out.shape == (2, 2)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([], "empty batch"),
        (np.zeros((0, 2)), "empty batch"),
        ([4, 0, 7], "sample 1 has length 0; lengths must be positive"),
        ([4, 5, 7, -3], "sample 3 has length -3"),
        ([[4, 2], [5, 0]], r"sample 1 has length \[5, 0\]"),
        ([[4, 2, 1]], r"shape \(N,\) or \(N, 2\), got \(1, 3\)"),
        ([[[4]]], "shape"),
        ([4.5, 3], "whole numbers"),
        ([np.nan, 3], "whole numbers"),
    ],
)
def test_validate_lengths_errors(lengths, message):
    with pytest.raises(PlanningError, match=message):
        validate_lengths(np.asarray(lengths))


# ---- error messages from dynamic_microbatches ------------------------------------------------


def gib_costs(num_stages=2):
    """s in {64, 128, 256}: one sample of length s keeps s/64 GiB per stage; 8 GiB available."""
    b = np.array([1.0, 2.0, 4.0]).reshape(1, 3, 1, 1)
    s = np.array([64.0, 128.0, 256.0]).reshape(1, 1, 3, 1)
    act = np.repeat(b * s / 64 * GiB, num_stages, axis=0)
    return PipelineCosts(
        b_grid=[1, 2, 4],
        s_grid=[64, 128, 256],
        t_grid=[0],
        forward=act / GiB * 1e-3,
        backward=act / GiB * 2e-3,
        activation=act,
        transient=act / 4,
        static=np.full(num_stages, 2.0 * GiB),
        attention_coef=np.zeros(num_stages),
        hidden_size=8,
        memory_limit=10.0 * GiB,
        p2p_bandwidth=np.ones(num_stages - 1),
        p2p_latency=0.0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_non_positive_lengths_are_rejected(backend):
    costs = gib_costs()
    with pytest.raises(PlanningError, match="empty batch"):
        run(np.array([], np.int64), costs, np.ones(2), 1, backend=backend)
    with pytest.raises(PlanningError, match=r"^sample 2 has length 0"):
        run(np.array([9, 3, 0, 5]), costs, np.ones(2), 1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_that_does_not_fit_alone_is_named_with_its_memory(backend):
    costs = gib_costs()
    inflight = np.array([2.0, 1.0])
    # Sample 0 (length 200) alone: stage 0 holds 2 x 3.125 + 0.78125 = 7.03 GiB of 8 GiB; fine.
    run(np.array([200, 10]), costs, inflight, 1, backend=backend)
    # Sample 1 (length 256, the last in sorted order is sample 1) alone needs 2 x 4 + 1 = 9 GiB.
    lengths = np.array([100, 256, 10, 30])
    expected = re.escape(
        "sample 1 (length 256) does not fit in any micro-batch: alone it needs 9.00 GiB of "
        "activation memory on stage 0 (2 in flight) but only 8.00 GiB is left"
    )
    with pytest.raises(PlanningError, match=expected):
        run(lengths, costs, inflight, 1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_beyond_the_grid_is_named(backend):
    costs = gib_costs()
    lengths = np.array([300, 100, 257, 20])  # two too long; the shorter one comes first sorted
    with pytest.raises(
        PlanningError,
        match=r"sample 2 \(length 257\) lies beyond the cost table \(largest sequence length 256\)",
    ):
        run(lengths, costs, np.ones(2), 1, backend=backend)


def test_encoder_decoder_errors():
    rng = np.random.default_rng(3)
    costs, inflight = make_costs(rng, 2, encoder_decoder=True)
    tmax = int(costs.t_grid[-1])
    lengths = np.array([[5, 1], [3, tmax + 1], [4, 2]])
    with pytest.raises(
        PlanningError, match=r"sample 1 \(length 3, target length \d+\) lies beyond"
    ):
        run(lengths, costs, inflight, 1)
    gpt = gib_costs()
    with pytest.raises(PlanningError, match="target lengths given but the cost model is decoder"):
        run(np.array([[5, 1]]), gpt, np.ones(2), 1)


def test_unknown_order_is_rejected():
    costs = gib_costs()
    with pytest.raises(PlanningError, match="unknown sample order 'random'"):
        run(np.array([5]), costs, np.ones(2), 1, order="random")


# ---- work budget ---------------------------------------------------------------------------


@FAST
@given(problems(max_n=30))
def test_tiny_work_budget_returns_a_valid_partition(problem):
    lengths, costs, inflight, replicas = problem
    for backend in BACKENDS:
        full = run(lengths, costs, inflight, replicas, bucket_rel=0, backend=backend)
        cut = run(lengths, costs, inflight, replicas, bucket_rel=0, work_budget=1, backend=backend)
        assert_valid(cut, lengths, costs, inflight, replicas)
        assert cut.passes == 1
        assert cut.budget_exhausted == (full.passes > 1)
        assert cut.objective >= full.objective
        assert not full.budget_exhausted


def test_work_budget_is_hit_on_a_problem_needing_many_passes():
    lengths, costs, inflight = staircase_problem()
    full = run(lengths, costs, inflight, 1, bucket_rel=0)
    assert full.passes > 1 and not full.budget_exhausted
    cut = run(lengths, costs, inflight, 1, bucket_rel=0, work_budget=1)
    assert cut.budget_exhausted and cut.passes == 1
    assert_valid(cut, lengths, costs, inflight, 1)


# ---- realistic costs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_costs():
    model = MODEL_PRESETS["gpt-1.3b"]
    cluster = ClusterSpec(GPU_PRESETS["A100-80GB"], num_stages=4, num_replicas=2, tp=2)
    return AnalyticCostModel(model, cluster).pipeline_costs(
        "selective", max_samples=256, max_seqlen=4096
    )


def test_bucketing_saves_passes_on_analytic_costs(gpt_costs):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 256).astype(int), 1, 4096)
    inflight = np.arange(4, 0, -1)
    exact = run(lengths, gpt_costs, inflight, 2, bucket_rel=0)
    fast = run(lengths, gpt_costs, inflight, 2)
    assert fast.passes * 5 < exact.passes
    assert exact.objective <= fast.objective <= exact.objective * (1 + 1e-3)
    assert_valid(fast, lengths, gpt_costs, inflight, 2)
    assert 1 < len(fast.microbatches) < len(lengths)


def test_backends_agree_on_analytic_costs(gpt_costs):
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 96).astype(int), 1, 4096)
    inflight = np.arange(4, 0, -1)
    cpp = run(lengths, gpt_costs, inflight, 2, backend="cpp")
    py = run(lengths, gpt_costs, inflight, 2, backend="python")
    assert [m.tolist() for m in cpp.microbatches] == [m.tolist() for m in py.microbatches]
    assert (cpp.objective, cpp.passes) == (py.objective, py.passes)
