"""Hydraulis scheme profiles and strategy proposal (dynapipe_planner.strategy): the integer DP
equals exhaustive enumeration, the closed-form relaxation is the limit of the fractional DP,
rounding keeps strategies valid, and bad input is named."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from dynapipe_planner import _core
from dynapipe_planner._reference.proposal import proposal_dp_tables_reference
from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.data import sample_lengths
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import load_plan
from dynapipe_planner.simulate import verify_plan
from dynapipe_planner.strategy.cli import strategy_main
from dynapipe_planner.strategy.proposal import (
    IntervalWork,
    Strategy,
    _EstimateTable,
    estimate_latency,
    integer_proposal_dp,
    interval_work,
    paper_dp_tractable,
    proposal_dp,
    propose_strategies,
    refine_strategies,
    relaxed_proposal,
    round_strategy,
    unique_candidates,
)
from dynapipe_planner.strategy.schemes import (
    ParallelScheme,
    SchemeProfile,
    analytic_scheme_models,
    profile_scheme,
    profile_schemes,
    scheme_space,
    scheme_tables,
)

GPT = MODEL_PRESETS["gpt-1.3b"]  # 24 layers, 16 heads


def synthetic_work(seed: int, num_intervals: int, schemes: list[ParallelScheme]) -> IntervalWork:
    """Random per-interval work; each scheme holds a random prefix of the intervals (MaxLen)."""
    rng = np.random.default_rng(seed)
    upper = np.arange(1, num_intervals + 1) * 100
    work = rng.uniform(0.1, 5.0, size=(num_intervals, len(schemes)))
    holds = rng.integers(1, num_intervals + 1, size=len(schemes))
    holds[rng.integers(len(schemes))] = num_intervals  # some scheme holds everything
    profiles = []
    for k, scheme in enumerate(schemes):
        work[holds[k] :, k] = math.inf
        max_len = int(upper[holds[k] - 1])
        profiles.append(SchemeProfile(scheme, max_len, 1, (0.0, 0.0, 1.0), upper[:1], upper[:1]))
    return IntervalWork(upper, work, np.ones(num_intervals, dtype=int), tuple(profiles))


def brute_force(iw: IntervalWork, num_gpus: int, intervals: int, step: float = 1.0) -> float:
    """Every split of the first `intervals` intervals into contiguous blocks, every scheme and
    pipeline count (a multiple of `step`) per block, within `num_gpus`: the best slowest-block
    latency."""
    best = math.inf
    for cuts in itertools.product([False, True], repeat=intervals - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [intervals]
        blocks = list(itertools.pairwise(bounds))
        choices = []
        for a, b in blocks:
            options = []
            for k, p in enumerate(iw.profiles):
                work = iw.work[a:b, k].sum()
                if math.isfinite(work):
                    options += [
                        (p.scheme.num_gpus * d * step, work / (d * step))
                        for d in range(1, round(num_gpus / step) + 1)
                    ]
            choices.append(options)
        for combo in itertools.product(*choices):
            if sum(g for g, _ in combo) <= num_gpus + 1e-9:
                best = min(best, max(t for _, t in combo))
    return best


def tables(gpu: str, num_gpus: int, max_len: int):
    """Single-sequence cost tables of each GPT scheme on `num_gpus` GPUs of type `gpu`."""
    return scheme_tables(analytic_scheme_models(GPT, get_gpu(gpu), num_gpus), max_len)


SMALL_SCHEMES = [ParallelScheme(1, 1), ParallelScheme(2, 1), ParallelScheme(1, 3)]


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 6))
def test_integer_dp_equals_exhaustive_enumeration(seed, num_intervals, num_gpus):
    iw = synthetic_work(seed, num_intervals, SMALL_SCHEMES)
    latencies, strategies = integer_proposal_dp(iw, num_gpus)
    for ell in range(1, num_intervals + 1):
        expected = brute_force(iw, num_gpus, ell)
        assert latencies[ell - 1] == pytest.approx(expected, rel=1e-12) or (
            math.isinf(expected) and math.isinf(latencies[ell - 1])
        )
        if math.isfinite(expected):
            assert strategies[ell - 1].num_gpus <= num_gpus


def fractional_dp(iw: IntervalWork, num_gpus: int, step: float) -> float:
    """Eq. 4 with n and d on a grid of `step` (the paper's relaxation, 0.1 there)."""
    units = round(num_gpus / step)
    num_intervals = len(iw.upper)
    prefix = np.vstack([np.zeros(len(iw.profiles)), np.cumsum(iw.work, axis=0)])
    t = np.full((units + 1, num_intervals + 1), math.inf)
    t[:, 0] = 0.0
    for n in range(1, units + 1):
        for ell in range(1, num_intervals + 1):
            best = t[n - 1, ell]
            for k, p in enumerate(iw.profiles):
                if not math.isfinite(iw.work[ell - 1, k]):
                    continue
                g = p.scheme.num_gpus
                for start in range(ell):
                    block = prefix[ell, k] - prefix[start, k]
                    for d_units in range(1, n // g + 1):  # d = d_units * step pipelines
                        best = min(best, max(t[n - d_units * g, start], block / (d_units * step)))
            t[n, ell] = best
    return float(t[units, num_intervals])


@settings(max_examples=examples(15), deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.sampled_from([1, 2]))
def test_paper_dp_equals_exhaustive_enumeration_on_its_grid(seed, num_intervals, num_gpus):
    iw = synthetic_work(seed, num_intervals, SMALL_SCHEMES[:2])
    solution = proposal_dp(iw, num_gpus, step=0.5)
    gpus = np.array([p.scheme.num_gpus for p in iw.profiles])
    for ell in range(1, num_intervals + 1):
        expected = brute_force(iw, num_gpus, ell, step=0.5)
        got = solution.latency[ell - 1]
        assert got == pytest.approx(expected, rel=1e-12) or (
            math.isinf(expected) and math.isinf(got)
        )
        if math.isfinite(expected):  # S[N][l]: within the GPUs, each interval on a holder
            assert solution.pipelines[ell - 1] @ gpus <= num_gpus + 1e-9
            owners = solution.scheme_of_interval[ell - 1, :ell]
            assert all(math.isfinite(iw.work[i, k]) for i, k in enumerate(owners))


@pytest.mark.parametrize("seed", range(4))
def test_closed_form_relaxation_is_the_limit_of_the_fractional_dp(seed):
    iw = synthetic_work(seed, 3, SMALL_SCHEMES[:2])
    closed = relaxed_proposal(iw, 3, 4).latency
    coarse, fine = fractional_dp(iw, 4, 0.5), fractional_dp(iw, 4, 0.1)
    assert proposal_dp(iw, 4, step=0.1).latency[-1] == pytest.approx(fine, rel=1e-12)
    assert proposal_dp(iw, 4, step=0.5).latency[-1] == pytest.approx(coarse, rel=1e-12)
    assert closed <= fine + 1e-12 and fine <= coarse + 1e-12  # a lower bound, approached
    assert fine <= closed * 1.25
    integer = integer_proposal_dp(iw, 4)[0][-1]
    assert closed <= integer + 1e-12


def test_relaxation_gives_every_interval_its_cheapest_feasible_scheme():
    iw = synthetic_work(7, 4, SMALL_SCHEMES)
    solution = relaxed_proposal(iw, 4, 8)
    gpu_seconds = iw.work * iw.gpus[None, :]
    assert list(solution.scheme_of_interval) == list(np.argmin(gpu_seconds, axis=1))
    assert solution.latency == pytest.approx(gpu_seconds.min(axis=1).sum() / 8)
    # Each scheme's pipelines carry its work at exactly that latency, using all 8 GPUs.
    assert float(solution.pipelines @ iw.gpus) == pytest.approx(8.0)


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.floats(0.0, 12.0), min_size=3, max_size=3),
    st.integers(4, 24),
    st.sampled_from([100, 200, 300, 400]),
)
def test_rounded_strategies_fit_and_hold_the_longest_sequence(fractions, num_gpus, longest):
    iw = synthetic_work(3, 4, SMALL_SCHEMES)
    pipelines = np.array(fractions)
    holders = [p for p in iw.profiles if p.max_len >= longest]
    if not any(pipelines[k] > 0 for k, p in enumerate(iw.profiles) if p.max_len >= longest):
        return  # the relaxation never leaves the longest interval without a scheme
    strategies = round_strategy(pipelines, iw.profiles, num_gpus, longest)
    assert len(set(strategies)) == len(strategies)
    for s in strategies:
        assert 0 < s.num_gpus <= num_gpus
        assert any(scheme in {p.scheme for p in holders} for scheme, _ in s.pipelines)
        # No GPU left that one more pipeline of a used scheme could take.
        used = {scheme for k, scheme in enumerate(SMALL_SCHEMES) if pipelines[k] > 1e-9}
        assert all(num_gpus - s.num_gpus < scheme.num_gpus for scheme in used)


