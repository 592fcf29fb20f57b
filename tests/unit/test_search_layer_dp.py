"""Galvatron-BMW layer DP (seed galvatron_bmw.txt §IV-A2, Eq. 4, App. A): C++ == Python, and
both == exhaustive enumeration of every strategy assignment on small stages."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dynapipe_planner import _core
from dynapipe_planner._reference.layer_dp import (
    layer_dp_reference,
    layer_dp_table_reference,
    solve_stage_reference,
)
from dynapipe_planner.search.layer_dp import (
    solve_stage,
)

INF = math.inf


def _instance(rng: np.random.Generator, layers: int, strategies: int, infeasible: float = 0.1):
    objective = rng.uniform(1.0, 10.0, (layers, strategies))
    objective[rng.random((layers, strategies)) < infeasible] = INF
    weight = rng.integers(0, 6, (layers, strategies))
    transform = rng.uniform(0.0, 2.0, (layers, strategies, strategies))
    for s in range(strategies):
        transform[:, s, s] = 0.0
    fwd = weight * 1.0 + rng.uniform(0, 0.5, (layers, strategies))
    bwd = rng.uniform(0.0, 4.0, (layers, strategies))
    states = rng.uniform(0.0, 1.0, (layers, strategies))
    return objective, weight.astype(np.int64), transform, fwd, bwd, states


def _assignment_cost(objective, transform, chosen):
    total = 0.0
    for layer, s in enumerate(chosen):
        if layer:
            total += transform[layer][chosen[layer - 1]][s]
        total += objective[layer][s]
    return total


def _peak(fwd, bwd, states, chosen):
    running = peak = total = 0.0
    for layer, j in enumerate(chosen):
        running += fwd[layer][j]
        peak = max(peak, running + bwd[layer][j])
        total += states[layer][j]
    return peak + total


@pytest.mark.parametrize("seed", range(6))
def test_table_equals_exhaustive_enumeration(seed):
    """C(L, e) for every forward budget e is the least cost over all |S|^L assignments whose
    forward memory (in bins) is at most e, transformation costs included."""
    rng = np.random.default_rng(seed)
    layers, strategies, budget = 4, 3, 14
    objective, weight, transform, *_ = _instance(rng, layers, strategies)
    table = _core.layer_dp_table(objective, weight, transform, budget)
    reference = layer_dp_table_reference(
        objective.tolist(), weight.tolist(), transform.tolist(), budget
    )
    assert list(table) == reference  # bit-identical
    best = [INF] * (budget + 1)
    for chosen in itertools.product(range(strategies), repeat=layers):
        used = sum(weight[layer][s] for layer, s in enumerate(chosen))
        cost = _assignment_cost(objective, transform, chosen)
        for e in range(used, budget + 1):
            best[e] = min(best[e], cost)
    np.testing.assert_allclose(table, best, rtol=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_search_matches_python_and_exhaustive(seed):
    """Algorithm 3: the plan at the largest forward budget that passes the Eq. 2 check; C++
    and Python agree exactly, the plan is the cheapest one within that forward budget, fits
    the memory limit, and with no backward memory it is the global optimum."""
    rng = np.random.default_rng(100 + seed)
    layers, strategies = 4, 3
    objective, weight, transform, fwd, bwd, states = _instance(rng, layers, strategies)
    if seed % 2:
        bwd = np.zeros_like(bwd)
    budget = 12
    limit = float(budget) + 1.0
    unchecked = math.floor(limit - bwd.max()) if limit >= bwd.max() else -1
    got = _core.layer_dp_search(
        objective, weight, transform, fwd, bwd, states, budget, limit, unchecked
    )
    ref = layer_dp_reference(
        objective.tolist(), weight.tolist(), transform.tolist(), fwd.tolist(), bwd.tolist(),
        states.tolist(), budget, limit, unchecked,
    )  # fmt: skip
    assert (got[0], list(got[1]), got[2]) == (ref[0], ref[1], ref[2])
    cost, chosen, e = ref
    if not chosen:
        return
    assert sum(weight[layer][s] for layer, s in enumerate(chosen)) <= e
    assert _peak(fwd, bwd, states, chosen) <= limit or e <= unchecked
    assert cost == pytest.approx(_assignment_cost(objective, transform, chosen))
    within = [
        _assignment_cost(objective, transform, c)
        for c in itertools.product(range(strategies), repeat=layers)
        if sum(weight[layer][s] for layer, s in enumerate(c)) <= e
    ]
    assert cost == pytest.approx(min(within))
    if seed % 2:  # forward memory is all there is: the DP answer is the exhaustive optimum
        feasible = [
            _assignment_cost(objective, transform, c)
            for c in itertools.product(range(strategies), repeat=layers)
            if sum(weight[layer][s] for layer, s in enumerate(c)) <= budget
        ]
        assert cost == pytest.approx(min(feasible))


def test_cpp_equals_python_on_larger_random_stages():
    rng = np.random.default_rng(7)
    for _ in range(3):
        objective, weight, transform, fwd, bwd, states = _instance(rng, 9, 6)
        args = (objective, weight, transform, fwd, bwd, states, 30, 28.0, 20)
        got = _core.layer_dp_search(*args)
        lists = [a.tolist() for a in args[:6]]
        ref = layer_dp_reference(*lists, 30, 28.0, 20)
        assert (got[0], list(got[1]), got[2]) == ref


def test_nothing_fits_returns_empty():
    objective = np.ones((2, 2))
    weight = np.full((2, 2), 5, dtype=np.int64)
    transform = np.zeros((2, 2, 2))
    z = np.zeros((2, 2))
    cost, chosen, e = _core.layer_dp_search(objective, weight, transform, z, z, z, 9, 9.0, 9)
    assert (cost, list(chosen), e) == (INF, [], -1)
    with pytest.raises(ValueError, match="do not match"):
        _core.layer_dp_table(objective, weight, np.zeros((2, 3, 3)), 4)


def test_solve_stage_uses_real_tables_identically(tiny_tables):
    cpp = solve_stage(tiny_tables, 8e9, 8e9 / 64)
    py = solve_stage_reference(tiny_tables, 8e9, 8e9 / 64)
    assert cpp is not None and cpp == py
    assert cpp.peak_bytes <= 8e9


@pytest.fixture
def tiny_tables():
    from dynapipe_planner.cluster import get_gpu
    from dynapipe_planner.model_spec import MODEL_PRESETS
    from dynapipe_planner.search import analytic_cost_inputs, strategy_space
    from dynapipe_planner.search.estimator import Estimator

    model = MODEL_PRESETS["gpt-125m"]
    inputs = analytic_cost_inputs(model, get_gpu("A100-40GB"), 4, seq_length=512)
    strategies = [s for s in strategy_space(4)[1] if inputs.supports(s)]
    return Estimator(inputs, strategies).stage_tables(range(6), 0, 8, 2)


def test_equal_cost_mixes_come_out_as_runs():
    """Eight identical layers, two strategies (fast and big, slow and small) and a budget
    that forces four of each: every order costs the same (up to rounding), and the DP keeps
    the previous layer's strategy on ties, so the plan has a single switch."""
    layers = 8
    objective = np.tile([0.1, 0.3], (layers, 1))
    weight = np.tile([2, 1], (layers, 1)).astype(np.int64)
    transform = np.zeros((layers, 2, 2))
    fwd = weight.astype(np.float64)
    zero = np.zeros((layers, 2))
    args = (objective, weight, transform, fwd, zero, zero, 12, 12.0, 12)
    cost, chosen, _ = _core.layer_dp_search(*args)
    ref = layer_dp_reference(*[a.tolist() for a in args[:6]], 12, 12.0, 12)
    assert (cost, list(chosen)) == (ref[0], ref[1])
    assert sorted(chosen) == [0] * 4 + [1] * 4
    assert sum(a != b for a, b in itertools.pairwise(chosen)) == 1
    assert cost == pytest.approx(4 * 0.1 + 4 * 0.3)


