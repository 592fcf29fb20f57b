"""Micro-batching baselines (padding, token budget, packing by first-fit-decreasing) and the
Karmarkar-Karp replica split. Facts about optimal bin counts and partitions are checked against
brute force computed here, not quoted from memory."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner._reference.packing import first_fit_decreasing_reference
from dynapipe_planner.microbatch.baselines import (
    first_fit_decreasing,
    groups_from_indices,
    packing_groups,
    padding_groups,
    token_budget_groups,
)
from dynapipe_planner.microbatch.replicas import karmarkar_karp

SETTINGS = settings(max_examples=examples(100), deadline=None)

lengths_1d = st.lists(st.integers(1, 4096), min_size=1, max_size=60).map(np.array)
lengths_2d = st.lists(st.tuples(st.integers(1, 2048), st.integers(1, 512)), min_size=1, max_size=60)


def all_indices(groups):
    return sorted(int(i) for g in groups for i in g.samples)


# ---- padding -------------------------------------------------------------------------------


@SETTINGS
@given(lengths_1d, st.integers(1, 16))
def test_padding_groups_chunk_in_data_order(lengths, mbs):
    groups = padding_groups(lengths, mbs)
    assert [int(i) for g in groups for i in g.samples] == list(range(len(lengths)))
    assert [len(g.samples) for g in groups[:-1]] == [mbs] * (len(groups) - 1)
    assert 1 <= len(groups[-1].samples) <= mbs
    assert len(groups) == -(-len(lengths) // mbs)
    for g in groups:
        assert g.seqlen == lengths[g.samples].max() and g.tgt_seqlen == 0
        assert g.rows is None and g.num_rows == len(g.samples) and g.attention_saved == 0


def test_padding_groups_encoder_decoder_pad_both_lengths():
    lengths = np.array([[10, 3], [4, 9], [7, 1]])
    groups = padding_groups(lengths, 2)
    assert [(g.seqlen, g.tgt_seqlen) for g in groups] == [(10, 9), (7, 1)]
    assert groups_from_indices(lengths, [np.array([2, 0])])[0].seqlen == 10


# ---- token budget --------------------------------------------------------------------------


def check_token_budget(lengths, budget, order, groups):
    total = lengths.sum(axis=1) if lengths.ndim == 2 else lengths
    # Order preserved and every sample used once.
    assert [int(i) for g in groups for i in g.samples] == [int(i) for i in order]
    for k, g in enumerate(groups):
        padded = len(g.samples) * int(total[g.samples].max())
        assert padded <= budget or len(g.samples) == 1  # a lone oversize sample is allowed
        if k + 1 < len(groups):  # greedy: the next sample would have broken the budget
            nxt = groups[k + 1].samples[0]
            grown = (len(g.samples) + 1) * max(int(total[g.samples].max()), int(total[nxt]))
            assert grown > budget


@SETTINGS
@given(lengths_1d, st.integers(1, 20000), st.booleans())
def test_token_budget_respected_except_single_oversize_samples(lengths, budget, sort):
    order = np.argsort(lengths, kind="stable") if sort else np.arange(len(lengths))
    groups = token_budget_groups(lengths, budget, order)
    check_token_budget(lengths, budget, order, groups)
    for g in groups:
        assert g.seqlen == lengths[g.samples].max()


@SETTINGS
@given(lengths_2d, st.integers(1, 20000))
def test_token_budget_encoder_decoder_counts_source_plus_target(pairs, budget):
    lengths = np.array(pairs)
    order = np.lexsort((lengths[:, 1], lengths[:, 0]))
    groups = token_budget_groups(lengths, budget, order)
    check_token_budget(lengths, budget, order, groups)
    for g in groups:
        assert g.seqlen == lengths[g.samples, 0].max()
        assert g.tgt_seqlen == lengths[g.samples, 1].max()


def test_token_budget_example():
    lengths = np.array([100, 900, 100, 300, 250])
    order = np.argsort(lengths, kind="stable")  # 0, 2, 4, 3, 1
    groups = token_budget_groups(lengths, 800, order)
    # [100, 100, 250] pads to 750; adding 300 would pad to 1200; 900 alone exceeds the budget.
    assert [g.samples.tolist() for g in groups] == [[0, 2, 4], [3], [1]]
    # Exactly at the budget still fits.
    groups = token_budget_groups(lengths, 750, order)
    assert [g.samples.tolist() for g in groups] == [[0, 2, 4], [3], [1]]
    groups = token_budget_groups(lengths, 749, order)
    assert [g.samples.tolist() for g in groups] == [[0, 2], [4, 3], [1]]


# ---- first-fit-decreasing ------------------------------------------------------------------


def optimal_bin_count(sizes, capacity):
    """Fewest bins by exhaustive search (largest item first, symmetric bins pruned)."""
    sizes = sorted(sizes, reverse=True)

    def fits(k):
        loads = [0] * k

        def place(i):
            if i == len(sizes):
                return True
            seen = set()
            for b in range(k):
                if loads[b] + sizes[i] <= capacity and loads[b] not in seen:
                    seen.add(loads[b])
                    loads[b] += sizes[i]
                    if place(i + 1):
                        return True
                    loads[b] -= sizes[i]
            return False

        return place(0)

    lower = max(1, -(-sum(sizes) // capacity))
    return next(k for k in range(lower, len(sizes) + 1) if fits(k))


def test_optimal_bin_count_brute_force_is_right_on_known_cases():
    assert optimal_bin_count([5, 5, 5, 5], 10) == 2
    assert optimal_bin_count([6, 6, 6], 10) == 3
    assert optimal_bin_count([7, 3, 6, 4, 5, 5], 10) == 3
    # FFD's classic bad case: 2x(1/2+e), 2x(1/4+2e), 2x(1/4+e), 4x(1/4-2e) in units of 1/100
    assert optimal_bin_count([51, 51, 27, 27, 26, 26, 23, 23, 23, 23], 100) == 3


def check_ffd(sizes, capacity, bins):
    sizes = np.asarray(sizes)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    loads = [int(sizes[b].sum()) for b in bins]
    assert all(load <= capacity for load in loads)
    assert all(b for b in bins)
    # First fit: an item opening bin j fits in no earlier bin, so any two bins overflow together.
    for i, j in itertools.combinations(range(len(bins)), 2):
        assert loads[i] + loads[j] > capacity
    # Decreasing: inside every bin, items arrive largest first (stable for ties).
    for b in bins:
        assert all(sizes[x] >= sizes[y] for x, y in itertools.pairwise(b))
    # Replay: taken largest first, each item sits in the first bin with room for it then.
    where = {i: k for k, b in enumerate(bins) for i in b}
    running = [0] * len(bins)
    for i in np.argsort(-sizes, kind="stable"):
        k = where[int(i)]
        assert all(running[m] + sizes[i] > capacity for m in range(k)), (int(i), k, running)
        running[k] += int(sizes[i])
    return loads


@SETTINGS
@given(st.lists(st.integers(1, 100), min_size=1, max_size=9), st.integers(100, 160))
def test_ffd_is_within_the_known_bound_of_optimal(sizes, capacity):
    bins = first_fit_decreasing(np.array(sizes), capacity)
    check_ffd(sizes, capacity, bins)
    opt = optimal_bin_count(sizes, capacity)
    assert opt <= len(bins) <= 11 / 9 * opt + 6 / 9


@SETTINGS
@given(st.lists(st.integers(1, 200), max_size=120), st.integers(1, 300))
def test_ffd_core_matches_reference(sizes, capacity):
    """The C++ core's bins equal the readable reference's, samples longer than a row included."""
    lengths = np.array(sizes, dtype=np.int64)
    assert first_fit_decreasing(lengths, capacity) == first_fit_decreasing_reference(
        lengths, capacity
    )


def test_ffd_example():
    assert first_fit_decreasing(np.array([3, 6, 4, 5]), 10) == [[1, 2], [3, 0]]


def test_ffd_on_its_classic_bad_case_uses_one_bin_more_than_optimal():
    sizes = [51, 51, 27, 27, 26, 26, 23, 23, 23, 23]
    bins = first_fit_decreasing(np.array(sizes), 100)
    check_ffd(sizes, 100, bins)
    assert len(bins) == optimal_bin_count(sizes, 100) + 1 == 4


@SETTINGS
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=200), st.integers(4096, 8192))
def test_ffd_bins_never_exceed_capacity(sizes, capacity):
    bins = first_fit_decreasing(np.array(sizes), capacity)
    loads = check_ffd(sizes, capacity, bins)
    assert len(bins) >= -(-sum(sizes) // capacity)
    assert sum(load <= capacity // 2 for load in loads) <= 1  # at most one bin half-empty


# ---- packing -------------------------------------------------------------------------------


@SETTINGS
@given(
    st.lists(st.integers(1, 3000), min_size=1, max_size=80),
    st.integers(256, 2048),
    st.integers(1, 8),
)
def test_packing_groups(lengths, max_seqlen, mbs):
    lengths = np.array(lengths)
    groups = packing_groups(lengths, max_seqlen, mbs)
    assert all_indices(groups) == list(range(len(lengths)))
    clipped = np.minimum(lengths, max_seqlen)
    rows = [r for g in groups for r in g.rows]
    assert rows == first_fit_decreasing(clipped, max_seqlen)  # rows are the FFD bins, in order
    assert [g.num_rows for g in groups[:-1]] == [mbs] * (len(groups) - 1)
    assert 1 <= groups[-1].num_rows <= mbs
    for g in groups:
        assert g.seqlen == max_seqlen
        assert sorted(g.samples.tolist()) == sorted(i for r in g.rows for i in r)
        for r in g.rows:
            assert clipped[r].sum() <= max_seqlen
        # Block-diagonal attention skips everything but each sample's own square.
        saved = sum(max_seqlen**2 - sum(int(clipped[i]) ** 2 for i in r) for r in g.rows)
        assert g.attention_saved == pytest.approx(saved, rel=1e-12)
        assert g.attention_saved >= 0


def test_packing_clips_oversize_samples_and_rejects_encoder_decoder():
    groups = packing_groups(np.array([5000, 100, 300]), 1024, 4)
    assert len(groups) == 1 and groups[0].rows == [[0], [2, 1]]
    assert groups[0].attention_saved == 0 + (1024**2 - 300**2 - 100**2)
    with pytest.raises(ValueError, match="decoder-only"):
        packing_groups(np.array([[5, 3]]), 1024, 1)


# ---- Karmarkar-Karp ------------------------------------------------------------------------


def brute_force_max_sum(times, k):
    best = float("inf")
    for labels in itertools.product(range(k), repeat=len(times)):
        sums = [0.0] * k
        for t, lab in zip(times, labels, strict=True):
            sums[lab] += t
        best = min(best, max(sums))
    return best


def round_robin_max_sum(times, k):
    sums = [0.0] * k
    for i, t in enumerate(sorted(times, reverse=True)):
        sums[i % k] += t
    return max(sums)


def kk_max_sum(times, parts):
    return max(sum(times[i] for i in p) for p in parts)


def check_partition(times, k, parts):
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(times)))
    assert all(p == sorted(p) for p in parts)
    sums = [sum(times[i] for i in p) for p in parts]
    assert all(a >= b * (1 - 1e-12) for a, b in itertools.pairwise(sums))  # heaviest first


@SETTINGS
@given(
    st.lists(st.floats(0.001, 100.0) | st.integers(1, 20).map(float), min_size=0, max_size=30),
    st.integers(1, 6),
)
def test_karmarkar_karp_partitions_and_beats_round_robin(times, k):
    parts = karmarkar_karp(np.array(times), k)
    check_partition(times, k, parts)
    if times:
        assert kk_max_sum(times, parts) <= round_robin_max_sum(times, k) * (1 + 1e-12)
        assert kk_max_sum(times, parts) >= max(max(times), sum(times) / k) * (1 - 1e-12)


@SETTINGS
@given(st.lists(st.integers(1, 50), min_size=1, max_size=7), st.integers(2, 3))
def test_karmarkar_karp_is_never_better_than_the_optimum(times, k):
    parts = karmarkar_karp(np.array(times, float), k)
    assert kk_max_sum(times, parts) >= brute_force_max_sum(times, k)


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=4))
def test_karmarkar_karp_two_way_is_optimal_up_to_four_items(times):
    parts = karmarkar_karp(np.array(times, float), 2)
    check_partition(times, 2, parts)
    assert kk_max_sum(times, parts) == brute_force_max_sum(times, 2)


def test_karmarkar_karp_on_4_to_8():
    times = [4.0, 5.0, 6.0, 7.0, 8.0]
    three = karmarkar_karp(np.array(times), 3)
    assert kk_max_sum(times, three) == brute_force_max_sum(times, 3) == 11
    # Two ways: largest differencing is a heuristic, and this is where it misses (16 vs 15),
    # though it still beats round robin on sorted input (8+6+4 = 18).
    two = karmarkar_karp(np.array(times), 2)
    assert brute_force_max_sum(times, 2) == 15
    assert 15 <= kk_max_sum(times, two) <= round_robin_max_sum(times, 2) == 18


def test_karmarkar_karp_degenerate_cases():
    assert karmarkar_karp(np.array([3.0, 1.0, 2.0]), 1) == [[0, 1, 2]]
    assert karmarkar_karp(np.array([]), 3) == [[], [], []]
    assert karmarkar_karp(np.array([5.0]), 3) == [[0], [], []]
    parts = karmarkar_karp(np.array([1.0, 1.0, 1.0, 1.0]), 4)
    assert sorted(map(tuple, parts)) == [(0,), (1,), (2,), (3,)]
