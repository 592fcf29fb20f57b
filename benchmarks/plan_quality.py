"""Plan quality: predicted throughput of DynaPipe against the baselines, and how close each plan
comes to a lower bound on its own iteration time.

Workload: the SYNTHETIC FLAN-like preset truncated at 512..8192 tokens, global batches of
65,536 tokens, GPT-6.7B with the analytic cost model on 2 pipelines x 4 stages of A100-80GB.
"dp packing" is DynaPipe that also runs the DP with packed rows in its search
(`PlannerConfig.dp_packing`, issue 21: each group priced and run as packed rows while it
partitions) and keeps the faster plan; "dynapipe" (the default) partitions padded groups and
packs them afterwards.
Each method plans the same global batches; baselines get their grid search (micro-batch size or
token budget), and every method may pick its recomputation. Times are the planner's predictions
(schedule timeline under the cost model), checked by the event-driven simulator for DynaPipe.

Lower bound of a plan (for its own micro-batches, under any schedule, memory ignored;
`dynapipe_planner.schedule.makespan_lower_bound`, tested against brute-forced optima): stage j
of a pipeline cannot start before some micro-batch has gone forward through stages 0..j-1
(fill), must run all its forward and backward work one op at a time, and after its last
backward that micro-batch still goes backward through stages j-1..0 (drain). And each
micro-batch alone must go forward through every stage and back again (its chain). So, over the
pipelines,
    LB = max( max_j  min_m sum_{k<j} (f_mk + send_mk) + sum_m (f_mj + b_mj)
                     + min_m sum_{k<j} (b_mk + send_mk),
              max_m  sum_j (f_mj + b_mj) + 2 sum_j send_mj ).

Second table (issue 21 item 2, "near the bound at large N"): planner_speed.py's workload (N
samples, lognormal lengths, median 256, sigma 1, clipped to [8, 4096]) on the same model and
cluster (72 GiB per GPU). For each N: the whole plan (predicted / LB, its micro-batching, its
planning time, median of 3 on this machine), then the analysis on the DP's own padded
micro-batches (a plan without packed rows) and their replica split, each schedule re-searched
as the planner does (cluster orders, 1F1B) and divided by the same LB:
  per-op    working memory counted per op: stored activations + the running op's transient
            must fit (the planner since issue 21; what the simulator checks);
  reserve   the largest transient of the replica reserved for every op (the planner before);
  no mem    the memory limit lifted (adaptive), and 1F1B with memory ignored: how tight the LB
            is for schedules that memory does not constrain;
  busy      per-stage busy fraction of the slowest replica under reserve and per-op;
  full rc   the DP's plan with full recomputation (memory freed, work added), over the same LB;
  mb+1      DP micro-batches sized for one more micro-batch in flight per stage (smaller),
            planned as usual, over the same LB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel, PipelineCosts
from dynapipe_planner.data import global_batches, sample_lengths
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.microbatch.baselines import Group, groups_from_indices
from dynapipe_planner.microbatch.dp import dynamic_microbatches
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig, split_for_replicas
from dynapipe_planner.schedule import makespan_lower_bound, search_schedule
from dynapipe_planner.simulate import simulate

# name: (batching, schedule, whether the DP packs rows while it partitions: `dp_packing`)
METHODS = {
    "dynapipe": ("dynamic", "adaptive", False),
    "dp packing": ("dynamic", "adaptive", True),
    "dynamic+1f1b": ("dynamic", "1f1b", False),
    "packing": ("packing", "1f1b", False),
    "token-budget": ("token-budget", "1f1b", False),
    "padding": ("padding", "1f1b", False),
}


def replica_costs(plan: ExecutionPlan, costs: PipelineCosts) -> list[tuple[np.ndarray, ...]]:
    """Per replica, its micro-batches' (forward, backward, activation, transient, send) tables,
    priced as the planner prices them (packed rows' attention saving off the times)."""
    out = []
    for r in range(plan.num_replicas):
        mbs = [m for m in plan.microbatches if m.replica == r]
        rows = np.array([m.num_rows for m in mbs])
        seq = np.array([m.seqlen for m in mbs])
        zeros = np.zeros(len(mbs))
        fwd, bwd, act, tra = costs.stage_costs_many(rows, seq, zeros)
        saved = np.array([m.attention_saved for m in mbs])
        fwd, bwd = costs.packed_times(fwd, bwd, rows, seq, saved)
        out.append((fwd, bwd, act, tra, costs.p2p_times(rows, seq, zeros)))
    return out


def lower_bound(plan: ExecutionPlan, planner: IterationPlanner, lengths: np.ndarray) -> float:
    """The LB of the docstring for the plan's micro-batches on their replicas."""
    per_replica = replica_costs(plan, planner.costs_of(plan, lengths))
    return max(makespan_lower_bound(f, b, s, s) for f, b, _, _, s in per_replica)


def schedule_variant(
    plan: ExecutionPlan, costs: PipelineCosts, kind: str, memory: str
) -> tuple[float, np.ndarray]:
    """Makespan of the plan's micro-batches and replicas re-scheduled by the planner's search
    (`kind`) under a memory rule ("per-op", "reserve" or "none"), and the slowest replica's
    per-stage busy fraction."""
    avail = costs.available_memory()
    worst = (0.0, np.zeros(plan.num_stages))
    for fwd, bwd, act, tra, send in replica_costs(plan, costs):
        limit = {
            "per-op": avail,
            "reserve": avail - tra.max(axis=0),
            "none": np.full_like(avail, np.inf),
        }[memory]
        working = tra if memory == "per-op" else None
        tl = search_schedule(
            fwd, bwd, act, limit, send, send, kind=kind, transient=working
        ).timeline
        if tl.makespan > worst[0]:
            worst = (tl.makespan, tl.busy / tl.makespan)
    return worst


def smaller_microbatches(
    planner: IterationPlanner, lengths: np.ndarray, recompute: str
) -> list[Group]:
    """The DP's micro-batches sized for one more in flight per stage than 1F1B keeps."""
    costs = planner.costs(recompute, lengths)
    c = planner.num_stages
    mb = dynamic_microbatches(
        lengths, costs, inflight=np.arange(c + 1, 1, -1, dtype=np.float64), num_replicas=2
    )
    return groups_from_indices(lengths, split_for_replicas(list(mb.microbatches), 2))


def planning_ms(
    planner: IterationPlanner, lengths: np.ndarray, repeats: int = 3
) -> tuple[float, float]:
    """Median wall-clock and CPU milliseconds of a plan (CPU time is what a shared machine's
    other load inflates least)."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        planner.plan(lengths)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def _fractions(values: np.ndarray) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def near_the_bound(cost_model: AnalyticCostModel, sizes: list[int]) -> None:
    """The second table of the docstring."""
    print(f"\nNear the bound at large N (load average before: {os.getloadavg()[0]:.1f})")
    print(f"{'whole plan':<47}| the DP's padded micro-batches, makespan / their LB")
    print(
        f"{'N':>6}{'plan/LB':>8}{'plan ms':>8}{'cpu ms':>7}  {'micro-batching':<16}|"
        f"{'per-op':>7}{'reserve':>8}{'no mem':>7}{'1f1b nm':>8}{'full rc':>8}{'mb+1':>6}"
        "  busy: reserve -> per-op"
    )
    whole = IterationPlanner(cost_model, 4, PlannerConfig(num_replicas=2))
    padded = IterationPlanner(cost_model, 4, PlannerConfig(num_replicas=2, packed_rows=False))
    full = IterationPlanner(
        cost_model, 4, PlannerConfig(num_replicas=2, packed_rows=False, recompute="full")
    )
    for n in sizes:
        lengths = sample_lengths("lognormal", n, seed=n, median=256, sigma=1.0, lo=8, hi=4096)
        plan = whole.plan(lengths)
        ms, cpu_ms = planning_ms(whole, lengths)
        dp = padded.plan(lengths)
        costs = padded.costs_of(dp, lengths)
        bound = lower_bound(dp, padded, lengths)
        per_op, busy_new = schedule_variant(dp, costs, "adaptive", "per-op")
        reserve, busy_old = schedule_variant(dp, costs, "adaptive", "reserve")
        free, _ = schedule_variant(dp, costs, "adaptive", "none")
        free_1f1b, _ = schedule_variant(dp, costs, "1f1b", "none")
        full_rc = full.plan(lengths).stats["predicted_iteration_s"]
        smaller = padded.predict(
            lengths, smaller_microbatches(padded, lengths, dp.stats["recompute"])
        )
        ratio = plan.stats["predicted_iteration_s"] / lower_bound(plan, whole, lengths)
        print(
            f"{n:>6}{ratio:>8.3f}{ms:>8.0f}{cpu_ms:>7.0f}  {plan.stats['batching']:<16}|"
            f"{per_op / bound:>7.3f}{reserve / bound:>8.3f}{free / bound:>7.3f}"
            f"{free_1f1b / bound:>8.3f}{full_rc / bound:>8.3f}{smaller / bound:>6.3f}"
            f"  {_fractions(busy_old)} -> {_fractions(busy_new)}"
        )
    print(f"(load average after: {os.getloadavg()[0]:.1f}; 2 shared cores)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seqlens", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--tokens-per-global-batch", type=int, default=65536)
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=[1000, 2000, 4000, 8000], help="N of table 2"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: max length 512, one global batch of 16,384 tokens, N = 200",
    )
    args = parser.parse_args()
    if args.smoke:
        args.max_seqlens, args.iterations, args.tokens_per_global_batch = [512], 1, 16384
        args.sizes = [200]
    print(__doc__)
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=4, num_replicas=2)
    cost_model = AnalyticCostModel(MODEL_PRESETS["gpt-6.7b"], cluster)
    data = sample_lengths("flan", 50000, seed=0)
    print(
        f"{'max len':>8}{'method':>14}{'tokens/s':>11}{'vs packing':>11}{'pad eff':>9}"
        f"{'iter/LB mean':>13}{'iter/LB max':>12}{'sim/pred':>9}"
    )
    gains = []  # per max length: DynaPipe over packing, and over the best baseline
    for max_len in args.max_seqlens:
        lengths = np.minimum(data, max_len)
        batches = global_batches(lengths, args.tokens_per_global_batch, seed=1)
        chosen = [next(batches) for _ in range(args.iterations)]
        rows = {}
        for name, (batching, schedule, dp_packing) in METHODS.items():
            config = PlannerConfig(
                num_replicas=2,
                batching=batching,
                schedule=schedule,
                max_seqlen=max_len,
                dp_packing=dp_packing,
            )
            planner = IterationPlanner(cost_model, 4, config)
            tokens = seconds = 0.0
            ratios, pad, sim = [], [], []
            for idx in chosen:
                batch = lengths[idx]
                try:
                    plan = planner.plan(batch)
                except PlanningError:
                    break  # out of memory under every recomputation: reported as such below
                tokens += plan.stats["tokens"]
                seconds += plan.stats["predicted_iteration_s"]
                pad.append(plan.stats["padding_efficiency"])
                ratios.append(
                    plan.stats["predicted_iteration_s"] / lower_bound(plan, planner, batch)
                )
                if name in ("dynapipe", "dp packing"):
                    costs = planner.costs_of(plan, batch)
                    sim.append(simulate(plan, costs).makespan / plan.stats["predicted_iteration_s"])
            if len(ratios) == len(chosen):
                rows[name] = (tokens / seconds, np.mean(pad), np.mean(ratios), np.max(ratios), sim)
        base = rows["packing"][0] if "packing" in rows else float("nan")
        for name in METHODS:
            if name not in rows:
                print(f"{max_len:>8}{name:>14}   out of memory under every recompute mode")
                continue
            tps, pad, mean_r, max_r, sim = rows[name]
            sim_s = f"{np.mean(sim):9.3f}" if sim else f"{'':9}"
            vs = f"{tps / base:>10.2f}x" if np.isfinite(base) else f"{'-':>11}"
            print(
                f"{max_len:>8}{name:>14}{tps:>11.0f}{vs}{pad:>9.3f}"
                f"{mean_r:>13.3f}{max_r:>12.3f}{sim_s}"
            )
        baselines = [rows[m][0] for m in ("packing", "padding", "token-budget") if m in rows]
        if baselines:
            ours = {m: rows[m][0] for m in ("dynapipe", "dp packing") if m in rows}
            gains.append({m: tps / max(baselines) for m, tps in ours.items()})
            gains[-1].update(max_len=max_len, vs_packing=ours.get("dynapipe", np.nan) / base)
    for name in ("dynapipe", "dp packing") if gains else ():
        print(
            f"{name} / best of packing, padding and token-budget: "
            + ", ".join(f"{g['max_len']}: {g.get(name, np.nan):.3f}x" for g in gains)
        )
    if gains:
        print(f"dynapipe: mean gain over packing {np.mean([g['vs_packing'] for g in gains]):.3f}x")
    near_the_bound(cost_model, args.sizes)


if __name__ == "__main__":
    main()