def test_whole_relaxed_solution_is_kept_as_is():
    iw = synthetic_work(3, 4, SMALL_SCHEMES)
    pipelines = np.array([2.0, 1.0, 0.0])
    longest = max(p.max_len for p in iw.profiles[:2])
    found = round_strategy(pipelines, iw.profiles, 4, longest)
    assert Strategy.of({SMALL_SCHEMES[0]: 2, SMALL_SCHEMES[1]: 1}) in found


def all_strategies(schemes: list[ParallelScheme], num_gpus: int) -> list[Strategy]:
    """Every whole-pipeline strategy within `num_gpus` (small scheme sets only)."""
    ranges = [range(num_gpus // s.num_gpus + 1) for s in schemes]
    return [
        Strategy.of(dict(zip(schemes, counts, strict=True)))
        for counts in itertools.product(*ranges)
        if 0 < sum(s.num_gpus * d for s, d in zip(schemes, counts, strict=True)) <= num_gpus
    ]


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 10_000), st.integers(3, 6), st.integers(4, 14))
def test_neighbourhood_prices_each_move_as_pricing_it_whole_does(seed, num_intervals, num_gpus):
    iw = synthetic_work(seed, num_intervals, SMALL_SCHEMES)
    table = _EstimateTable(iw, num_intervals)
    base = np.random.default_rng(seed).integers(0, 3, size=len(SMALL_SCHEMES))
    base[np.argmax([p.max_len for p in iw.profiles])] += 1
    if base @ iw.gpus > num_gpus:
        return
    around, estimates = table.neighbourhood(base, num_gpus)
    assert len(around) and np.all(around @ iw.gpus <= num_gpus) and np.all(around >= 0)
    assert np.all(np.abs(around - base).sum(axis=1) <= 2)
    np.testing.assert_allclose(estimates, table.of_counts(around), rtol=1e-12)


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(0, 10_000), st.integers(4, 14))
def test_refinement_climbs_to_a_local_optimum_no_worse_than_its_starts(seed, num_gpus):
    iw = synthetic_work(seed, 5, SMALL_SCHEMES)
    relaxed = relaxed_proposal(iw, 5, num_gpus)
    starts = list(round_strategy(relaxed.pipelines, iw.profiles, num_gpus, int(iw.upper[-1])))
    found = refine_strategies(starts, iw, 5, num_gpus, keep=4, climbs=len(starts))
    values = [v for v, _ in found]
    assert values == sorted(values) and len({s for _, s in found}) == len(found)
    assert all(s.num_gpus <= num_gpus for _, s in found)
    assert all(v == estimate_latency(s, iw, 5) for v, s in found)
    assert values[0] <= min(estimate_latency(s, iw, 5) for s in starts)
    table = _EstimateTable(iw, 5)
    _, around = table.neighbourhood(table.counts_of(found[0][1]), num_gpus)
    assert around.min() >= values[0] * (1 - 1e-9)  # no single move improves the best


