"""Hydraulis dispatch across pipelines (dynapipe_planner.strategy.dispatch): the C++ greedy is
its Python reference, never breaks MaxLen, reports its Eq. 2 objective truly, and is no better
than the exact CP-SAT dispatch, itself checked by brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner._reference.dispatch import dispatch_reference
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.strategy.dispatch import (
    DISPATCH_PRICINGS,
    dispatch,
    dispatch_exact,
    pipeline_bound,
    sequence_times,
)
from dynapipe_planner.strategy.proposal import Strategy
from dynapipe_planner.strategy.schemes import ParallelScheme, SchemeProfile

SHORT, MEDIUM, LONG = ParallelScheme(1, 1), ParallelScheme(1, 2), ParallelScheme(2, 4)


def profile(
    scheme: ParallelScheme, max_len: int, util_len: int, a: float, b: float, c: float
) -> SchemeProfile:
    lengths = np.array([1.0, float(max_len)])
    times = (a * lengths + b) * lengths + c
    return SchemeProfile(scheme, max_len, util_len, (a, b, c), lengths, times)


PROFILES = [
    profile(SHORT, 2000, 300, 4e-9, 2e-4, 0.01),
    profile(MEDIUM, 6000, 500, 2e-9, 1e-4, 0.006),
    profile(LONG, 16000, 900, 5e-10, 3e-5, 0.003),
]

strategies = st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 2)).map(
    lambda d: Strategy.of({SHORT: d[0], MEDIUM: d[1], LONG: d[2]})
)


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.integers(1, 16000), min_size=1, max_size=60),
    strategies,
    st.integers(1, 12),
    st.integers(0, 99),
    st.sampled_from(DISPATCH_PRICINGS),
)
def test_cpp_greedy_equals_the_reference_and_respects_max_len(
    lengths, strategy, trials, seed, pricing
):
    lengths = np.array(lengths)
    fast = dispatch(lengths, strategy, PROFILES, trials=trials, seed=seed, pricing=pricing)
    slow = dispatch_reference(
        lengths, strategy, PROFILES, trials=trials, seed=seed, pricing=pricing
    )
    assert fast.pipelines == slow.pipelines
    assert fast.assignment.tolist() == slow.assignment.tolist()
    assert fast.objective == slow.objective
    max_len = {p.scheme: p.max_len for p in PROFILES}
    by_scheme = {p.scheme: p for p in PROFILES}
    bounds = []
    for j, scheme in enumerate(fast.pipelines):
        mine = lengths[fast.assignment == j]
        assert np.all(mine <= max_len[scheme])
        times = sequence_times(by_scheme[scheme], mine, pricing)
        bounds.append(pipeline_bound(times, scheme.pp))
    assert fast.objective == pytest.approx(max(bounds), rel=1e-12)


def test_packed_pricing_charges_a_short_sequence_its_share_of_a_util_len_row():
    short = PROFILES[1]  # UtilLen 500
    lengths = np.array([50.0, 250.0, 499.0, 500.0, 3000.0])
    packed = short.packed_time(lengths)
    row = float(short.time(500.0))
    np.testing.assert_allclose(packed[:3], lengths[:3] / 500.0 * row, rtol=1e-12)
    np.testing.assert_allclose(packed[3:], short.time(lengths[3:]), rtol=1e-12)
    # Alone, the fixed per-sequence cost makes short sequences dearer than their share.
    assert np.all(packed[:3] < short.time(lengths[:3]))


def test_constant_free_pricing_leaves_out_the_fits_constant_term():
    p = PROFILES[1]
    lengths = np.array([1.0, 50.0, 3000.0])
    a, b, _ = p.coef
    np.testing.assert_allclose(
        sequence_times(p, lengths, "constant_free"), (a * lengths + b) * lengths, rtol=1e-12
    )
    np.testing.assert_allclose(sequence_times(p, lengths, "full"), p.time(lengths), rtol=1e-12)
    with pytest.raises(PlanningError, match="dispatch pricing must be one of"):
        dispatch(lengths, Strategy.of({SHORT: 1}), PROFILES, pricing="paper")


def test_more_trials_never_do_worse():
    lengths = np.random.default_rng(0).integers(50, 8000, size=300)
    strategy = Strategy.of({SHORT: 6, MEDIUM: 2, LONG: 1})
    one = dispatch(lengths, strategy, PROFILES, trials=1, seed=5)
    many = dispatch(lengths, strategy, PROFILES, trials=50, seed=5)  # its first order is one's
    assert many.objective <= one.objective


def brute_force(lengths: np.ndarray, strategy: Strategy) -> float:
    by_scheme = {p.scheme: p for p in PROFILES}
    pipes = sorted(
        (by_scheme[s] for s, d in strategy.pipelines for _ in range(d)),
        key=lambda p: (-p.max_len, p.scheme),
    )
    best = np.inf
    for choice in itertools.product(range(len(pipes)), repeat=len(lengths)):
        choice = np.array(choice)
        bounds = []
        for j, p in enumerate(pipes):
            mine = lengths[choice == j]
            if np.any(mine > p.max_len):
                break
            bounds.append(pipeline_bound(p.time(mine), p.scheme.pp))
        else:
            best = min(best, max(bounds))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_exact_dispatch_is_optimal_and_bounds_the_greedy(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 7000, size=6)
    strategy = Strategy.of({SHORT: 1, MEDIUM: 1, LONG: 1})
    exact = dispatch_exact(lengths, strategy, PROFILES)
    assert exact.objective == pytest.approx(brute_force(lengths, strategy), rel=1e-4)
    greedy = dispatch(lengths, strategy, PROFILES, trials=20, seed=seed)
    assert exact.objective <= greedy.objective * (1 + 1e-4)


def test_sequence_no_pipeline_holds_is_named():
    strategy = Strategy.of({SHORT: 2, MEDIUM: 1})
    with pytest.raises(PlanningError, match=r"sequence 1 \(length 7000\).*MaxLen 6000"):
        dispatch(np.array([100, 7000]), strategy, PROFILES)
    with pytest.raises(PlanningError, match="at least one trial"):
        dispatch(np.array([100]), strategy, PROFILES, trials=0)
