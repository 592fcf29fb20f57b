"""Galvatron-BMW pipeline partitions (seed galvatron_bmw.txt §IV-B, Alg. 2, App. B)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner.search.partition import (
    adjustment_moves,
    balanced_partition,
    max_stage,
    prefix_cost,
)


def _costs(layer_time, layer_act, layer_state, num_stages):
    """Stage time, and 1F1B stage memory (stage i of P keeps P - i micro-batches)."""
    time = prefix_cost(layer_time, [1.0] * num_stages)
    memory = prefix_cost(layer_act, [num_stages - i for i in range(num_stages)], layer_state)
    return time, memory


def _all_partitions(layers, stages):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield [bounds[i + 1] - bounds[i] for i in range(stages)]


layer_lists = st.integers(3, 9).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0.1, 10.0), min_size=n, max_size=n),
        st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n),
        st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n),
        st.integers(2, min(4, n)),
    )
)


@settings(max_examples=examples(60), deadline=None)
@given(layer_lists)
def test_balanced_partition_is_min_max(case):
    times, act, state, stages = case
    time, memory = _costs(times, act, state, stages)
    for cost in (time, memory):
        got = balanced_partition(len(times), stages, cost)
        assert sum(got) == len(times) and min(got) >= 1
        best = min(max_stage(p, cost) for p in _all_partitions(len(times), stages))
        assert max_stage(got, cost) <= best * (1 + 1e-6) + 1e-9


@settings(max_examples=examples(80), deadline=None)
@given(layer_lists, st.floats(0.5, 1.5))
def test_adjustment_never_slows_the_slowest_stage_nor_breaks_memory(case, slack):
    """Walk Alg. 2's adjustment from the memory-balanced partition until no move is valid:
    every accepted partition keeps the slowest stage no slower and every stage within the
    budget and the time-balanced partition's peak memory (rules 1-3)."""
    times, act, state, stages = case
    time, memory = _costs(times, act, state, stages)
    p = balanced_partition(len(times), stages, memory)
    budget = max_stage(p, memory) * slack + 1e-9
    cap = max(max_stage(balanced_partition(len(times), stages, time), memory), budget)
    seen = {tuple(p)}
    for _ in range(4 * len(times)):
        moves = adjustment_moves(p, time, memory, budget, cap)
        moves = [m for m in moves if tuple(m) not in seen]
        if not moves:
            break
        nxt = moves[0]
        assert sum(nxt) == len(times) and min(nxt) >= 1
        assert max_stage(nxt, time) <= max_stage(p, time)
        assert max_stage(nxt, memory) <= budget
        assert max_stage(nxt, memory) <= cap
        # exactly one boundary layer moved
        assert sum(abs(a - b) for a, b in zip(nxt, p, strict=True)) == 2
        seen.add(tuple(nxt))
        p = nxt


def test_adjustment_moves_layers_off_the_slow_last_stage():
    # 1F1B: the memory-balanced partition loads the last stage (fewest micro-batches in
    # flight); adjustment moves layers back towards the front while memory allows.
    times, act, state = [1.0] * 9, [1.0] * 9, [0.0] * 9
    time, memory = _costs(times, act, state, 2)
    p = balanced_partition(9, 2, memory)
    assert p == [3, 6]
    budget = 8.0
    moves = adjustment_moves(p, time, memory, budget, 8.0)
    assert moves == [[4, 5]]
    assert max_stage(moves[0], memory) <= budget
    assert adjustment_moves(p, time, memory, 7.0, 8.0) == []  # [4, 5] needs 8 > 7
    assert adjustment_moves(p, time, memory, 8.0, 7.0) == []  # rule 3