def test_refinement_puts_gpus_stranded_by_rounding_to_work():
    """Pipelines of 8 GPUs (the only one holding long sequences), 5 and 3 GPUs on 16: the
    relaxation uses 0.89 x 8 + 1.78 x 5, every rounding ends at 8 + 5 GPUs and no used scheme
    fits the 3 left; adding the 3-GPU scheme uses all 16, which is the exhaustive optimum."""
    schemes = [ParallelScheme(2, 4), ParallelScheme(1, 5), ParallelScheme(1, 3)]
    upper = np.array([100, 200])
    work = np.array([[0.7, 1.0, 1.8], [0.5, math.inf, math.inf]])
    profiles = tuple(
        SchemeProfile(s, m, 1, (0.0, 0.0, 1.0), upper[:1], upper[:1])
        for s, m in zip(schemes, (200, 100, 100), strict=True)
    )
    iw = IntervalWork(upper, work, np.ones(2, dtype=int), profiles)
    relaxed = relaxed_proposal(iw, 2, 16)
    starts = round_strategy(relaxed.pipelines, profiles, 16, 200)
    assert all(s.num_gpus == 13 for s in starts)
    (value, best), *_ = refine_strategies(list(starts), iw, 2, 16)
    exhaustive = min(estimate_latency(s, iw, 2) for s in all_strategies(schemes, 16))
    assert value == pytest.approx(exhaustive) and best.num_gpus == 16
    assert value < min(estimate_latency(s, iw, 2) for s in starts)


