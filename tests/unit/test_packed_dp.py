"""Packed rows inside the micro-batching DP (issue 21 item 1): each contiguous group of the
sorted samples may run padded or as its samples packed first-fit-decreasing into rows of its
own or the batch's longest sample. Exact against brute force over that space, C++ == Python
bit for bit, memory respected, the time budget kept, and the planner runs exactly the rows the
DP priced and is never slower than the packing baseline."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_microbatch_dp import (
    BACKENDS,
    Evaluator,
    GiB,
    assert_backends_agree,
    make_costs,
    make_lengths,
    run,
)
from test_planner import check_plan, make_planner

from dynapipe_planner.cost.table import PipelineCosts, interp3, locate
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.microbatch.baselines import (
    Group,
    packed_group,
    rows_up_to,
    trimmed_rows_groups,
)
from dynapipe_planner.microbatch.dp import packing_inputs
from dynapipe_planner.microbatch.ordering import order_samples
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.numerics import ordered_sum
from dynapipe_planner.planner import packed_row_lengths


@st.composite
def packing_problems(draw, max_n, max_stages=4):
    """Decoder-only random problems (tables and memory as `make_costs`) whose stages save
    attention on packed rows: coef_j up to 1.5x the least time per row per token^2 of stage j's
    table, so a new row may cost less than the attention it saves."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    num_stages = draw(st.integers(1, max_stages))
    replicas = draw(st.integers(1, 3))
    n = int(rng.integers(1, max_n + 1))
    costs, inflight = make_costs(rng, num_stages, False, one_f_one_b=bool(rng.integers(0, 2)))
    b = costs.b_grid.reshape(1, -1, 1, 1)
    s = costs.s_grid.reshape(1, 1, -1, 1)
    per_token2 = ((costs.forward + costs.backward) / (b * s * s)).reshape(num_stages, -1)
    coef = rng.uniform(0.0, 1.5, num_stages) * per_token2.min(axis=1)
    coef[rng.random(num_stages) < 0.2] = 0.0
    costs = dataclasses.replace(costs, attention_coef=coef)
    return make_lengths(rng, costs, n, False), costs, inflight, replicas


class PackedEvaluator(Evaluator):
    """Prices a group of sorted samples every way, independently of the DP's code: padded as
    `Evaluator`; packed with `packed_group`'s first-fit-decreasing rows of the group's longest
    sample or of the batch's longest, each stage's own monotone table (every stage, none left
    out) less the attention saved, the largest over the stages; infeasible when the rows leave
    the grid or the memory. The DP's price of a group: its cheaper packing, no less than the
    group without its shortest samples (the DP's monotone prices)."""

    def __init__(self, lengths, costs, inflight, replicas):
        super().__init__(lengths, costs, inflight, replicas)
        time = costs.forward + costs.backward
        for axis in (1, 2, 3):
            time = np.maximum.accumulate(time, axis=axis)
        self.stage_time, self.coef = time, costs.attention_coef
        self.longest = int(self.lengths.max())

    def rows(self, idx, row_length):
        return packed_group(Group(np.array(idx), row_length), self.lengths)

    def packed_at(self, idx, row_length):
        group = self.rows(idx, row_length)
        cells = [
            locate(g, float(x))
            for g, x in zip(self.grids, (group.num_rows, group.seqlen, 0), strict=True)
        ]
        if any(c is None for c in cells) or interp3(self.mem, *cells) > 1.0:
            return math.inf
        return max(
            interp3(t, *cells) - group.attention_saved * c
            for t, c in zip(self.stage_time, self.coef, strict=True)
        )

    def row_length(self, idx):
        """The row length the DP packs `idx` (ascending length) at: its own longest sample's
        unless rows of the batch's longest are strictly cheaper."""
        own = int(self.lengths[idx[-1]])
        if self.packed_at(idx, self.longest) < self.packed_at(idx, own):
            return self.longest
        return own

    def packed(self, idx):
        """`idx` in ascending length: the DP's price (over the group and its suffixes)."""
        prices = [self.packed_at(idx[k:], self.row_length(idx[k:])) for k in range(len(idx))]
        return math.inf if math.isinf(prices[0]) else max(prices)

    def brute_padded_or_packed(self):
        """Optimum over every contiguous partition of the sorted samples, each group padded or
        packed (2^groups choices per partition; `packed` already takes the cheaper rows)."""
        order = self.sorted_order()
        n = len(order)
        best = math.inf
        for mask in range(2 ** (n - 1)):
            cuts = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
            groups = [order[a:b] for a, b in itertools.pairwise(cuts)]
            options = [(self.cost(g), self.packed(g)) for g in groups]
            for choice in itertools.product(*options):
                if any(math.isinf(c) for c in choice):
                    continue
                total = ordered_sum(choice)
                best = min(best, self.bubble * max(choice) + total / self.replicas)
        return best


