"""Planner speed: DP time and whole-plan time (DP + schedule search + communication plan).

Workload (issue #2): N samples with lognormal lengths (median 256, sigma 1, clipped to
[8, 4096]), GPT-6.7B with the analytic cost model on A100-80GB, 4 stages x 2 replicas,
DynaPipe's dynamic micro-batching with the adaptive schedule. Each time is the median of
several runs on one core (the planner is single-threaded), measured with time.perf_counter.
The Python reference DP (same algorithm, same result) is the only baseline this script runs.
DynaPipe's public code (awslabs/optimizing-multitask-training-through-dynamic-pipelines) is not
run here. Quoted from issue #35, not re-measured: its planner takes 2 s (N=1000) to 43 s
(N=8000) with its own scipy-interpolated cost model, but its DP with table lookups (what ours
does) 0.28-0.39 s (N=1000) and 6.0 s (N=8000) of CPU. Only the latter compare with this DP's
times, and not like for like: another run, whose machine and lengths are not recorded here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import numpy as np

from dynapipe_planner._reference.microbatch_dp import microbatch_dp_kernel
from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.data import sample_lengths
from dynapipe_planner.microbatch.dp import dynamic_microbatches
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.planner import IterationPlanner, PlannerConfig

TARGETS_MS = {1000: 20.0, 8000: 200.0}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1000, 2000, 8000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--reference-max", type=int, default=8000, help="largest N for the Python DP"
    )
    parser.add_argument("--smoke", action="store_true", help="CI's check: N = 256, once")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats = [256], 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=4, num_replicas=2)
    cost_model = AnalyticCostModel(MODEL_PRESETS["gpt-6.7b"], cluster)
    planner = IterationPlanner(cost_model, 4, PlannerConfig(num_replicas=2))
    print(__doc__)
    print(
        f"{'N':>6}{'DP ms':>10}{'plan ms':>10}{'py DP ms':>11}{'DP speed-up':>13}"
        f"{'#mb':>6}{'target':>10}"
    )
    for n in args.sizes:
        lengths = sample_lengths("lognormal", n, seed=n, median=256, sigma=1.0, lo=8, hi=4096)
        costs = planner.costs("none", lengths)
        dp_call = partial(dynamic_microbatches, lengths, costs, inflight=np.ones(4), num_replicas=2)
        planner.plan(lengths)  # warm the cost-table cache, as every iteration after the first
        dp = median_time(dp_call, args.repeats)
        whole = median_time(partial(planner.plan, lengths), args.repeats)
        mbs = planner.plan(lengths).stats["num_microbatches"]
        if n <= args.reference_max:
            ref = median_time(partial(dp_call, kernel=microbatch_dp_kernel), 1)
            ref_s, ratio = f"{ref * 1e3:11.0f}", f"{ref / dp:12.0f}x"
        else:
            ref_s, ratio = f"{'-':>11}", f"{'-':>13}"
        target = TARGETS_MS.get(n)
        verdict = (
            "" if target is None else f"<{target:.0f} {'ok' if whole * 1e3 < target else 'MISS'}"
        )
        print(f"{n:>6}{dp * 1e3:>10.1f}{whole * 1e3:>10.1f}{ref_s}{ratio}{mbs:>6}{verdict:>10}")


if __name__ == "__main__":
    main()