def test_scheme_space_follows_divisibility_and_gpu_count():
    schemes = scheme_space(GPT, 16, max_tp=8)
    assert schemes and all(s.num_gpus <= 16 for s in schemes)
    assert all(16 % s.tp == 0 and 24 % s.pp == 0 for s in schemes)
    assert ParallelScheme(8, 2) in schemes and ParallelScheme(3, 1) not in schemes
    with pytest.raises(PlanningError, match="at least one GPU"):
        scheme_space(GPT, 0)


def test_profile_max_len_is_the_longest_length_whose_1f1b_memory_fits():
    scheme = ParallelScheme(1, 4)
    costs = tables("A100-40GB", 8, 65536)(scheme)
    profile = profile_scheme(scheme, costs, length_step=64)
    assert 0 < profile.max_len < costs.s_grid[-1]
    free = costs.memory_limit - costs.static
    inflight = np.arange(4, 0, -1)

    def fits(length: int) -> bool:
        _, _, act, tra = costs.stage_costs_many(np.ones(1), np.array([length]), np.zeros(1))
        return bool(np.all(act[0] * inflight + tra[0] <= free))

    assert fits(profile.max_len) and not fits(profile.max_len + 64)
    rate = profile.lengths / profile.stage_times
    assert rate[profile.lengths == profile.util_len][0] >= 0.85 * rate.max()
    assert rate[profile.lengths < profile.util_len].max(initial=0) < 0.85 * rate.max()
    assert profile.fit_error < 0.02
    assert np.all(np.diff(profile.time(profile.lengths)) > 0)


def test_sequence_longer_than_every_max_len_is_named():
    profiles = profile_schemes(
        scheme_space(GPT, 2),
        tables("RTX3090", 2, 65536),
    )
    longest = max(p.max_len for p in profiles)
    with pytest.raises(PlanningError, match=rf"sample 2 \(length {longest + 1}\).*MaxLen"):
        interval_work(np.array([10, 20, longest + 1]), profiles)


def test_empty_scheme_space_and_empty_histogram_are_named():
    with pytest.raises(PlanningError, match="empty scheme space"):
        profile_schemes([], lambda s: None)
    profiles = profile_schemes(
        [ParallelScheme(1, 1)],
        tables("A100-80GB", 1, 4096),
    )
    with pytest.raises(PlanningError, match="no tokens"):
        interval_work(np.array([], dtype=np.int64), profiles)
    with pytest.raises(PlanningError, match="empty scheme space"):
        interval_work(np.array([5]), [])


@pytest.mark.parametrize("method", ["closed_form", "paper_dp"])
def test_proposals_cover_every_maximum_length_with_valid_strategies(method):
    profiles = profile_schemes(
        scheme_space(GPT, 16),
        tables("A100-40GB", 16, 16384),
    )
    lengths = np.minimum(sample_lengths("webcode", 5000, seed=1), 16384)
    iw = interval_work(lengths, profiles, step=256, tokens_per_iteration=100_000)
    proposals = propose_strategies(iw, 16, method=method)
    assert [p.max_len for p in proposals] == [int(u) for u in iw.upper[iw.counts > 0]]
    max_len = {p.scheme: p.max_len for p in profiles}
    for p in proposals:
        assert list(p.estimates) == sorted(p.estimates) and len(p.strategies) <= 3
        for s in p.strategies:
            assert s.num_gpus <= 16
            assert max(max_len[scheme] for scheme, _ in s.pipelines) >= p.max_len
    best = proposals[-1]
    assert best.estimates[0] == estimate_latency(best.strategies[0], iw, len(iw.upper))
    closed = relaxed_proposal(iw, len(iw.upper), 16).latency  # the relaxation's optimum
    assert best.relaxed.latency >= closed * (1 - 1e-9)  # the DP's 0.1 grid sits above it
    assert best.estimates[0] >= closed * (1 - 1e-9)  # rounding costs something
    assert len(unique_candidates(proposals)) < 3 * len(proposals)
    with pytest.raises(PlanningError, match="proposal method"):
        propose_strategies(iw, 16, method="greedy")


def test_cli_propose_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "proposals.json"
    argv = ["propose", "--model", "gpt-1.3b", "--gpu", "A100-40GB", "--num-gpus", "16"]
    argv += ["--seq-length", "8192", "--num-samples", "3000", "--output", str(out)]
    assert strategy_main(argv) == 0
    printed = capsys.readouterr().out
    assert "MaxLen" in printed and "candidate strategies on 16 A100-40GB" in printed
    data = json.loads(out.read_text())
    assert data["schemes"] and data["proposals"][-1]["max_len"] <= 8192
    assert all(s["num_gpus"] <= 16 for p in data["proposals"] for s in p["strategies"])


