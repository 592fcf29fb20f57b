"""The online fit of iteration times (`dynapipe_planner.online_fit`): exact where the times are
its model, optimal under its constraints (checked by the convex problem's optimality
conditions), robust to a disturbed iteration, and honest (a prediction never saw its own
measurement)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.online_fit import (
    IterationTimeFit,
    PlanFeatures,
    huber_nonnegative,
    nonnegative_least_squares,
)


def _features(rng: np.random.Generator, n: int) -> list[PlanFeatures]:
    return [PlanFeatures(float(rng.uniform(0.5, 3.0)), int(rng.integers(2, 20))) for _ in range(n)]


def test_recovers_times_that_follow_its_model() -> None:
    rng = np.random.default_rng(0)
    fit = IterationTimeFit(prior_weight=0.0)
    a, b, c = 1.3, 0.035, 0.2
    for f in _features(rng, 12):
        fit.observe(f, a * f.predicted_s + b * f.microbatches + c, fit.predict(f))
    assert fit.coefficients == pytest.approx((a, b, c), rel=1e-6)
    assert fit.predict(PlanFeatures(2.0, 8)) == pytest.approx(a * 2 + b * 8 + c)


def test_starts_from_the_planner_and_converges_to_the_job() -> None:
    """With its prior, three iterations move the prediction part of the way from the
    planner's towards the job's times, fifty most of the way."""
    rng = np.random.default_rng(2)
    probe = PlanFeatures(2.0, 8)
    truth = 1.3 * 2.0 + 0.035 * 8 + 0.2
    fit = IterationTimeFit()
    gaps = []
    for f in _features(rng, 50):
        fit.observe(f, 1.3 * f.predicted_s + 0.035 * f.microbatches + 0.2, fit.predict(f))
        if fit.observed in (3, 50):
            gaps.append(abs(fit.predict(probe) - truth) / truth)
    assert 0.0 < gaps[1] < 0.05 < gaps[0] < abs(probe.predicted_s - truth) / truth


def test_no_prediction_before_enough_iterations_and_errors_are_out_of_sample() -> None:
    fit = IterationTimeFit(min_iterations=3, prior_weight=0.0)
    f = PlanFeatures(1.0, 4)
    for _ in range(2):
        assert fit.predict(f) is None
        fit.observe(f, 2.0, fit.predict(f))
    assert fit.median_error() is None  # nothing was predicted yet
    fit.observe(f, 2.0, None)
    assert fit.predict(f) == pytest.approx(2.0)
    fit.observe(f, 2.5, fit.predict(f))  # predicted 2.0 before seeing 2.5
    assert fit.errors == [pytest.approx(0.2)]


def test_a_disturbed_iteration_barely_moves_the_fit() -> None:
    rng = np.random.default_rng(1)
    features = _features(rng, 20)
    times = [1.1 * f.predicted_s + 0.02 * f.microbatches + 0.1 for f in features]
    noisy = [t * float(rng.uniform(0.98, 1.02)) for t in times]
    noisy[7] *= 4.0  # another job took the cores for this one
    rows = np.array([f.row() for f in features])
    robust = huber_nonnegative(rows, np.array(noisy))
    plain = nonnegative_least_squares(rows, np.array(noisy), np.ones(len(noisy)))
    probe = PlanFeatures(2.0, 10).row()
    truth = 1.1 * 2.0 + 0.02 * 10 + 0.1
    assert abs(probe @ robust - truth) / truth < 0.03
    assert abs(probe @ plain - truth) > 3 * abs(probe @ robust - truth)


@settings(max_examples=examples(60), deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(3, 25),
    coef=st.tuples(*(st.floats(-1.0, 2.0) for _ in range(3))),
)
def test_nonnegative_least_squares_meets_the_optimality_conditions(seed, n, coef) -> None:
    """Convex problem, so the Karush-Kuhn-Tucker conditions prove the optimum: w >= 0, the
    gradient >= 0 where w = 0 and 0 where w > 0 (the times may follow negative coefficients,
    which the fit must not take)."""
    rng = np.random.default_rng(seed)
    x = np.column_stack([rng.uniform(0.1, 3, n), rng.integers(1, 30, n).astype(float), np.ones(n)])
    y = x @ np.array(coef) + rng.normal(0, 0.05, n)
    weights = rng.uniform(0.2, 1.0, n)
    w = nonnegative_least_squares(x, y, weights)
    assert np.all(w >= 0)
    gradient = x.T @ (weights * (x @ w - y))
    scale = np.abs(x.T @ (weights * y)).max() + 1.0
    tolerance = 1e-7 * scale
    assert np.all(gradient >= -tolerance)
    assert np.all(np.abs(gradient[w > 1e-12]) <= tolerance)


def test_plan_features_count_the_busiest_replica() -> None:
    from dynapipe_planner.plan import ExecutionPlan, MicroBatch

    mbs = [MicroBatch(k, replica, [k], 128) for k, replica in enumerate([0, 0, 0, 1, 1])]
    plan = ExecutionPlan(1, 2, mbs, [], {"predicted_iteration_s": 0.5})
    assert PlanFeatures.of(plan) == PlanFeatures(0.5, 3)
