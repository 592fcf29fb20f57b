"""Hydraulis packing within a pipeline (dynapipe_planner.strategy.packing): every sequence
packed once within MaxLen, V from the pruned range, CP-SAT optimal against brute force, and the
default heuristic never better than the exact packing; the C++ LPT is its Python reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner._reference.packing import pack_pipeline_reference
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.strategy.packing import (
    micro_batch_range,
    pack_exact,
    pack_pipeline,
)
from dynapipe_planner.strategy.schemes import ParallelScheme, SchemeProfile


def profile(max_len: int, util_len: int, pp: int = 4) -> SchemeProfile:
    a, b, c = 2e-9, 1e-4, 5e-3
    lengths = np.array([1.0, float(max_len)])
    times = (a * lengths + b) * lengths + c
    return SchemeProfile(ParallelScheme(1, pp), max_len, util_len, (a, b, c), lengths, times)


@settings(max_examples=examples(80), deadline=None)
@given(
    st.lists(st.integers(1, 4000), min_size=1, max_size=60),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([(4000, 500), (6000, 64), (4000, 4000)]),
)
def test_cpp_lpt_equals_the_python_reference(lengths, pp, limits):
    p = profile(*limits, pp)
    lengths = np.array(lengths)
    reference = pack_pipeline_reference(lengths, p)
    packing = pack_pipeline(lengths, p)
    if reference is None:  # no count of the range fits: one micro-batch per sequence
        assert packing.microbatches == tuple((i,) for i in range(len(lengths)))
    else:
        assert packing == reference


@settings(max_examples=examples(80), deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=40), st.sampled_from([1, 2, 4, 8]))
def test_lpt_packs_every_sequence_once_within_max_len(lengths, pp):
    lengths = np.array(lengths)
    p = profile(4000, 500, pp)
    packing = pack_pipeline(lengths, p)
    flat = sorted(i for mb in packing.microbatches for i in mb)
    assert flat == list(range(len(lengths)))
    assert all(lengths[list(mb)].sum() <= p.max_len for mb in packing.microbatches)
    times = p.time(lengths.astype(float))
    slowest = max(times[list(mb)].sum() for mb in packing.microbatches)
    assert packing.objective == pytest.approx(slowest * (pp - 1 + len(packing.microbatches)))
    # V outside the pruned range is never produced, except the one-per-sequence fallback.
    v = len(packing.microbatches)
    assert v in micro_batch_range(lengths, p) or v == len(lengths)


def brute_force_slowest(times: np.ndarray, lengths: np.ndarray, max_len: int, count: int):
    """The slowest micro-batch of the best assignment of every sequence to one of `count`
    micro-batches within `max_len` tokens each (inf: none fits), over all count^n of them."""
    choices = np.array(list(itertools.product(range(count), repeat=len(times))))
    member = choices[:, :, None] == np.arange(count)  # (assignment, sequence, micro-batch)
    tokens = np.einsum("asm,s->am", member, np.asarray(lengths, dtype=np.int64))
    slowest = np.einsum("asm,s->am", member, np.asarray(times, dtype=np.float64)).max(axis=1)
    fits = (tokens <= max_len).all(axis=1)
    return float(slowest[fits].min()) if fits.any() else np.inf


@pytest.mark.parametrize("seed", range(6))
def test_cp_sat_packing_is_optimal_for_each_v(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 1500, size=7)
    p = profile(2000, 300)
    times = p.time(lengths.astype(float))
    for count in (2, 3, 4):
        bins, proved = pack_exact(times, lengths, p.max_len, count, work_limit=10)
        expected = brute_force_slowest(times, lengths, p.max_len, count)
        assert proved
        if not np.isfinite(expected):
            assert bins is None
            continue
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(lengths[b].sum() <= p.max_len for b in bins)
        assert max(times[b].sum() for b in bins) == pytest.approx(expected, abs=4e-6)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("pp", [1, 3])
def test_exact_packing_is_eq1_optimum_over_the_v_range(seed, pp):
    """pack_pipeline(method="exact") against brute force over every V of the App. C range and
    every assignment: min over V of (slowest micro-batch) x (PP - 1 + V)."""
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(60, 1200, size=6)
    p = profile(1800, 200, pp)
    times = p.time(lengths.astype(float))
    expected = min(
        brute_force_slowest(times, lengths, p.max_len, v) * (pp - 1 + v)
        for v in micro_batch_range(lengths, p)
    )
    packing = pack_pipeline(lengths, p, method="exact", work_limit=10)
    assert packing.optimal
    assert packing.objective == pytest.approx(expected, abs=4e-6 * (pp + len(lengths)))
    lpt = pack_pipeline(lengths, p)
    assert not lpt.optimal and lpt.objective >= packing.objective * (1 - 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_heuristic_is_never_better_than_exact(seed):
    lengths = np.random.default_rng(seed).integers(50, 1800, size=9)
    p = profile(2000, 400, pp=2)
    lpt = pack_pipeline(lengths, p)
    exact = pack_pipeline(lengths, p, method="exact", work_limit=10)
    assert exact.objective <= lpt.objective * (1 + 1e-5)


def test_micro_batch_range_follows_appendix_c():
    p = profile(4000, 500)
    assert micro_batch_range(np.array([1000] * 10), p) == range(3, 11)  # 10000/4000 .. U = 10
    assert micro_batch_range(np.array([100] * 50), p) == range(2, 11)  # 5000/4000 .. 5000/500
    assert micro_batch_range(np.array([100, 100]), p) == range(1, 2)  # never empty


def test_bad_packing_input_is_named():
    p = profile(2000, 300)
    with pytest.raises(PlanningError, match=r"sequence 1 \(length 2500\) exceeds MaxLen 2000"):
        pack_pipeline(np.array([10, 2500]), p)
    with pytest.raises(PlanningError, match="packing method"):
        pack_pipeline(np.array([10]), p, method="greedy")
    assert pack_pipeline(np.array([], dtype=np.int64), p).microbatches == ()
