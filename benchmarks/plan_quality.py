"""Plan quality: predicted throughput of DynaPipe against the baselines, and how close each plan
comes to a lower bound on its own iteration time.

Workload: the SYNTHETIC FLAN-like preset truncated at 512..8192 tokens, global batches of
65,536 tokens, GPT-6.7B with the analytic cost model on 2 pipelines x 4 stages of A100-80GB.
Each method plans the same global batches; baselines get their grid search (micro-batch size or
token budget), and every method may pick its recomputation. Times are the planner's predictions
(schedule timeline under the cost model), checked by the event-driven simulator for DynaPipe.

Lower bound of a plan (for its own micro-batches, under any schedule): stage j of a pipeline
cannot start before some micro-batch has gone forward through stages 0..j-1 (fill), must run
all its forward and backward work one op at a time, and after its last backward that
micro-batch still goes backward through stages j-1..0 (drain). And each micro-batch alone must
go forward through every stage and back again (its chain). So, over the pipelines,
    LB = max( max_j  min_m sum_{k<j} (f_mk + send_mk) + sum_m (f_mj + b_mj)
                     + min_m sum_{k<j} (b_mk + send_mk),
              max_m  sum_j (f_mj + b_mj) + 2 sum_j send_mj ).
"""

from __future__ import annotations

import argparse

import numpy as np

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.data import global_batches, sample_lengths
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig
from dynapipe_planner.simulate import simulate

METHODS = {
    "dynapipe": ("dynamic", "adaptive"),
    "dynamic+1f1b": ("dynamic", "1f1b"),
    "packing": ("packing", "1f1b"),
    "token-budget": ("token-budget", "1f1b"),
    "padding": ("padding", "1f1b"),
}


def lower_bound(plan: ExecutionPlan, planner: IterationPlanner, lengths: np.ndarray) -> float:
    costs = planner.costs_of(plan, lengths)
    best = 0.0
    for r in range(plan.num_replicas):
        mbs = [m for m in plan.microbatches if m.replica == r]
        rows = np.array([m.num_rows for m in mbs])
        seq = np.array([m.seqlen for m in mbs])
        fwd, bwd, _, _ = costs.stage_costs_many(rows, seq, np.zeros(len(mbs)))
        saved = np.array([m.attention_saved for m in mbs])
        cut = saved[:, None] * costs.attention_coef[None, :]
        fwd, bwd = fwd - cut / 3, bwd - 2 * cut / 3
        send = costs.p2p_times(rows, seq, np.zeros(len(mbs)))
        for j in range(plan.num_stages):
            fill = (fwd[:, :j] + send[:, :j]).sum(axis=1).min()
            drain = (bwd[:, :j] + send[:, :j]).sum(axis=1).min()
            best = max(best, fill + (fwd[:, j] + bwd[:, j]).sum() + drain)
        chain = (fwd + bwd).sum(axis=1) + 2 * send.sum(axis=1)
        best = max(best, float(chain.max()))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--global-batch-tokens", type=int, default=65536)
    args = parser.parse_args()
    print(__doc__)
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=4, num_replicas=2)
    cost_model = AnalyticCostModel(MODEL_PRESETS["gpt-6.7b"], cluster)
    data = sample_lengths("flan", 50000, seed=0)
    print(
        f"{'max len':>8}{'method':>14}{'tokens/s':>11}{'vs packing':>11}{'pad eff':>9}"
        f"{'iter/LB mean':>13}{'iter/LB max':>12}{'sim/pred':>9}"
    )
    for max_len in args.max_seqlens:
        lengths = np.minimum(data, max_len)
        batches = global_batches(lengths, args.global_batch_tokens, seed=1)
        chosen = [next(batches) for _ in range(args.iterations)]
        rows = {}
        for name, (batching, schedule) in METHODS.items():
            config = PlannerConfig(
                num_replicas=2, batching=batching, schedule=schedule, max_seqlen=max_len
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
                if name == "dynapipe":
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


if __name__ == "__main__":
    main()
