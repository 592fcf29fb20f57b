"""Pipeline schedules (dynapipe_planner.schedule): C++ core against the Python references and
the properties DynaPipe §5 promises (memory limit, injection cap, ordering, search)."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner import _core
from dynapipe_planner._reference.schedules import (
    adaptive_candidates_reference,
    adaptive_schedule_reference,
    one_f_one_b_reference,
    peak_activation_reference,
    timeline_reference,
)
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.schedule import (
    adaptive_schedule,
    cluster_permutations,
    makespan_lower_bound,
    memory_time_lower_bound,
    one_f_one_b,
    peak_activation,
    search_schedule,
    timeline,
)

FAST = settings(max_examples=examples(150), deadline=None)


def random_pipeline(seed: int, num_mb: int, num_stages: int) -> dict[str, np.ndarray]:
    """Costs with a spread like variable-length micro-batches (a few long, many short)."""
    rng = np.random.default_rng(seed)
    size = rng.lognormal(0.0, 0.7, size=(num_mb, 1))
    forward = size * rng.uniform(0.8, 1.2, size=(num_mb, num_stages))
    return {
        "forward": forward,
        "backward": 2 * forward,
        "activation": size * rng.uniform(0.5, 1.5, size=(num_mb, num_stages)) * 1e6,
        "act_comm": 0.05 * size * np.ones((num_mb, num_stages - 1)),
        "grad_comm": 0.05 * size * np.ones((num_mb, num_stages - 1)),
    }


def random_stage_order(num_mb: int, seed: int) -> list[int]:
    """A random order valid on its own stage (each backward after its forward)."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    ready = list(range(0, 2 * num_mb, 2))
    while ready:
        code = ready.pop(int(rng.integers(len(ready))))
        order.append(code)
        if code % 2 == 0:
            ready.append(code + 1)
    return order


def times_of(costs: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    return tuple(costs[k] for k in ("forward", "backward", "act_comm", "grad_comm"))


def outcome(fn, *args):
    """Result of a call, or the message of its PlanningError, for comparing two implementations."""
    try:
        return fn(*args)
    except PlanningError as err:
        return f"PlanningError: {err}"


def assert_complete(orders: list[list[int]], num_mb: int) -> None:
    for order in orders:
        assert sorted(order) == list(range(2 * num_mb))
        for m in range(num_mb):
            assert order.index(2 * m) < order.index(2 * m + 1)


pipelines = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 12), st.integers(1, 5)).map(
    lambda t: (random_pipeline(*t), t[1], t[2])
)


# C++ == Python reference -------------------------------------------------------------------


@FAST
@given(st.integers(1, 8), st.integers(0, 20))
def test_one_f_one_b_matches_reference(num_stages, num_mb):
    orders = one_f_one_b(num_stages, num_mb)
    assert orders == one_f_one_b_reference(num_stages, num_mb)
    assert_complete(orders, num_mb)


@FAST
@given(
    pipelines,
    st.floats(0.3, 6.0),
    st.sampled_from([None, 1, 2, 3, 5]),
    st.sampled_from([0.0, 0.3, 1.0]),
    st.integers(0, 2**32 - 1),
)
def test_adaptive_matches_reference(pipeline, limit_scale, max_inflight, working, seed):
    costs, num_mb, num_stages = pipeline
    limit = np.full(num_stages, limit_scale * 1e6)
    transient = np.random.default_rng(seed).uniform(0, working * 1e6, (num_mb, num_stages))
    args = (costs["activation"], limit, max_inflight, transient)
    assert outcome(adaptive_schedule, *args) == outcome(adaptive_schedule_reference, *args)


@FAST
@given(pipelines, st.sampled_from(["1f1b", "adaptive", "random"]), st.integers(0, 2**32 - 1))
def test_timeline_matches_reference(pipeline, which, seed):
    costs, num_mb, num_stages = pipeline
    if which == "1f1b":
        orders = one_f_one_b(num_stages, num_mb)
    else:
        orders = adaptive_schedule(costs["activation"], np.full(num_stages, np.inf), 3)
    if which == "random":  # often deadlocks across stages: both must fail with the same message
        orders = [random_stage_order(num_mb, seed + stage) for stage in range(num_stages)]
    fast = outcome(timeline, orders, *times_of(costs))
    slow = outcome(timeline_reference, orders, *times_of(costs))
    if isinstance(slow, str):
        assert fast == slow
        return
    np.testing.assert_allclose(fast.start, slow.start, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast.end, slow.end, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast.busy, slow.busy, rtol=0, atol=1e-12)
    assert fast.makespan == pytest.approx(slow.makespan, abs=1e-12)


