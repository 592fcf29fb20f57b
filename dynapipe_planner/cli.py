"""Command-line entry points: `dynapipe-plan` and `dynapipe-simulate`.

`dynapipe-plan` plans global batches from a length file or a built-in synthetic preset and prints
DynaPipe next to the baselines (predicted iteration time, tokens/s, padding efficiency, peak
memory, bubble fraction); it can write DynaPipe's plans as JSON or binary. `dynapipe-simulate`
replays a plan file (homogeneous, or heterogeneous with one cost model per pipeline) through the
event-driven simulator and writes a Chrome trace and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .cli_args import (
    OneLineParser,
    add_cluster_flags,
    add_memory_limit_flag,
    add_renamed,
    check_output_dir,
    check_output_file,
    nonnegative_int,
    positive_int,
    report_error,
    sample_count,
    seed,
    sequence_cap,
)
from .cluster import ClusterSpec, GiB, get_gpu
from .cost import (
    AnalyticCostModel,
    PipelineCosts,
    ProfiledCostModel,
    cost_model_from_description,
)
from .cost.table import mix_stages
from .data import PRESETS, global_batches, load_lengths, sample_lengths, sample_tokens, truncate
from .errors import PlanningError, iteration_name
from .model_spec import MODEL_PRESETS, load_model_spec
from .plan import ExecutionPlan, MicroBatch, load_plan
from .planner import BATCHING, RECOMPUTE, SCHEDULES, IterationPlanner, PlannerConfig

# (label, batching, schedule): DynaPipe first, then the ablation and the baselines (seed §8).
METHODS = (
    ("dynapipe", "dynamic", "adaptive"),
    ("dynamic+1f1b", "dynamic", "1f1b"),
    ("packing+1f1b", "packing", "1f1b"),
    ("token-budget+1f1b", "token-budget", "1f1b"),
    ("padding+1f1b", "padding", "1f1b"),
)


def _plan_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="dynapipe-plan",
        description="Plan variable-length training iterations and compare micro-batching methods.",
    )
    data = p.add_argument_group("data")
    src = data.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="lengths file: .txt, .npy, .jsonl, or Megatron .idx/.bin")
    src.add_argument("--preset", choices=sorted(PRESETS), help="synthetic length distribution")
    data.add_argument(
        "--num-samples", type=sample_count, default=20000, help="samples drawn from a preset"
    )
    data.add_argument("--field", help="jsonl key holding the input (default input_ids/text)")
    data.add_argument("--target-field", help="jsonl key holding targets (encoder-decoder)")
    data.add_argument(
        "--seq-length",
        type=sequence_cap,
        default=0,
        help="truncate samples to this many tokens (default 0: no truncation)",
    )
    data.add_argument(
        "--tokens-per-global-batch",
        type=positive_int,
        default=65536,
        help="tokens per global batch (as many whole samples as fit)",
    )
    data.add_argument("--seed", type=seed, default=0, help="sampling and batching seed")
    model = p.add_argument_group("model")
    model.add_argument(
        "--model", default="gpt-6.7b", help=f"preset ({', '.join(MODEL_PRESETS)}) or JSON"
    )
    model.add_argument("--cost-table", help="profiled cost table JSON (default: analytic model)")
    model.add_argument("--flash-attention", action="store_true", help="no s^2 activation memory")
    cluster = p.add_argument_group("cluster")
    add_cluster_flags(
        cluster, None, "GPUs: TP x PP x data-parallel replicas (default: TP x PP, one replica)"
    )
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, default=4)
    memory = p.add_argument_group("memory")
    add_memory_limit_flag(memory)
    memory.add_argument("--recompute", choices=RECOMPUTE, default="auto")
    plan = p.add_argument_group("planning")
    plan.add_argument("--iterations", type=positive_int, default=1, help="global batches to plan")
    plan.add_argument("--batching", choices=(*BATCHING, "all"), default="all")
    plan.add_argument("--pipeline-schedule", choices=SCHEDULES, default="adaptive")
    plan.add_argument("--order", choices=("sort", "tsp"), default="sort")
    plan.add_argument(
        "--micro-batch-size", type=nonnegative_int, default=0, help="fix it for baselines"
    )
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", help="write each iteration's plan here")
    out.add_argument("--format", choices=("json", "bin"), default="json")
    out.add_argument("--json", action="store_true", help="print the results as JSON")
    add_renamed(p, PLAN_RENAMED)
    return p


# dynapipe-plan's spellings before #35, refused with their replacement.
PLAN_RENAMED = {
    "--global-batch-tokens": "--tokens-per-global-batch",
    "--max-seqlen": "--seq-length",
    "--tp": "--tensor-model-parallel-size",
    "--pp": "--pipeline-model-parallel-size",
    "--dp": "--num-gpus (GPUs: TP x PP x data-parallel replicas)",
    "--memory-limit-gb": "--memory-limit-gib",
    "--schedule": "--pipeline-schedule",
}


def _replicas(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Data-parallel replicas: the GPUs over TP x PP, as Megatron derives its DP size."""
    per_replica = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.num_gpus is None:
        return 1
    if args.num_gpus % per_replica:
        parser.error(
            f"argument --num-gpus: {args.num_gpus} GPUs are not a multiple of TP x PP = "
            f"{args.tensor_model_parallel_size} x {args.pipeline_model_parallel_size}"
        )
    return args.num_gpus // per_replica