def run_packed(lengths, costs, inflight, replicas, **kw):
    return run(lengths, costs, inflight, replicas, packed_rows=True, **kw)


def assert_packed_groups_fit(result, lengths, costs, inflight):
    """Every micro-batch, as the rows `packed_group` makes at the DP's row length, fits the
    memory on every stage."""
    avail = costs.available_memory()
    assert len(result.row_lengths) == len(result.microbatches)
    for idx, row_length in zip(result.microbatches, result.row_lengths, strict=True):
        assert row_length in (lengths[idx].max(), lengths.max())
        group = packed_group(Group(idx, row_length), lengths)
        sc = costs.stage_costs(group.num_rows, group.seqlen)
        need = np.asarray(inflight) * sc.activation + sc.transient
        assert np.all(need <= avail * (1 + 1e-12)), (idx, need / avail)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_problems(max_n=8))
def test_exact_against_brute_force_over_padded_or_packed_groups(problem):
    lengths, costs, inflight, replicas = problem
    ev = PackedEvaluator(lengths, costs, inflight, replicas)
    expected = ev.brute_padded_or_packed()
    assert math.isfinite(expected)
    for backend in BACKENDS:
        res = run_packed(
            lengths, costs, inflight, replicas, bucket_rel=0, bucket_abs=0, backend=backend
        )
        assert res.objective == pytest.approx(expected, rel=1e-12, abs=0)
        groups = [list(map(int, m)) for m in res.microbatches]
        assert res.row_lengths == [ev.row_length(g) for g in groups]
        prices = [ev.packed(g) for g in groups]
        assert res.max_time == max(prices)
        assert res.sum_time == pytest.approx(ordered_sum(prices), rel=1e-12)
        assert_packed_groups_fit(res, lengths, costs, inflight)
        # Contiguous in the sorted order.
        order = order_samples(lengths)
        assert np.concatenate(res.microbatches).tolist() == order.tolist()


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_problems(max_n=8))
def test_packed_groups_never_cost_more_than_padded_ones(problem):
    """Why the DP's micro-batches all run packed: on its monotone tables packing into rows of
    the group's longest sample costs at most what padding does (or padding does not fit)."""
    lengths, costs, inflight, replicas = problem
    ev = PackedEvaluator(lengths, costs, inflight, replicas)
    order = ev.sorted_order()
    for a, b in itertools.combinations(range(len(order) + 1), 2):
        group = order[a:b]
        assert ev.packed_at(group, int(lengths[group[-1]])) <= ev.cost(group)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_problems(max_n=40), st.sampled_from([0.0, 1e-3, 1e-2]), st.sampled_from([0.0, 1e-3]))
def test_cpp_and_python_are_bit_identical_with_packing(problem, bucket_rel, bucket_abs):
    lengths, costs, inflight, replicas = problem
    kw = {"bucket_rel": bucket_rel, "bucket_abs": bucket_abs}
    cpp = run_packed(lengths, costs, inflight, replicas, backend="cpp", **kw)
    py = run_packed(lengths, costs, inflight, replicas, backend="python", **kw)
    assert_backends_agree(cpp, py)
    assert_packed_groups_fit(cpp, lengths, costs, inflight)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_problems(max_n=30))
def test_work_budget_with_packing(problem):
    lengths, costs, inflight, replicas = problem
    for backend in BACKENDS:
        full = run_packed(lengths, costs, inflight, replicas, bucket_rel=0, backend=backend)
        cut = run_packed(
            lengths, costs, inflight, replicas, bucket_rel=0, work_budget=1, backend=backend
        )
        assert cut.passes == 1 and cut.budget_exhausted == (full.passes > 1)
        assert not full.budget_exhausted and cut.objective >= full.objective
        assert_packed_groups_fit(cut, lengths, costs, inflight)