@FAST
@given(pipelines, st.sampled_from(["1f1b", "adaptive", "random"]), st.integers(0, 2**32 - 1))
def test_peak_activation_matches_reference(pipeline, which, seed):
    costs, num_mb, num_stages = pipeline
    act = costs["activation"]
    transient = act * np.random.default_rng(seed).uniform(0.0, 2.0, act.shape)
    if which == "1f1b":
        orders = one_f_one_b(num_stages, num_mb)
    elif which == "adaptive":
        orders = adaptive_schedule(act, np.full(num_stages, np.inf), 2)
    else:
        orders = [random_stage_order(num_mb, seed + stage) for stage in range(num_stages)]
    fast = peak_activation(orders, act, transient)
    assert fast.tolist() == peak_activation_reference(orders, act, transient).tolist()


@FAST
@given(
    pipelines,
    st.floats(0.3, 4.0),
    st.sampled_from([(None,), (None, 1), (2, None, 3), ()]),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
)
def test_adaptive_search_matches_reference(pipeline, limit_scale, options, clusters, seed):
    """The fused C++ candidate loop picks the same candidate, op codes and times as the Python
    loop, and keeps the same first error when candidates cannot fit."""
    costs, _, num_stages = pipeline
    fwd, bwd, act_comm, grad_comm = times_of(costs)
    act = costs["activation"]
    transient = act * np.random.default_rng(seed).uniform(0.0, 1.0, act.shape)
    limit = np.full(num_stages, limit_scale * 1e6)
    injection = cluster_permutations(fwd.sum(axis=1) + bwd.sum(axis=1), clusters)
    args = (injection, list(options), act, transient, limit, fwd, bwd, act_comm, grad_comm)
    fast = _core.adaptive_search(*args)
    slow = adaptive_candidates_reference(*args)
    assert fast[:3] == slow[:3]
    assert fast[5] == slow[5]
    if slow[0] >= 0:
        assert fast[3].tolist() == slow[3].tolist()
        assert fast[4].tolist() == slow[4].tolist()


def test_peak_activation_rejects_bad_orders_with_same_message():
    act = random_pipeline(0, 2, 2)["activation"]
    for fn in (peak_activation, peak_activation_reference):
        with pytest.raises(PlanningError, match="stage 1: backward of micro-batch 0 appears twice"):
            fn([[0, 1, 2, 3], [0, 1, 1, 2]], act)


@pytest.mark.parametrize(
    ("orders", "message"),
    [
        ([[0, 1, 2, 3], [0, 1, 2]], "stage 1: backward of micro-batch 1 is missing"),
        ([[0, 1, 2, 3], [0, 1, 1, 2]], "stage 1: backward of micro-batch 0 appears twice"),
        ([[0, 1, 2, 3], [0, 3, 2, 1]], "stage 1: backward of micro-batch 1 comes before"),
        ([[0, 1, 2, 7], [0, 1, 2, 3]], "stage 0: op code 7 is not an op of 2 micro-batches"),
        ([[0, 1, 2, 3]], "orders cover 1 stages, the costs 2"),
        (
            [[0, 1, 2, 3], [2, 3, 0, 1]],
            "stage 0: order deadlocks at backward of micro-batch 0, which waits for backward "
            "of micro-batch 0 on stage 1",
        ),
    ],
)
def test_timeline_rejects_bad_orders_with_same_message(orders, message):
    costs = random_pipeline(0, 2, 2)
    for fn in (timeline, timeline_reference):
        with pytest.raises(PlanningError, match=message):
            fn(orders, *times_of(costs))


# Properties ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_stages", "num_mb"), [(1, 5), (4, 1), (4, 3), (4, 8), (6, 17)])
def test_one_f_one_b_textbook_makespan(num_stages, num_mb):
    f, b = 1.5, 2.5
    ones = np.ones((num_mb, num_stages))
    zeros = np.zeros((num_mb, num_stages - 1))
    tl = timeline(one_f_one_b(num_stages, num_mb), f * ones, b * ones, zeros, zeros)
    assert tl.makespan == pytest.approx((num_mb + num_stages - 1) * (f + b))
    np.testing.assert_allclose(tl.busy, num_mb * (f + b))


