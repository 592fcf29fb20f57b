"""`dynapipe-search`: Galvatron-BMW search from the command line (seed `galvatron_bmw.txt`).

Searches per-layer DP / SDP / TP / CKPT strategies, the PP degree and partition, the
micro-batch count and the global batch for a model on N GPUs under a per-GPU memory budget,
priced by the analytic model of a GPU preset or by profiled cost tables (`--cost-table`, see
`profiled_inputs`);
prints a summary table, the Megatron-LM and runtime flags when the plan is uniform enough (else
`pretrain_gpt.py --parallel-plan` with the plan file, when the runtime can run it), and writes
the plan file (`--output`). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from itertools import groupby

from ..cli_args import (
    OneLineParser,
    add_cluster_flags,
    add_memory_limit_flag,
    add_renamed,
    bin_count,
    check_output_file,
    positive_float,
    positive_int,
    report_error,
    sample_count,
    sequence_length,
)
from ..cluster import GiB, default_memory_limit_bytes, get_gpu
from ..errors import PlanningError
from ..model_spec import MODEL_PRESETS, load_model_spec
from .cost_inputs import analytic_cost_inputs
from .optimizer import SearchResult, search
from .plan_file import megatron_flags, runtime_command, write_plan
from .profiled_inputs import profiled_cost_inputs, read_cost_tables
from .runnable import runnable_search


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dynapipe-search", description=__doc__.splitlines()[0])
    data = p.add_argument_group("data")
    data.add_argument("--seq-length", type=sequence_length, default=1024)
    data.add_argument(
        "--decoder-seq-length", type=sequence_length, default=None, help="T5 decoder length"
    )
    data.add_argument(
        "--global-batch-size", type=sample_count, default=None, help="default: search it"
    )
    data.add_argument("--max-batch-size", type=sample_count, default=8192)
    model = p.add_argument_group("model")
    model.add_argument("--model", default="gpt-1.3b", help=f"{', '.join(MODEL_PRESETS)} or JSON")
    model.add_argument("--flash-attention", action="store_true")
    model.add_argument(
        "--overlap-slowdown", type=positive_float, default=1.3, help="§V, default 1.3"
    )
    model.add_argument(
        "--cost-table",
        nargs="+",
        default=None,
        metavar="FILE",
        help="profiled cost tables from tools/profile_costs.py (one per TP degree) instead of "
        "the analytic model and --gpu; --model must describe the profiled layers",
    )
    cluster = p.add_argument_group("cluster")
    add_cluster_flags(cluster, 8)
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--pipeline-model-parallel-size",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="PP",
        help="the PP degree, or the degrees to try (default: every one)",
    )
    par.add_argument("--max-tp", type=positive_int, default=None, help="largest TP degree")
    par.add_argument(
        "--even-partition", action="store_true", help="split layers evenly over stages"
    )
    memory = p.add_argument_group("memory")
    add_memory_limit_flag(
        memory,
        "the budget: GiB per GPU (default 0: the GPU's memory minus a reserve; give it with "
        "--cost-table)",
    )
    memory.add_argument(
        "--memory-bins", type=bin_count, default=256, help="layer DP memory resolution"
    )
    s = p.add_argument_group("search")
    s.add_argument("--base", action="store_true", help="Galvatron-Base: no bi-objective step")
    s.add_argument("--no-prune", action="store_true", help="keep DP+SDP trees (Takeaway #3)")
    s.add_argument(
        "--runnable",
        action="store_true",
        help="only plans pretrain_gpt.py --parallel-plan runs (one TP degree for every layer)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--output", help="write the plan file (JSON) here")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    add_renamed(p, SEARCH_RENAMED)
    return p


# dynapipe-search's spellings before #35, refused with their replacement.
SEARCH_RENAMED = {
    "--memory-budget-gb": "--memory-limit-gib",
    "--pp": "--pipeline-model-parallel-size",
    "--tgt-seq-length": "--decoder-seq-length",
}


def _memory_budget(parser: argparse.ArgumentParser, args: argparse.Namespace, gpu) -> float:
    """Bytes per GPU: `--memory-limit-gib`, else (0) what `--gpu` leaves after a reserve."""
    if args.memory_limit_gib:
        return args.memory_limit_gib * GiB
    if args.cost_table:
        parser.error(
            "argument --memory-limit-gib: give the budget per GPU with --cost-table (the "
            "profiled device's memory is not --gpu's)"
        )
    return float(default_memory_limit_bytes(gpu))


class _ProgressBar:
    """A one-line bar on stderr, redrawn at most ten times a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.last = 0.0
        self.started = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        print(
            f"\r[{bar}] {done}/{total} configurations  {now - self.started:.1f} s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def _runs(strategies) -> str:
    return ", ".join(f"{k} x{len(list(g))}" for k, g in groupby(str(s) for s in strategies))


def summary(result: SearchResult) -> str:
    """The plan as a table: one row per stage, then the totals."""
    lines = [f"{'stage':>5}{'layers':>8}{'memory GiB':>12}{'time s':>9}  strategies (runs)"]
    start = 0
    for i, stage in enumerate(result.stage_strategies()):
        lines.append(
            f"{i:>5}{f'{start}-{start + len(stage) - 1}':>8}"
            f"{result.stage_memory_bytes[i] / GiB:>12.2f}{result.stage_time_s[i]:>9.3f}  "
            f"{_runs(stage)}"
        )
        start += len(stage)
    lines.append(
        f"throughput {result.throughput:.2f} samples/s; global batch {result.global_batch_size} "
        f"= {result.num_microbatches} micro-batches of {result.microbatch_size}; PP "
        f"{result.pp}, partition {result.partition}; iteration {result.iteration_time_s:.3f} s"
    )
    if result.bi_objective:
        lines.append(f"memory-balanced only (Galvatron-Base): {result.base_throughput:.2f}")
    lines.append(
        f"searched {result.evaluated} configurations in {result.search_time_s:.2f} s; budget "
        f"{result.memory_budget_bytes / GiB:.2f} GiB per GPU"
    )
    return "\n".join(lines)


def search_main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_output_file(parser, "--output", args.output)
    try:
        model = load_model_spec(args.model)
        gpu = get_gpu(args.gpu)
        budget = _memory_budget(parser, args, gpu)
        if args.cost_table:
            inputs = profiled_cost_inputs(
                model,
                read_cost_tables(args.cost_table),
                args.num_gpus,
                seq_length=args.seq_length,
                max_tp=args.max_tp,
                overlap_slowdown=args.overlap_slowdown,
            )
        else:
            inputs = analytic_cost_inputs(
                model,
                gpu,
                args.num_gpus,
                gpus_per_node=args.gpus_per_node,
                seq_length=args.seq_length,
                tgt_seq_length=args.decoder_seq_length,
                overlap_slowdown=args.overlap_slowdown,
                flash_attention=args.flash_attention,
            )
        bar = _ProgressBar(not args.quiet)
        try:
            result = (runnable_search if args.runnable else search)(
                model,
                inputs,
                args.num_gpus,
                budget,
                global_batch_size=args.global_batch_size,
                max_batch_size=args.max_batch_size,
                pp_degrees=args.pipeline_model_parallel_size,
                max_tp=args.max_tp,
                bi_objective=not args.base,
                prune=not args.no_prune,
                memory_bins=args.memory_bins,
                even_partition=args.even_partition,
                progress=bar,
            )
        finally:
            bar.close()
    except PlanningError as e:
        report_error("dynapipe-search", e, args)
        return 2
    where = (
        f"profiled on {', '.join(inputs.description['devices'])} ({' '.join(args.cost_table)})"
        if args.cost_table
        else f"{gpu.name} ({args.gpus_per_node} per node)"
    )
    print(f"{model.name} on {args.num_gpus} {where}, sequence length {args.seq_length}")
    print(summary(result))
    runtime = runtime_command(result, model, args.seq_length, args.output)
    megatron = megatron_flags(result, model)
    for name, flags in (("Megatron-LM", megatron), ("pretrain_gpt.py", runtime)):
        if flags.expressible:
            print(f"{name}: {flags.command_line()}")
        else:
            print(f"{name}: cannot express this plan: {'; '.join(flags.notes)}")
            continue
        for note in flags.notes:
            print(f"  note: {note}")
    if args.output:
        write_plan(
            result,
            args.output,
            model,
            seq_length=args.seq_length,
            gpu=", ".join(inputs.description["devices"]) if args.cost_table else gpu.name,
            num_gpus=args.num_gpus,
            gpus_per_node=args.gpus_per_node,
        )
        print(f"plan written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(search_main())