def test_layout_classes_equal_per_strategy_minimum():
    """Strategies with identical transformation rows are minimised as one class; the values
    equal the per-strategy recurrence (checked against exhaustive enumeration)."""
    rng = np.random.default_rng(3)
    layers, strategies, budget = 4, 4, 14
    objective, weight, transform, *_ = _instance(rng, layers, strategies)
    transform[:, 1, :] = transform[:, 0, :]  # strategies 0 and 1 share a layout
    transform[:, 3, :] = transform[:, 2, :]
    table = _core.layer_dp_table(objective, weight, transform, budget)
    best = [INF] * (budget + 1)
    for chosen in itertools.product(range(strategies), repeat=layers):
        used = sum(weight[layer][s] for layer, s in enumerate(chosen))
        cost = _assignment_cost(objective, transform, chosen)
        for e in range(used, budget + 1):
            best[e] = min(best[e], cost)
    np.testing.assert_allclose(table, best, rtol=1e-12)


def test_prefix_solver_equals_the_reference_on_every_prefix():
    """One prefix DP (C++) answers every stage length exactly as the plain-Python reference
    run on that range alone; here on a T5 stage whose encoder and decoder layers differ."""
    from dynapipe_planner.cluster import get_gpu
    from dynapipe_planner.model_spec import MODEL_PRESETS
    from dynapipe_planner.search import analytic_cost_inputs, strategy_space
    from dynapipe_planner.search.estimator import Estimator
    from dynapipe_planner.search.layer_dp import StageSolver

    model = MODEL_PRESETS["t5-large-32"]
    inputs = analytic_cost_inputs(model, get_gpu("A100-40GB"), 4, seq_length=512)
    strategies = [s for s in strategy_space(4)[2] if inputs.supports(s)]
    est = Estimator(inputs, strategies)
    first = 12  # the decoder starts at layer 16
    tables = est.stage_tables(range(first, inputs.num_layers), 0, 8, 4)
    budget = 6e9
    solver = StageSolver(tables, budget, budget / 64)
    for n in (9, 1, 4, 10, 7):  # in any order
        rows = est.stage_tables(range(first, first + n), 0, 8, 4)
        assert solver.solve(n) == solve_stage_reference(rows, budget, budget / 64)