@FAST
@given(pipelines, st.floats(1.0, 5.0), st.sampled_from([None, 1, 2, 4]))
def test_adaptive_respects_memory_limit(pipeline, headroom, max_inflight):
    costs, num_mb, _ = pipeline
    act = costs["activation"]
    limit = act.max(axis=0, initial=0.0) * headroom  # every micro-batch fits on its own
    orders = adaptive_schedule(act, limit, max_inflight)
    assert_complete(orders, num_mb)
    assert np.all(peak_activation(orders, act) <= limit)
    assert np.isfinite(timeline(orders, *times_of(costs)).makespan)


@FAST
@given(pipelines, st.floats(1.0, 3.0), st.integers(0, 2**32 - 1))
def test_adaptive_counts_each_ops_working_memory(pipeline, headroom, seed):
    """Stored activations plus the running op's transient stay within the limit at every op
    (the simulator's rule), though transients differ a lot between micro-batches."""
    costs, num_mb, _ = pipeline
    act = costs["activation"]
    transient = act * np.random.default_rng(seed).uniform(0.0, 2.0, act.shape)
    limit = (act + transient).max(axis=0, initial=0.0) * headroom  # each fits on its own
    orders = adaptive_schedule(act, limit, None, transient)
    assert_complete(orders, num_mb)
    for stage, order in enumerate(orders):
        stored = 0.0
        for code in order:
            m = code // 2
            stored += act[m, stage] if code % 2 == 0 else 0.0
            assert stored + transient[m, stage] <= limit[stage] * (1 + 1e-12)
            stored -= act[m, stage] if code % 2 else 0.0
    assert np.all(peak_activation(orders, act, transient) <= limit)


def test_working_memory_admits_more_than_a_uniform_reserve():
    """One micro-batch with a large transient no longer shrinks every other's budget: with the
    largest transient reserved for all ops, stage 0 holds 3 micro-batches; counted per op, 4."""
    act = np.ones((6, 3))
    transient = np.zeros((6, 3))
    transient[5] = 1.0
    per_op = adaptive_schedule(act, np.full(3, 4.0), None, transient)
    reserved = adaptive_schedule(act, np.full(3, 4.0 - 1.0))

    def deepest(orders):
        return np.cumsum([1 if code % 2 == 0 else -1 for code in orders[0]]).max()

    assert (deepest(reserved), deepest(per_op)) == (3, 4)


@FAST
@given(st.integers(1, 6), st.integers(1, 24), st.floats(0.1, 3.0), st.floats(0.0, 0.5))
def test_adaptive_unlimited_memory_no_slower_than_1f1b(num_stages, num_mb, ratio, comm):
    ones = np.ones((num_mb, num_stages))
    comms = np.full((num_mb, num_stages - 1), comm)
    times = (ones, ratio * ones, comms, comms)
    adaptive = adaptive_schedule(ones, np.full(num_stages, np.inf))
    baseline = timeline(one_f_one_b(num_stages, num_mb), *times).makespan
    assert timeline(adaptive, *times).makespan <= baseline + 1e-9


def test_impossible_microbatch_is_named():
    act = np.full((5, 3), 10.0)
    act[3, 2] = 25.0
    for fn in (adaptive_schedule, adaptive_schedule_reference):
        with pytest.raises(PlanningError) as info:
            fn(act, np.array([30.0, 30.0, 24.0]))
        assert str(info.value) == (
            "micro-batch 3 needs 25 bytes of activation memory on stage 2, "
            "more than its limit of 24 bytes"
        )
        with pytest.raises(PlanningError) as info:
            fn(act, np.array([30.0, 30.0, 30.0]), None, np.full((5, 3), 6.0))
        assert str(info.value) == (
            "micro-batch 3 needs 25 bytes of activation and 6 bytes of working memory on "
            "stage 2, more than its limit of 30 bytes"
        )


@FAST
@given(pipelines, st.integers(1, 6))
def test_max_inflight_caps_stage0(pipeline, max_inflight):
    costs, _, num_stages = pipeline
    unlimited = np.full(num_stages, np.inf)

    def most_inflight(cap):
        orders = adaptive_schedule(costs["activation"], unlimited, cap)
        return np.cumsum([1 if code % 2 == 0 else -1 for code in orders[0]]).max(initial=0)

    assert most_inflight(max_inflight) == min(max_inflight, most_inflight(None))