def test_cli_names_a_sequence_no_scheme_holds(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n500000\n")
    argv = ["propose", "--lengths", str(lengths), "--seq-length", "600000", "--num-gpus", "2"]
    argv += ["--tokens-per-global-batch", "1000000"]  # an iteration holds the long sample
    assert strategy_main([*argv, "--gpu", "RTX3090", "--model", "gpt-1.3b"]) == 2
    assert "sample 1 (length 500000)" in capsys.readouterr().err


def test_cli_plan_writes_heterogeneous_plans_the_simulator_accepts(tmp_path, capsys):
    argv = ["plan", "--model", "gpt-1.3b", "--gpu", "RTX4090", "--num-gpus", "8"]
    argv += ["--seq-length", "8192", "--num-samples", "3000", "--tokens-per-global-batch"]
    argv += ["30000", "--iterations", "2", "--trials", "10", "--output-dir", str(tmp_path)]
    assert strategy_main(argv) == 0
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert len(rows) == 2 and all("candidates" in row for row in rows)
    for k in range(2):
        plan = load_plan(tmp_path / f"iter_{k:05d}.json")
        verify_plan(plan)
        assert len(plan.meta["cost_models"]) == plan.num_replicas


@settings(max_examples=examples(40), deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 10),
    st.integers(1, 4),
    st.sampled_from([1.0, 0.5, 0.25, 0.1]),
    st.integers(1, 8),
    st.booleans(),
)
def test_cpp_proposal_dp_equals_the_python_reference(
    seed, num_intervals, num_schemes, step, num_gpus, empty
):
    """Same t and choices (scheme, pipelines, block start) in every state, bit for bit,
    including blocks of zero work (empty intervals) and schemes too large for some n."""
    schemes = [*SMALL_SCHEMES, ParallelScheme(2, 2)][:num_schemes]
    iw = synthetic_work(seed, num_intervals, schemes)
    if empty:
        iw.work[np.random.default_rng(seed).random(iw.work.shape) < 0.3] = 0.0
    fast = proposal_dp(iw, num_gpus, step=step)
    slow = proposal_dp(iw, num_gpus, step=step, tables=proposal_dp_tables_reference)
    assert fast.latency.tolist() == slow.latency.tolist()
    assert fast.pipelines.tolist() == slow.pipelines.tolist()
    assert fast.scheme_of_interval.tolist() == slow.scheme_of_interval.tolist()
    units = round(num_gpus / step)
    gpus = np.array([p.scheme.num_gpus for p in iw.profiles], dtype=np.int64)
    t, choice = _core.proposal_dp(iw.work, gpus, units, step)
    t_ref, choice_ref = proposal_dp_tables_reference(iw, units, step)
    assert t.tolist() == t_ref.tolist() and choice.tolist() == choice_ref.tolist()


def test_default_proposal_is_never_worse_than_the_paper_dp_nor_the_closed_form():
    """The default (`method="auto"`) merges both methods' candidates: at every maximum length
    its best estimate is at most each method's, on random instances where the closed form
    alone is worse than the paper's DP at some lengths and better at others."""
    schemes = [*SMALL_SCHEMES, ParallelScheme(2, 2), ParallelScheme(4, 1), ParallelScheme(1, 5)]
    ours_worse = ours_better = 0
    for seed in range(30):
        rng = np.random.default_rng(seed)
        iw = synthetic_work(seed, int(rng.integers(2, 9)), schemes[: int(rng.integers(3, 7))])
        num_gpus = int(rng.integers(5, 17))
        assert paper_dp_tractable(iw, num_gpus)
        auto = propose_strategies(iw, num_gpus)
        closed = propose_strategies(iw, num_gpus, method="closed_form")
        paper = propose_strategies(iw, num_gpus, method="paper_dp")
        for intervals, (a, c, p) in enumerate(zip(auto, closed, paper, strict=True), start=1):
            assert a.estimates[0] <= min(c.estimates[0], p.estimates[0])
            assert a.estimates == tuple(sorted(a.estimates)) and len(set(a.strategies)) == len(
                a.strategies
            )
            for strategy, estimate in zip(a.strategies, a.estimates, strict=True):
                assert strategy.num_gpus <= num_gpus
                assert estimate == pytest.approx(estimate_latency(strategy, iw, intervals))
            ours_worse += c.estimates[0] > p.estimates[0] * (1 + 1e-9)
            ours_better += c.estimates[0] < p.estimates[0] * (1 - 1e-9)
    assert ours_worse and ours_better
