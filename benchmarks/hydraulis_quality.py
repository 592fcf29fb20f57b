"""Hydraulis plan quality (issue #4): predicted per-iteration latency of dynamic heterogeneous
strategies against homogeneous baselines, and the ablation of seed hydraulis.txt Fig. 13.

Workload: LLaMA-2 style 7B / 13B / 32B (`llama-*` presets) on A800 GPUs (8 per node, TP up to
16 as in the paper's 32B runs), contexts 16K and 32K, SYNTHETIC CommonCrawl-like lengths
truncated at the context, 200K tokens per iteration in every setting (the paper's workload for
its scalability study, Fig. 11, and its solve times, App. E; `--tokens-per-global-batch`), the
same global batches for every method. Every latency is the planner core's schedule timeline
for each pipeline's micro-batches on that pipeline's analytic cost model (the timeline the
simulator reproduces), the iteration's being its slowest pipeline's. Baselines
(`dynapipe_planner.strategy.baselines`) get their best homogeneous scheme, picked on the first
iterations:
- megatron: packing to the context length (first-fit decreasing), rows split evenly, 1F1B;
- dp_balanced (re-implemented): Megatron-LM's dp_balanced packing scheduler re-implemented
  from issue #21's description (not upstream's code): arrival-order packs of the context
  length, split to a multiple of the DP size (upstream moves the last sequences of the last
  packs into packs of their own, ours halves the fullest pack), dealt round-robin, no cost
  model;
- dp_balanced (Megatron-LM), only with `--megatron-lm PATH`: upstream's own
  `DpBalancedScheduler.get_groups_and_subsamples` (megatron/core/datasets/data_schedule.py,
  not in megatron-core 0.19.2) imported from the Megatron-LM source tree at PATH, on the same
  batches; it then stands for dp_balanced in the summary;
- cost-aware dp-balanced: our own variant (no system ships it): megatron's rows balanced over
  pipelines by attention-aware cost;
- hotspa: the best scheme for each of the caps context/4, /2, /1 by GPU-seconds per token at
  half the cap, run one after another, with a hot switch of 2 bytes x parameters over NVLink
  (one node) or the network between them (generous: no optimiser-state movement).
Ablation: (a) best homogeneous scheme + greedy dispatch + packing to MaxLen, (b) + Eq. 1
packing, (c) + the heterogeneous strategy proposed for the context length (static), (d) +
per-iteration selection, (e) + DynaPipe micro-batching inside pipelines = ours. Every row's
dispatch prices sequences as the selection's default does (`SelectionConfig.dispatch_pricing`),
and (d) also prices strategies proposed from each batch's own lengths (`batch_proposals`).
Imbalance is (busiest - idlest GPU) / busiest GPU per iteration, averaged.

Dispatch pricing (issue #21): the same strategies dispatched with each pricing of
`strategy.dispatch` - "full" T(l) as Eq. 2 writes it, "constant_free" (each sequence's
constant term left out, as Hydraulis' public code does), "packed" (our extension) - and each
pipeline's Eq. 1 packing planned by the planner core under 1F1B: on the best homogeneous
strategy (rows (b)), on the static heterogeneous one (rows (c)), and inside the full
per-iteration selection (rows (d)); mean latency over the same batches.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.data import global_batches, sample_lengths
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.strategy.baselines import (
    IterationLatency,
    cost_balanced_iteration,
    dispatched_iteration,
    hotspa_iteration,
    megatron_dp_balanced_iteration,
    megatron_iteration,
    per_gpu,
)
from dynapipe_planner.strategy.dispatch import DISPATCH_PRICINGS
from dynapipe_planner.strategy.proposal import (
    Proposal,
    Strategy,
    interval_work,
    propose_strategies,
)
from dynapipe_planner.strategy.schemes import (
    AnalyticSchemeModels,
    SchemeProfile,
    analytic_scheme_models,
    profile_schemes,
    scheme_space,
    scheme_tables,
)
from dynapipe_planner.strategy.selection import SelectionConfig, StrategySelector

from .megatron_lm_dp_balanced import MegatronLmDpBalanced

SETTINGS = (
    ("llama-7b", 8),
    ("llama-7b", 16),
    ("llama-13b", 16),
    ("llama-13b", 32),
    ("llama-32b", 32),
    ("llama-32b", 64),
)
CONTEXTS = (16384, 32768)
GPU = "A800"
TOKENS_PER_ITERATION = 200_000
PICK_ITERATIONS = 4
MAX_TP = 16  # Hydraulis's 32B runs use TP16 across two nodes (its Table 3)
DP_BALANCED = "dp_balanced (re-implemented)"
DP_BALANCED_UPSTREAM = "dp_balanced (Megatron-LM)"
# The baselines that do what a published system does (the cost-aware dp-balanced is ours);
# dp_balanced is upstream's own where `--megatron-lm` gives it, else our re-implementation.
UPSTREAM_BASELINES = ("megatron", DP_BALANCED, "hotspa")


def selected(selector: StrategySelector, batch: np.ndarray) -> IterationLatency:
    choice = selector.select(batch)
    latencies = [p.latency for p in choice.pipelines]
    schemes = [p.scheme for p in choice.pipelines]
    busy = per_gpu(latencies, schemes, choice.strategy.num_gpus)
    return IterationLatency(choice.latency, tuple(busy.tolist()))


def best_of(candidates, run, batches):
    """The candidate with the lowest mean latency over `batches`."""
    return min(candidates, key=lambda c: np.mean([run(c, b).latency for b in batches]))


@dataclass(frozen=True)
class Workload:
    """One setting's per-scheme cost models and profiles, the strategies proposed from the
    data, its global batches, and the schemes a homogeneous baseline may use (they hold the
    whole context)."""

    models: AnalyticSchemeModels
    profiles: list[SchemeProfile]
    proposals: list[Proposal]
    batches: list[np.ndarray]
    fits: list[SchemeProfile]


def workload(
    model_name: str, num_gpus: int, context: int, iterations: int, tokens: int
) -> Workload:
    """The setting every method is measured on (also Hydraulis Fig. 12's)."""
    model = MODEL_PRESETS[model_name]
    models = analytic_scheme_models(model, get_gpu(GPU), num_gpus)
    schemes = scheme_space(model, num_gpus, max_tp=MAX_TP)
    profiles = profile_schemes(schemes, scheme_tables(models, context))
    data = np.minimum(sample_lengths("commoncrawl", 300_000, seed=0), context)
    stream = global_batches(data, tokens, seed=1)
    batches = [data[next(stream)] for _ in range(iterations)]
    proposals = propose_strategies(
        interval_work(data, profiles, step=128, tokens_per_iteration=tokens), num_gpus
    )
    fits = [p for p in profiles if p.max_len >= context and p.scheme.num_gpus <= num_gpus]
    return Workload(models, profiles, proposals, batches, fits)


def setting(
    model_name: str,
    num_gpus: int,
    context: int,
    iterations: int,
    trials: int,
    tokens: int,
    upstream_dp_balanced=None,
):
    """Every method's (mean latency, mean imbalance) on one setting; `upstream_dp_balanced`
    (`MegatronLmDpBalanced`) adds the row of Megatron-LM's own dp_balanced."""
    model = MODEL_PRESETS[model_name]
    gpu = get_gpu(GPU)
    work = workload(model_name, num_gpus, context, iterations, tokens)
    models, profiles, proposals, batches, fits = (
        work.models,
        work.profiles,
        work.proposals,
        work.batches,
        work.fits,
    )
    packing = StrategySelector(
        profiles, proposals, models, num_gpus, SelectionConfig(trials=trials)
    )
    default_pricing = packing.config.dispatch_pricing
    ours = StrategySelector(
        profiles, proposals, models, num_gpus, SelectionConfig(inside="dynapipe", trials=trials)
    )
    planners = packing.planners
    pick = batches[:PICK_ITERATIONS]

    def megatron(p, b):
        return megatron_iteration(b, p.scheme, num_gpus, context, planners)

    def dp_balanced(p, b):
        return megatron_dp_balanced_iteration(b, p.scheme, num_gpus, context, planners)

    def dp_balanced_upstream(p, b):
        return megatron_dp_balanced_iteration(
            b, p.scheme, num_gpus, context, planners, shares_of=upstream_dp_balanced
        )

    def cost_balanced(p, b):
        return cost_balanced_iteration(b, p, num_gpus, context, planners)

    mega_best = best_of(fits, megatron, pick)
    dpb_best = best_of(fits, dp_balanced, pick)
    cost_best = best_of(fits, cost_balanced, pick)
    hot_stages = []
    for cap in (context // 4, context // 2, context):
        holders = [p for p in profiles if p.max_len >= cap]
        cheapest = min(holders, key=lambda p: p.scheme.num_gpus * float(p.time(cap / 2)) / cap)
        hot_stages.append((cap, cheapest))
    bandwidth = gpu.intra_node_bandwidth if num_gpus <= 8 else gpu.inter_node_bandwidth
    params = sum(model.layer_params(k) for k in model.layer_kinds()) + model.embedding_params()
    switch_s = 2.0 * params / bandwidth
    homogeneous_best = Strategy.homogeneous(mega_best.scheme, num_gpus)
    static = proposals[-1].strategies[0]
    profiles_list = list(profiles)
    methods = {
        "megatron": lambda b: megatron(mega_best, b),
        DP_BALANCED: lambda b: dp_balanced(dpb_best, b),
        "cost-aware dp-balanced": lambda b: cost_balanced(cost_best, b),
        "hotspa": lambda b: hotspa_iteration(b, hot_stages, num_gpus, planners, switch_s),
        "(a) dispatch+max": lambda b: dispatched_iteration(
            b,
            homogeneous_best,
            profiles_list,
            planners,
            packing="max",
            trials=trials,
            dispatch_pricing=default_pricing,
        ),
        "(b) +Eq.1 pack": lambda b: dispatched_iteration(
            b,
            homogeneous_best,
            profiles_list,
            planners,
            packing="eq1",
            trials=trials,
            dispatch_pricing=default_pricing,
        ),
        "(c) +hetero": lambda b: dispatched_iteration(
            b,
            static,
            profiles_list,
            planners,
            packing="eq1",
            trials=trials,
            dispatch_pricing=default_pricing,
        ),
        "(d) +selection": lambda b: selected(packing, b),
        "(e) +DynaPipe=ours": lambda b: selected(ours, b),
    }
    if upstream_dp_balanced is not None:
        upstream_best = best_of(fits, dp_balanced_upstream, pick)
        methods = {
            **dict(list(methods.items())[:2]),
            DP_BALANCED_UPSTREAM: lambda b: dp_balanced_upstream(upstream_best, b),
            **dict(list(methods.items())[2:]),
        }
    results = {}
    for name, run in methods.items():
        runs = [run(b) for b in batches]
        results[name] = (
            float(np.mean([r.latency for r in runs])),
            float(np.mean([r.imbalance for r in runs])),
        )
    pricings = {}
    for pricing in DISPATCH_PRICINGS:
        selector = packing
        if pricing != default_pricing:
            config = SelectionConfig(trials=trials, dispatch_pricing=pricing)
            selector = StrategySelector(profiles, proposals, models, num_gpus, config)
        for row, strategy in (("(b) homogeneous", homogeneous_best), ("(c) static", static)):
            pricings[row, pricing] = float(
                np.mean(
                    [
                        dispatched_iteration(
                            b,
                            strategy,
                            profiles_list,
                            planners,
                            trials=trials,
                            dispatch_pricing=pricing,
                        ).latency
                        for b in batches
                    ]
                )
            )
        pricings["(d) selection", pricing] = float(
            np.mean([selected(selector, b).latency for b in batches])
        )
    chosen = {
        "megatron": mega_best.scheme,
        DP_BALANCED: dpb_best.scheme,
        "cost-aware dp-balanced": cost_best.scheme,
        "hotspa": " / ".join(str(p.scheme) for _, p in hot_stages),
        "static": static,
    }
    if upstream_dp_balanced is not None:
        chosen[DP_BALANCED_UPSTREAM] = upstream_best.scheme
    return results, chosen, tokens, pricings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--trials", type=int, default=100, help="dispatch trials (App. D.2)")
    parser.add_argument("--models", nargs="*", default=None, help="subset of the settings")
    parser.add_argument("--tokens-per-global-batch", type=int, default=TOKENS_PER_ITERATION)
    parser.add_argument(
        "--megatron-lm",
        metavar="PATH",
        help="a Megatron-LM source tree: add the row of its own DpBalancedScheduler",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: LLaMA 7B on 8 GPUs at 16K, one iteration of 50,000 tokens, 5 trials",
    )
    args = parser.parse_args()
    settings, contexts = SETTINGS, CONTEXTS
    if args.smoke:
        settings, contexts = SETTINGS[:1], CONTEXTS[:1]
        args.iterations, args.trials, args.tokens_per_global_batch = 1, 5, 50_000
    print(__doc__)
    if args.megatron_lm:
        with MegatronLmDpBalanced(args.megatron_lm) as upstream_dp:
            print(f"{DP_BALANCED_UPSTREAM}: DpBalancedScheduler of {upstream_dp.source}")
            run_settings(args, settings, contexts, upstream_dp)
    else:
        run_settings(args, settings, contexts, None)


def run_settings(args, settings, contexts, upstream_dp) -> None:
    """Every setting's tables, then the summary; `upstream_dp` (Megatron-LM's own
    dp_balanced) stands for dp_balanced where given."""
    dp_row, baselines = DP_BALANCED, UPSTREAM_BASELINES
    if upstream_dp is not None:
        dp_row = DP_BALANCED_UPSTREAM
        baselines = tuple(DP_BALANCED_UPSTREAM if k == DP_BALANCED else k for k in baselines)
    summary = []
    all_pricings = []
    for model_name, num_gpus in settings:
        if args.models and model_name not in args.models:
            continue
        for context in contexts:
            started = time.perf_counter()
            results, chosen, tokens, pricings = setting(
                model_name,
                num_gpus,
                context,
                args.iterations,
                args.trials,
                args.tokens_per_global_batch,
                upstream_dp,
            )
            ours = results["(e) +DynaPipe=ours"][0]
            print(
                f"\n{model_name} on {num_gpus} {GPU}, context {context // 1024}K, {tokens:,} "
                f"tokens/iteration, {args.iterations} iterations "
                f"({time.perf_counter() - started:.0f} s to evaluate)"
            )
            print(f"  schemes: {chosen}")
            print(
                f"  {'method':<30}{'latency s':>10}{'tokens/s':>11}{'imbalance':>11}{'ours x':>8}"
            )
            for name, (latency, imbalance) in results.items():
                print(
                    f"  {name:<30}{latency:>10.3f}{tokens / latency:>11,.0f}"
                    f"{imbalance:>11.2f}{latency / ours:>7.2f}x"
                )
            print(f"  dispatch pricing (latency s; / {DISPATCH_PRICINGS[0]!r} in brackets):")
            for row in ("(b) homogeneous", "(c) static", "(d) selection"):
                full = pricings[row, DISPATCH_PRICINGS[0]]
                cells = "".join(
                    f"  {p} {pricings[row, p]:.3f} ({pricings[row, p] / full:.3f})"
                    for p in DISPATCH_PRICINGS
                )
                print(f"    {row:<18}{cells}")
            all_pricings.append(pricings)
            upstream = min(results[k][0] for k in baselines)
            summary.append(
                (
                    model_name,
                    num_gpus,
                    context,
                    upstream / ours,
                    results[dp_row][0] / ours,
                    results["cost-aware dp-balanced"][0] / ours,
                    results[dp_row][0] / results[DP_BALANCED][0],
                )
            )
    print_pricing_summary(all_pricings)
    print(
        f"\nours vs the best of the systems' own baselines ({', '.join(baselines)}), "
        f"vs {dp_row} alone, and vs our cost-aware dp-balanced"
        + (f"; {dp_row} / {DP_BALANCED} latency:" if upstream_dp else ":")
    )
    for model_name, num_gpus, context, vs_upstream, vs_dp, vs_cost, dp_ratio in summary:
        print(
            f"  {model_name:<10}{num_gpus:>4} GPUs {context // 1024:>3}K: "
            f"{vs_upstream:.2f}x (target >= 1.30), {vs_dp:.2f}x, {vs_cost:.2f}x (target >= 1.00)"
            + (f"; {dp_ratio:.4f}" if upstream_dp else "")
        )


def print_pricing_summary(all_pricings: list[dict]) -> None:
    """Per row kind and pricing: geometric mean latency ratio to "full" over the settings, and
    in how many settings each pricing was the fastest of the three."""
    print(
        "\ndispatch pricing over all settings (geometric mean of latency / 'full'; settings won):"
    )
    for row in ("(b) homogeneous", "(c) static", "(d) selection"):
        cells = []
        for p in DISPATCH_PRICINGS:
            ratios = [r[row, p] / r[row, DISPATCH_PRICINGS[0]] for r in all_pricings]
            wins = sum(
                min(DISPATCH_PRICINGS, key=lambda q, r=r: r[row, q]) == p for r in all_pricings
            )
            cells.append(f"  {p} {np.exp(np.mean(np.log(ratios))):.4f} ({wins} won)")
        print(f"  {row:<18}{''.join(cells)}")


if __name__ == "__main__":
    main()