def test_stage0_injects_in_order_and_memory_delays_injection():
    act = np.array([[1.0, 1.0], [1.0, 1.0], [3.0, 3.0], [1.0, 1.0]])
    orders = adaptive_schedule(act, np.array([3.0, 3.0]))
    forwards = [code // 2 for code in orders[0] if code % 2 == 0]
    assert forwards == [0, 1, 2, 3]
    # Micro-batch 2 fills the whole budget: both earlier backwards must run before it.
    stage0 = orders[0]
    assert stage0.index(4) > stage0.index(1) and stage0.index(4) > stage0.index(3)


# Ordering and search ------------------------------------------------------------------------


@FAST
@given(
    st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=0, max_size=30),
    st.integers(1, 5),
)
def test_cluster_permutations_are_permutations(times, num_clusters):
    orders = cluster_permutations(np.array(times), num_clusters)
    assert orders[0] == list(range(len(times)))
    assert len({tuple(o) for o in orders}) == len(orders)
    assert len(orders) <= 1 + math.factorial(num_clusters)
    for order in orders:
        assert sorted(order) == list(range(len(times)))


def test_cluster_permutations_groups_similar_times():
    times = np.array([1.0, 9.0, 1.1, 5.0, 9.2, 5.1, 0.9])
    orders = cluster_permutations(times, num_clusters=3)
    assert [0, 2, 6, 3, 5, 1, 4] in orders  # fast, medium, slow; original order inside
    assert [1, 4, 3, 5, 0, 2, 6] in orders
    assert len(orders) == 1 + 6
    assert cluster_permutations(np.ones(4)) == [[0, 1, 2, 3]]  # one cluster: identity only


@settings(max_examples=examples(25), deadline=None)
@given(pipelines, st.floats(1.0, 4.0))
def test_search_never_worse_than_identity_adaptive(pipeline, headroom):
    costs, num_mb, _ = pipeline
    limit = costs["activation"].max(axis=0, initial=0.0) * headroom
    choice = search_schedule(
        costs["forward"],
        costs["backward"],
        costs["activation"],
        limit,
        costs["act_comm"],
        costs["grad_comm"],
    )
    identity = timeline(adaptive_schedule(costs["activation"], limit), *times_of(costs))
    assert choice.timeline.makespan <= identity.makespan
    assert sorted(choice.order) == list(range(num_mb))
    assert_complete(choice.orders, num_mb)
    # The choice is expressed in original indices: re-simulating it reproduces its timeline.
    again = timeline_reference(choice.orders, *times_of(costs))
    np.testing.assert_allclose(again.end, choice.timeline.end, rtol=0, atol=1e-12)
    assert np.all(choice.peak <= limit)


def test_search_1f1b_and_errors():
    costs = random_pipeline(7, 10, 4)
    act = costs["activation"]
    args = (costs["forward"], costs["backward"], act)
    comm = (costs["act_comm"], costs["grad_comm"])
    plenty = np.full(4, np.inf)
    choice = search_schedule(*args, plenty, *comm, kind="1f1b")
    assert choice.orders == one_f_one_b(4, 10) and choice.order == list(range(10))
    with pytest.raises(PlanningError, match="1F1B stores up to"):
        search_schedule(*args, act.max(axis=0), *comm, kind="1f1b")
    with pytest.raises(PlanningError, match="unknown schedule kind"):
        search_schedule(*args, plenty, *comm, kind="gpipe")
    tight = act.max(axis=0)
    tight[1] -= 1  # the largest micro-batch on stage 1 never fits; every candidate fails
    largest = int(np.argmax(act[:, 1]))
    with pytest.raises(PlanningError, match=f"micro-batch {largest} needs .* on stage 1"):
        search_schedule(*args, tight, *comm)


# Lower bound -------------------------------------------------------------------------------


@functools.cache
def stage_orders(num_mb: int) -> list[list[int]]:
    """Every order one stage may run: each backward after its own forward."""

    def grow(order, started, done):
        if len(order) == 2 * num_mb:
            yield list(order)
            return
        for m in range(num_mb):
            if m not in started:
                yield from grow([*order, 2 * m], started | {m}, done)
            elif m not in done:
                yield from grow([*order, 2 * m + 1], started, done | {m})

    return list(grow([], frozenset(), frozenset()))