def _cost_model(args: argparse.Namespace):
    model = load_model_spec(args.model)
    cluster = ClusterSpec(
        get_gpu(args.gpu),
        num_stages=args.pipeline_model_parallel_size,
        num_replicas=args.replicas,
        tp=args.tensor_model_parallel_size,
        gpus_per_node=args.gpus_per_node,
        memory_limit_bytes=int(args.memory_limit_gib * GiB),
    )
    if args.cost_table:
        return ProfiledCostModel.load(args.cost_table, model, cluster), cluster
    return AnalyticCostModel(model, cluster, flash_attention=args.flash_attention), cluster


def _lengths(args: argparse.Namespace, encoder_decoder: bool) -> np.ndarray:
    if args.lengths:
        lengths = load_lengths(args.lengths, field=args.field, target_field=args.target_field)
    else:
        lengths = sample_lengths(
            args.preset or "flan", args.num_samples, seed=args.seed, with_targets=encoder_decoder
        )
    return truncate(lengths, args.seq_length) if args.seq_length else lengths


def plan_main(argv: Sequence[str] | None = None) -> int:
    parser = _plan_parser()
    args = parser.parse_args(argv)
    check_output_dir(parser, "--output-dir", args.output_dir)
    args.replicas = _replicas(parser, args)
    try:
        return _run_plan(args)
    except PlanningError as e:
        report_error("dynapipe-plan", e, args)
        return 2


def _run_plan(args: argparse.Namespace) -> int:
    cost_model, cluster = _cost_model(args)
    lengths = _lengths(args, cost_model.model.is_encoder_decoder)
    longest = int(sample_tokens(lengths).max())
    if args.tokens_per_global_batch < longest:
        raise PlanningError(
            f"--tokens-per-global-batch {args.tokens_per_global_batch} cannot hold the longest "
            f"sample ({longest} tokens); a global batch holds whole samples (--seq-length "
            "truncates)"
        )
    methods = [m for m in METHODS if args.batching in ("all", m[1])]
    if args.batching != "all":
        schedule = args.pipeline_schedule
        methods = [(f"{args.batching}+{schedule}", args.batching, schedule)]
    planners = {
        label: IterationPlanner(
            cost_model,
            cluster.num_stages,
            PlannerConfig(
                batching=batching,
                schedule=schedule,
                recompute=args.recompute,
                order=args.order,
                num_replicas=cluster.num_replicas,
                micro_batch_size=args.micro_batch_size,
                max_seqlen=args.seq_length,
            ),
        )
        for label, batching, schedule in methods
    }
    batches = global_batches(lengths, args.tokens_per_global_batch, seed=args.seed)
    results: dict[str, list[dict]] = {label: [] for label in planners}
    to_write: list[tuple[Path, ExecutionPlan]] = []
    unplannable: str | None = None  # the first iteration no method could plan, and why
    started = time.perf_counter()
    for it in range(args.iterations):
        try:
            idx = next(batches)
        except StopIteration:
            break
        for label, planner in planners.items():
            try:
                plan = planner.plan(lengths[idx], idx)
            except PlanningError as e:
                results[label].append({"error": str(e)})
                continue
            results[label].append(plan.stats)
            if args.output_dir and label == methods[0][0]:
                to_write.append((Path(args.output_dir) / f"iter_{it:05d}.{args.format}", plan))
        if unplannable is None and all("error" in runs[-1] for runs in results.values()):
            why = next(iter(results.values()))[-1]["error"]
            unplannable = f"{iteration_name(it)}: no plan fits ({why})"
        if args.iterations > 1:
            print(
                f"[{it + 1}/{args.iterations}] {len(idx)} samples planned "
                f"({time.perf_counter() - started:.1f} s elapsed)",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(_table(results, args, cluster))
    if unplannable is not None:  # the table says what fits; nothing is written
        print(f"dynapipe-plan: error: {unplannable}", file=sys.stderr)
        return 2
    for path, plan in to_write:
        plan.save(path, args.format)
    return 0


def _table(results: dict[str, list[dict]], args: argparse.Namespace, cluster: ClusterSpec) -> str:
    head = (
        f"{args.model} on {cluster.num_replicas}x{cluster.num_stages}x{cluster.tp} (DPxPPxTP) "
        f"{cluster.gpu.name}, {args.tokens_per_global_batch} tokens per global batch, "
        f"means over {max(len(v) for v in results.values())} iteration(s), "
        "predicted by the cost model"
    )
    cols = f"{'method':<19}{'iter s':>9}{'tokens/s':>11}{'pad eff':>9}{'peak GiB':>10}"
    cols += f"{'bubble':>8}{'#mb':>6}{'recompute':>20}{'plan ms':>9}"
    lines = [head, cols, "-" * len(cols)]
    base = None
    for label, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"{label:<19}infeasible: {runs[0]['error'] if runs else 'no data'}")
            continue

        def mean(key: str, ok=ok) -> float:
            return float(np.mean([r[key] for r in ok]))

        tps = float(
            np.sum([r["tokens"] for r in ok]) / np.sum([r["predicted_iteration_s"] for r in ok])
        )
        base = base or tps
        peak = max(max(r["peak_memory_bytes"]) for r in ok) / GiB
        modes = "/".join(sorted({r["recompute"] for r in ok}))
        lines.append(
            f"{label:<19}{mean('predicted_iteration_s'):>9.3f}{tps:>11.0f}"
            f"{mean('padding_efficiency'):>9.3f}{peak:>10.1f}{mean('bubble_fraction'):>8.3f}"
            f"{mean('num_microbatches'):>6.0f}{modes:>20}{1e3 * mean('planning_time_s'):>9.1f}"
        )
        failed = [r["error"] for r in runs if "error" in r]
        if failed:
            lines.append(f"{'':<19}{len(failed)}/{len(runs)} iterations infeasible: {failed[0]}")
    return "\n".join(lines)