def two_row_costs() -> PipelineCosts:
    """One stage, rows of 16 tokens; two rows fit the memory, three do not; a micro-batch of
    1, 2, 3 rows takes 1, 1.1, 1.2 (a fixed cost per micro-batch)."""
    rows = np.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    time = np.array([1.0, 1.1, 1.2]).reshape(1, 3, 1, 1)
    return PipelineCosts(
        b_grid=[1, 2, 3],
        s_grid=[16],
        t_grid=[0],
        forward=time / 2,
        backward=time / 2,
        activation=rows * GiB / 2,
        transient=np.zeros_like(rows),
        static=np.zeros(1),
        attention_coef=np.zeros(1),
        hidden_size=8,
        memory_limit=1.0 * GiB,
        p2p_bandwidth=np.ones(0),
        p2p_latency=0.0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_packing_fits_a_micro_batch_that_padding_cannot(backend):
    # Sorted 8, 8, 16: padded, three rows of 16 do not fit: {8, 8} {16} at best (2.1);
    # packed, 16 | 8 8 is two rows: one micro-batch (1.1), rows of the batch's longest (16).
    lengths, costs = np.array([16, 8, 8]), two_row_costs()
    padded = run(lengths, costs, np.ones(1), 1, bucket_rel=0, backend=backend)
    assert sorted(map(len, padded.microbatches)) == [1, 2]
    assert padded.objective == pytest.approx(2.1)
    packed = run_packed(lengths, costs, np.ones(1), 1, bucket_rel=0, backend=backend)
    assert [m.tolist() for m in packed.microbatches] == [[1, 2, 0]]
    assert packed.objective == pytest.approx(1.1) and packed.row_lengths == [16]
    # A fourth sample of 16 needs a third row, over the memory: two micro-batches.
    packed = run_packed(np.array([16, 8, 8, 16]), costs, np.ones(1), 1, bucket_rel=0)
    assert len(packed.microbatches) == 2 and packed.objective == pytest.approx(2.1)


def test_packing_needs_sorted_decoder_only_lengths_and_non_negative_coefficients():
    costs = two_row_costs()
    with pytest.raises(PlanningError, match="sorted by length"):
        run_packed(np.array([16, 8]), costs, np.ones(1), 1, order=np.array([0, 1]))
    with pytest.raises(PlanningError, match="decoder-only"):
        run_packed(np.array([[16, 2]]), costs, np.ones(1), 1)
    negative = dataclasses.replace(costs, attention_coef=np.array([-1.0]))
    with pytest.raises(PlanningError, match="attention coefficients >= 0"):
        run_packed(np.array([8]), negative, np.ones(1), 1)


def test_packing_inputs_leave_out_only_stages_that_cannot_be_slowest():
    rng = np.random.default_rng(5)
    costs, _ = make_costs(rng, 4, False)
    base = costs.forward[0] + costs.backward[0]
    # Stage 1 equals stage 0, stage 2 is faster everywhere and saves more, stage 3 is slower
    # on some shapes only: stages 0 and 3 remain.
    fwd = np.stack([base, base, base * 0.5, base * np.where(base > base.mean(), 1.5, 0.5)])
    coef = np.array([1.0, 1.0, 2.0, 1.0])
    costs = dataclasses.replace(
        costs, forward=fwd, backward=np.zeros_like(fwd), attention_coef=coef
    )
    time, kept = packing_inputs(costs)
    monotone = fwd
    for axis in (1, 2, 3):
        monotone = np.maximum.accumulate(monotone, axis=axis)
    np.testing.assert_array_equal(time, monotone[[0, 3]])
    assert kept.tolist() == [1.0, 1.0]
    for saved in rng.uniform(0.0, 10.0, 20):
        everyone = (monotone - saved * coef.reshape(-1, 1, 1, 1)).max(axis=0)
        np.testing.assert_array_equal(
            (time - saved * kept.reshape(-1, 1, 1, 1)).max(axis=0), everyone
        )


# ---- the planner runs what the DP priced --------------------------------------------------


def test_planner_runs_the_rows_the_dp_priced():
    """Each DynaPipe micro-batch is a contiguous run of the sorted samples packed exactly as
    `packed_group` packs it (the rows the DP priced), and the plan passes the simulator. (A
    long tail up to 8,192 tokens: there the DP's plan beats the packing baseline's.)"""
    rng = np.random.default_rng(4)
    lengths = np.clip(np.exp(rng.normal(np.log(300), 1.5, 200)), 8, 8192).astype(int)
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 80, dp_packing=True)
    plan = planner.plan(lengths)
    check_plan(planner, plan, lengths)
    assert plan.stats["batching"] == "dp over packed rows"
    rank = {int(s): k for k, s in enumerate(order_samples(lengths))}
    for m in plan.microbatches:
        positions = sorted(rank[s] for s in m.samples)
        assert positions == list(range(positions[0], positions[-1] + 1))
        assert m.seqlen in (lengths[m.samples].max(), lengths.max())
        expected = packed_group(Group(np.array(m.samples), m.seqlen), lengths)
        assert sorted(m.row_sizes) == sorted(len(r) for r in expected.rows)
        assert m.attention_saved == expected.attention_saved
    assert any(len(m.row_sizes) < len(m.samples) for m in plan.microbatches)