def optimal_makespan(
    costs: dict[str, np.ndarray], members: list[int], limit: np.ndarray | None = None
) -> float:
    """Shortest makespan over every combination of per-stage orders (deadlocks skipped), and
    given `limit`, only orders whose stored activations stay within it."""
    if not members:
        return 0.0
    m = np.array(members)
    times = tuple(costs[k][m] for k in ("forward", "backward", "act_comm", "grad_comm"))
    best = math.inf
    for orders in itertools.product(stage_orders(len(m)), repeat=times[0].shape[1]):
        if limit is not None and np.any(peak_activation(orders, costs["activation"][m]) > limit):
            continue
        try:
            best = min(best, timeline(list(orders), *times).makespan)
        except PlanningError:
            continue  # this combination deadlocks across stages
    return best


@settings(max_examples=examples(15), deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([(1, 3), (2, 2), (2, 3), (3, 2), (3, 1), (2, 4)]),
)
def test_lower_bound_never_exceeds_the_brute_forced_optimum(seed, shape):
    num_mb, num_stages = shape
    costs = random_pipeline(seed, num_mb, num_stages)
    bound = makespan_lower_bound(*times_of(costs))
    assert bound <= optimal_makespan(costs, list(range(num_mb))) + 1e-12


@settings(max_examples=examples(6), deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(2, 3), (3, 2), (2, 4)]))
def test_lower_bound_over_replicas_holds_for_every_split(seed, shape):
    num_mb, num_stages = shape
    costs = random_pipeline(seed, num_mb, num_stages)
    bound = makespan_lower_bound(*times_of(costs), num_replicas=2)
    # Micro-batch 0 stays on the first replica: a split and its mirror cost the same.
    for mask in range(1, 2**num_mb, 2):
        first = [m for m in range(num_mb) if mask >> m & 1]
        second = [m for m in range(num_mb) if not mask >> m & 1]
        best = max(optimal_makespan(costs, first), optimal_makespan(costs, second))
        assert bound <= best + 1e-12


@settings(max_examples=examples(15), deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([(2, 2), (2, 3), (3, 2), (2, 4)]),
    st.floats(1.0, 2.5),
    st.sampled_from([1, 2]),
)
def test_memory_time_bound_never_exceeds_the_brute_forced_optimum(seed, shape, headroom, reps):
    """Within memory (each micro-batch fits alone), no split and no orders beat the bound."""
    num_mb, num_stages = shape
    costs = random_pipeline(seed, num_mb, num_stages)
    limit = costs["activation"].max(axis=0) * headroom
    bound = memory_time_lower_bound(*times_of(costs), costs["activation"], limit, reps)
    splits = range(1, 2**num_mb, 2) if reps == 2 else [2**num_mb - 1]  # mirrors cost the same
    for mask in splits:
        first = [m for m in range(num_mb) if mask >> m & 1]
        second = [m for m in range(num_mb) if not mask >> m & 1]
        best = max(optimal_makespan(costs, p, limit) for p in (first, second))
        assert bound <= best + 1e-12


def test_memory_time_bound_counts_micro_batches_that_cannot_overlap():
    """Two micro-batches that each fill the memory run one after the other: the bound is
    their two round trips, twice what the stage work alone gives."""
    ones = np.ones((2, 2))
    comms = np.zeros((2, 1))
    times = (ones, ones, comms, comms)
    assert memory_time_lower_bound(*times, ones, np.ones(2)) == 8.0
    assert makespan_lower_bound(*times) == 6.0
    assert (
        optimal_makespan(
            {
                "forward": ones,
                "backward": ones,
                "act_comm": comms,
                "grad_comm": comms,
                "activation": ones,
            },
            [0, 1],
            np.ones(2),
        )
        == 8.0
    )


@FAST
@given(st.integers(1, 6), st.integers(1, 12), st.floats(0.1, 3.0), st.floats(0.0, 0.5))
def test_lower_bound_is_1f1b_for_equal_micro_batches(num_stages, num_mb, f, comm):
    ones = np.ones((num_mb, num_stages))
    comms = np.full((num_mb, num_stages - 1), comm)
    times = (f * ones, 2 * f * ones, comms, comms)
    span = timeline(one_f_one_b(num_stages, num_mb), *times).makespan
    if comm == 0.0:
        assert makespan_lower_bound(*times) == pytest.approx(span)
    assert makespan_lower_bound(*times) <= span + 1e-9
