"""`dynapipe-hetero`: plan one training job on a heterogeneous cluster with HexiScale's
two-phase search (seed hexiscale.txt §4) and print the plan, its cost and, on request, the
baselines of §5 in the same cost model.

Progress goes to stderr, the plan table and the comparison to stdout, the plan JSON (atomic)
to --output.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..cli_args import (
    OneLineParser,
    add_renamed,
    check_output_file,
    nonnegative_int,
    positive_int,
    report_error,
    seed,
    sequence_length,
)
from ..cost.analytic import RECOMPUTE_CHOICES
from ..devices import load_cluster
from ..errors import PlanningError
from ..model_spec import MODEL_PRESETS, load_model_spec
from .baselines import galvatron_symmetric, homogeneous_reference, megatron_symmetric, metis_style
from .cost import HeteroCostModel, TrainingJob
from .milp import MAX_DEVICES, milp_reference
from .plan_file import plan_table, save_plan
from .rank_binding import bind_ranks
from .search import SearchConfig, hexiscale_search
from .simulate import simulate_plan

# The 1F1B replay (`simulate_plan`) walks every micro-batch of every pipeline.
MAX_MICRO_BATCHES = 100_000


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dynapipe-hetero", description=__doc__.splitlines()[0])
    data = p.add_argument_group("data")
    data.add_argument("--seq-length", type=sequence_length, default=4096)
    data.add_argument(
        "--global-batch-size", type=positive_int, default=128, help="samples per iteration"
    )
    data.add_argument("--micro-batch-size", type=positive_int, default=1)
    model = p.add_argument_group("model")
    model.add_argument("--model", default="llama2-7b", help=f"{', '.join(MODEL_PRESETS)} or JSON")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument(
        "--cluster", required=True, help="cluster YAML (see examples/clusters/): GPUs and links"
    )
    memory = p.add_argument_group("memory")
    memory.add_argument(
        "--recompute",
        choices=RECOMPUTE_CHOICES,
        default="auto",
        help="activation recomputation: auto (default): each stage the fastest mode whose "
        "memory holds its layers (the plan file lists the modes; pretrain_gpt.py --hetero-plan "
        "runs each stage in its mode); or one mode on every stage (full: App. A's assumption)",
    )
    memory.add_argument(
        "--no-shard-optimizer",
        action="store_true",
        help="keep full optimiser states on every pipeline (default: sharded over pipelines)",
    )
    search = p.add_argument_group("search")
    search.add_argument(
        "--max-plans",
        type=positive_int,
        default=200,
        help="plans priced before the search keeps its best (a count, so that a busy machine "
        "finds the same plan)",
    )
    search.add_argument(
        "--max-dp", type=nonnegative_int, default=0, help="most pipelines (0: no limit)"
    )
    search.add_argument("--tau", type=positive_int, default=2, help="stage-order branching (§4.3)")
    search.add_argument("--seed", type=seed, default=0, help="the search's seed")
    search.add_argument("--baselines", action="store_true", help="compare with §5's baselines")
    search.add_argument(
        "--exact", action="store_true", help=f"also solve exactly (<= {MAX_DEVICES} GPUs)"
    )
    out = p.add_argument_group("output")
    out.add_argument("--output", help="write the plan JSON here")
    out.add_argument(
        "--bind-ranks",
        action="store_true",
        help="write the plan with devices renumbered as launcher ranks (each pipeline's stages "
        "on increasing ranks, as `pretrain_gpt.py --hetero-plan` needs) and print which "
        "cluster device each rank stands for",
    )
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_renamed(p, HETERO_RENAMED)
    return p


# dynapipe-hetero's spellings before #35, refused with their replacement.
HETERO_RENAMED = {"--seqlen": "--seq-length", "--global-batch": "--global-batch-size"}


def hetero_main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_output_file(parser, "--output", args.output)
    if args.global_batch_size // args.micro_batch_size > MAX_MICRO_BATCHES:
        parser.error(
            f"argument --global-batch-size: {args.global_batch_size} samples are "
            f"{args.global_batch_size // args.micro_batch_size} micro-batches of "
            f"{args.micro_batch_size}; the 1F1B replay takes at most {MAX_MICRO_BATCHES}"
        )
    say = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        cluster = load_cluster(args.cluster)
        job = TrainingJob(
            load_model_spec(args.model),
            seqlen=args.seq_length,
            global_batch=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            recompute=args.recompute,
            shard_optimizer=not args.no_shard_optimizer,
        )
        cost = HeteroCostModel(cluster, job)
        config = SearchConfig(
            max_plans=args.max_plans, max_dp=args.max_dp, tau=args.tau, seed=args.seed
        )
        result = hexiscale_search(cost, config, say)
        plan, est = result.plan, result.estimate
        sim = simulate_plan(cost, plan)
        plan.stats["simulated_iteration_s"] = sim.iteration_s
        print(plan_table(plan, lambda d: cluster.gpu(d).name))
        print(
            f"\n{cluster.name}: {cluster.num_devices} GPUs, {job.model.name}, "
            f"{job.global_batch} x {job.seqlen} tokens per iteration\n"
            f"hexiscale: {est.iteration_s:.3f} s/iteration (1F1B replay {sim.iteration_s:.3f} s), "
            f"DP sync {est.dp_sync_s:.3f} s, MFU {est.mfu:.1%}, "
            f"searched {result.evaluated} plans in {result.elapsed_s:.1f} s"
        )
        if args.baselines:
            say("baselines ...")
            print(f"\n{'system':<40} {'MFU':>7} {'s/iter':>9}  layout")
            rows = [("hexiscale", est.mfu, est.iteration_s, f"DP={len(plan.pipelines)}")]
            for fn in (megatron_symmetric, galvatron_symmetric, metis_style):
                b = fn(cost)
                rows.append((b.name, b.mfu, b.iteration_s, b.layout))
            h = homogeneous_reference(cost, config)
            rows.append((h.name, h.mfu, h.iteration_s, h.layout))
            for name, mfu, t, layout in rows:
                print(f"{name:<40} {mfu:>7.1%} {t:>9.3f}  {layout[:90]}")
        if args.exact:
            say("exact reference (CP-SAT) ...")
            _, exact = milp_reference(cost)
            print(f"exact: MFU {exact.mfu:.1%}; hexiscale is {exact.mfu - est.mfu:+.2%} below it")
        if args.bind_ranks:
            binding = bind_ranks(plan)
            plan = binding.plan
            print(
                "\nranks: "
                + ", ".join(
                    f"{r}=device {d} ({cluster.machine_of(d).name})"
                    for r, d in enumerate(binding.device_of_rank)
                )
            )
        if args.output:
            save_plan(plan, args.output)
            say(f"plan written to {os.path.abspath(args.output)}")
    except PlanningError as e:
        report_error("dynapipe-hetero", e, args)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(hetero_main())