def test_planner_without_packed_rows_pads():
    rng = np.random.default_rng(4)
    lengths = np.clip(np.exp(rng.normal(np.log(200), 1.2, 120)), 8, 2048).astype(int)
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 36, packed_rows=False, dp_packing=True)
    plan = planner.plan(lengths)
    check_plan(planner, plan, lengths)
    assert plan.stats["batching"] == "dp" and not any(m.row_sizes for m in plan.microbatches)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 2048), min_size=1, max_size=60).map(np.array),
    stages=st.integers(1, 4),
    replicas=st.integers(1, 2),
    memory_gib=st.floats(4, 40),
    max_seqlen=st.sampled_from([0, 2048, 4096]),
)
def test_dp_packing_is_never_predicted_slower_than_packing(
    lengths, stages, replicas, memory_gib, max_seqlen
):
    """With packed rows in the DP's search (the runtime's default), DynaPipe's plan is never
    slower than the packing baseline's (grid-searched micro-batch size, 1F1B) nor than the
    padded DP's (no packed rows): the DP's own plans, or packed rows where they win (they lie
    outside the DP's contiguous groups)."""
    times = {}
    for name, batching, packed_rows in (
        ("dp packing", "dynamic", True), ("padded dp", "dynamic", False),
        ("packing", "packing", True),
    ):  # fmt: skip
        planner = make_planner(
            MODEL_PRESETS["gpt-350m"], stages, replicas, memory_gib, batching=batching,
            schedule="1f1b" if batching == "packing" else "adaptive", dp_packing=True,
            packed_rows=packed_rows, max_seqlen=max_seqlen,
        )  # fmt: skip
        try:
            times[name] = planner.plan(lengths).stats["predicted_iteration_s"]
        except PlanningError:
            times[name] = math.inf
    assert times["dp packing"] <= min(times["packing"], times["padded dp"]) * (1 + 1e-9), times


def test_packed_row_lengths_run_from_a_sixteenth_of_the_sequence_length_to_it():
    assert packed_row_lengths(8192) == [512, 1024, 2048, 4096, 8192]
    assert packed_row_lengths(1000) == [64, 128, 256, 512, 1000]


@settings(max_examples=examples(100), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=50).map(np.array),
    row=st.sampled_from([256, 1024, 4096]),
    size=st.sampled_from([1, 2, 4]),
)
def test_rows_up_to_hold_every_sample_once_padded_to_their_longest_row(lengths, row, size):
    rows = rows_up_to(lengths, row)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    for r in rows:
        assert len(r) == 1 or lengths[r].sum() <= row  # a longer sample has a row of its own
    tokens = [int(lengths[r].sum()) for r in rows]
    assert tokens == sorted(tokens, reverse=True)
    groups = trimmed_rows_groups(rows, lengths, size)
    assert [r for g in groups for r in g.rows] == rows
    for g in groups:
        assert g.seqlen == max(int(lengths[r].sum()) for r in g.rows)
        own = float((lengths[g.samples].astype(float) ** 2).sum())
        assert g.attention_saved == pytest.approx(len(g.rows) * g.seqlen**2 - own)
        assert g.samples.tolist() == [i for r in g.rows for i in r]


def test_short_samples_pack_into_shorter_rows_than_the_baselines():
    """A long-tailed batch under a longer --seq-length: rows shorter than the baseline's hold
    packing's work (each row trimmed to its samples, no padding) in more micro-batches than the
    baseline's full-length rows, so a smaller bubble; DynaPipe's plan takes them where they
    win."""
    rng = np.random.default_rng(5)
    lengths = np.clip(np.exp(rng.normal(np.log(300), 1.0, 60)), 8, 4000).astype(int)
    planner = make_planner(MODEL_PRESETS["gpt-350m"], 2, 1, 80, dp_packing=True, max_seqlen=8192)
    plan = planner.plan(lengths)
    check_plan(planner, plan, lengths)
    assert plan.stats["batching"].startswith("rows up to ")
    assert max(m.seqlen for m in plan.microbatches) < 8192
    assert len(plan.microbatches) > lengths.sum() / 8192 + 1