def _simulate_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="dynapipe-simulate",
        description="Check a plan (deadlock, order, shapes, memory) and time it by its cost model.",
    )
    p.add_argument("plan", help="plan file (.json or .bin) written by dynapipe-plan")
    checks = p.add_argument_group("checks")
    checks.add_argument(
        "--no-memory-check", action="store_true", help="do not check each stage's peak memory"
    )
    out = p.add_argument_group("output")
    out.add_argument("--trace", help="write a Chrome trace (open in https://ui.perfetto.dev)")
    out.add_argument("--png", help="write a timeline image")
    return p


def _plan_costs(plan: ExecutionPlan, source: str) -> PipelineCosts | list[PipelineCosts]:
    """Rebuild the cost tables a plan was made with, from the descriptions it carries: one for
    a homogeneous plan, one per replica (its meta["cost_models"]) for a heterogeneous one."""
    if not plan.replicas:
        if "cost_model" not in plan.meta:
            raise PlanningError(f"{source}: plan carries no cost model description in meta")
        recompute = plan.stats.get("recompute", "none")
        return _tables(plan.meta["cost_model"], recompute, plan.microbatches)
    descriptions = plan.meta.get("cost_models", [])
    if len(descriptions) != plan.num_replicas:
        raise PlanningError(
            f"{source}: heterogeneous plan of {plan.num_replicas} replicas carries "
            f"{len(descriptions)} cost model description(s) in meta['cost_models']"
        )
    pipelines = plan.stats.get("pipelines", [{}] * plan.num_replicas)
    if len(pipelines) != plan.num_replicas:
        raise PlanningError(
            f"{source}: stats['pipelines'] has {len(pipelines)} entries for "
            f"{plan.num_replicas} replicas"
        )
    return [
        _tables(
            descriptions[k],
            pipelines[k].get("recompute", "none"),
            [m for m in plan.microbatches if m.replica == k],
        )
        for k in range(plan.num_replicas)
    ]


def _tables(
    description: dict, recompute: str | list[str], microbatches: list[MicroBatch]
) -> PipelineCosts:
    """Cost tables whose grid covers the given micro-batches (a replica may have none), under
    the plan's one recompute mode or its mode per stage."""
    model = cost_model_from_description(description)
    hints = {
        "max_samples": max((len(m.samples) for m in microbatches), default=1),
        "max_seqlen": max((m.seqlen for m in microbatches), default=1),
        "max_tgt_seqlen": max((m.tgt_seqlen for m in microbatches), default=0),
    }
    if isinstance(recompute, str):
        return model.pipeline_costs(recompute, **hints)
    return mix_stages([model.pipeline_costs(m, **hints) for m in recompute])


def simulate_main(argv: Sequence[str] | None = None) -> int:
    from .simulate import simulate
    from .trace import write_chrome_trace, write_timeline_png

    parser = _simulate_parser()
    args = parser.parse_args(argv)
    check_output_file(parser, "--trace", args.trace)
    check_output_file(parser, "--png", args.png)
    try:
        plan = load_plan(args.plan)
        costs = _plan_costs(plan, args.plan)
        result = simulate(plan, costs, check_memory=not args.no_memory_check)
    except PlanningError as e:
        report_error("dynapipe-simulate", e, args)
        return 2
    summary = result.summary()
    predicted = plan.stats.get("predicted_iteration_s")
    if predicted:
        summary["planner_predicted_s"] = predicted
    print(json.dumps(summary, indent=1))
    if args.trace:
        write_chrome_trace(result, args.trace)
    if args.png:
        write_timeline_png(result, args.png)
    return 0
