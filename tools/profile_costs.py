"""Profile the per-layer cost table the planner's ProfiledCostModel and `dynapipe-search
--cost-table` read (DynaPipe seed `dynapipe.txt` §3 "Cost models"; Galvatron-BMW seed
`galvatron_bmw.txt` §V), on this machine's device: CUDA when available, else the CPU.

    python tools/profile_costs.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
        --seq-length 1024 --output costs.json
    torchrun --nproc-per-node 2 tools/profile_costs.py ... --tensor-model-parallel-size 2 \
        --output costs_tp2.json

Takes Megatron's model flags (parsed and checked by Megatron's own parser). One process profiles
TP 1; under torchrun with `--tensor-model-parallel-size` equal to the process count, every rank
runs its shard (TP's all-reduces inside the times), rank 0's numbers are written with that TP
degree, and the table also holds the world's measured all-reduce bus bandwidth
(`allreduce_bus_bandwidth`: {"ranks": bytes/s}, what the search prices DP, SDP and
pipeline traffic with), latency (`allreduce_latency_s`: {"ranks": s}, one number's
all-reduce) and what FSDP2 adds to a decoder layer sharded over the world
(`sdp_layer_forward_s`, `sdp_layer_backward_s`: {"ranks": s}, the layer at TP 1, what the
search prices an SDP layer's gathers and reduce-scatter with). One process (TP 1) also
measures what a micro-batch costs the runtime beyond its layer and output layer
(`runtime_s_per_microbatch`: {"s": seconds}, `cost_profiler.runtime_overhead_s`); on the CPU
every table records the cores it ran on and its passes' CPU share (`host_cores`,
`cpu_busy_fraction`), which bound the search's time for ranks outnumbering the cores; with
`--cpu-contention-ranks N` the one-process profile also measures how many more CPU seconds a
decoder layer's passes take as the first of N pipeline stages, the others forked copies of
itself, at the grid's smallest and largest micro-batch (`cpu_contention_factor`). It
measures `embedding`, `decoder_layer` and `lm_head` over a grid of micro-batch sizes and
sequence lengths, prints one line per grid point and writes the JSON documented in
docs/architecture.md "Cost tables" atomically (a failed run leaves no partial file). On the CPU,
set `--cpu-threads` to what each training rank uses (torchrun gives ranks 1 thread), or the
times will not describe training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dynapipe_planner.plan import atomic_write
from megatron.dynapipe.profile_grid import default_seqlens

RECOMPUTE = ("none", "selective", "full")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_profile_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The profiler's own flags (the model's are Megatron's)."""
    g = parser.add_argument_group("grid and measurement")
    g.add_argument(
        "--microbatch-sizes",
        type=_int_list,
        default=[1, 2, 4, 8, 16],
        help="comma-separated, starting at 1 (default 1,2,4,8,16)",
    )
    g.add_argument(
        "--seqlens",
        type=_int_list,
        default=None,
        help="comma-separated sequence lengths (default: 32, 48, 64, 96, ... up to --seq-length)",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="skip points with more than this many tokens (b x s); they become null (0: none)",
    )
    g.add_argument("--recompute", nargs="+", choices=RECOMPUTE, default=["none"])
    g.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time passes in wall seconds (default; what dynapipe-search's CPU tables need, "
        "with their cpu_busy_fraction) or, on the CPU, in the process's CPU seconds (what a "
        "rank with its own core spends, unaffected by other jobs: DynaPipe's planner)",
    )
    g.add_argument("--warmup-runs", type=int, default=1, help="untimed runs per point")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads on the CPU; match the training ranks (torchrun: 1)",
    )
    g.add_argument(
        "--cpu-contention-ranks",
        type=int,
        default=0,
        help="CPU, TP 1: the training ranks that will share this machine's cores (torchrun's "
        "--nproc-per-node); also measure a layer's CPU seconds as the first of that many "
        "pipeline stages (0: not)",
    )
    g.add_argument("--output", required=True, help="JSON cost table to write")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Megatron's model flags (parsed and validated by Megatron) and the profiler's own."""
    from megatron.dynapipe.arguments import ArgumentError, parse_megatron_args

    def error(message: str) -> None:
        raise ArgumentError(message)

    def one_rank(args: argparse.Namespace) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if args.pipeline_model_parallel_size != 1:
            error("--pipeline-model-parallel-size: cost tables are per layer (PP 1)")
        if args.tensor_model_parallel_size != world:
            error(
                f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: this profiler "
                f"measures one TP group, so it must equal the {world} process(es) it runs on"
            )

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_megatron_args(argv, add_profile_args, before_validation=one_rank)
    if args.seq_length is None:
        error("--seq-length is required (the longest sequence to profile)")
    if args.cpu_contention_ranks < 0 or (
        args.cpu_contention_ranks and args.tensor_model_parallel_size != 1
    ):
        error(
            f"--cpu-contention-ranks {args.cpu_contention_ranks}: a rank count >= 0, measured "
            "by the one-process (TP 1) profile"
        )
    for name in ("warmup_runs", "repeats", "cpu_threads"):
        if getattr(args, name) < (0 if name == "warmup_runs" else 1):
            error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    args.seqlens = args.seqlens or default_seqlens(args.seq_length)
    if max(args.seqlens) > args.seq_length:
        error(f"--seqlens: {max(args.seqlens)} exceeds --seq-length {args.seq_length}")
    if not args.microbatch_sizes or args.microbatch_sizes[0] != 1:
        error(f"--microbatch-sizes must start at 1, got {args.microbatch_sizes}")
    for flag, values in (
        ("--microbatch-sizes", args.microbatch_sizes),
        ("--seqlens", args.seqlens),
    ):
        if values != sorted(set(values)) or min(values) < 1:
            error(f"{flag} must be positive and strictly increasing, got {values}")
    output = Path(args.output)
    if not output.parent.is_dir():
        error(f"--output: directory {output.parent} does not exist")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    # The CPU thread pool is sized when torch loads, so before importing it.
    threads = _flag_value(sys.argv[1:] if argv is None else argv, "--cpu-threads", "1")
    os.environ["OMP_NUM_THREADS"] = threads
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    import torch

    from dynapipe_planner.megatron_model import spec_from_args
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.cost_profiler import (
        ProfileGrid,
        allreduce_bus_bandwidth,
        allreduce_latency_s,
        cpu_contention_factor,
        decoder_layer_shapes,
        device_name,
        profile_cost_table,
        runtime_overhead_s,
        sdp_layer_overhead_s,
    )
    from megatron.dynapipe.data.base import BYTE_VOCAB_SIZE
    from megatron.dynapipe.model import padded_vocab_size
    from megatron.dynapipe.world_of_one import WORLD_OF_ONE

    args = parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    tp = args.tensor_model_parallel_size
    vocab_size = padded_vocab_size(args, args.vocab_size or BYTE_VOCAB_SIZE, tp)
    grid = ProfileGrid(tuple(args.microbatch_sizes), tuple(args.seqlens), args.max_tokens)
    cpu_compat.install()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(WORLD_OF_ONE)
    ps.initialize(tp, 1, 1)
    first = int(os.environ["RANK"]) == 0
    torch.manual_seed(0)  # every TP rank draws the same inputs

    def say(line: str) -> None:
        if first:
            print(line, flush=True)

    try:
        device = ps.device()
        shape = spec_from_args(args, vocab_size, "profiled_gpt").to_dict()
        say(f"profiling {shape} at TP {tp} on {device_name(device)}")
        table = profile_cost_table(
            args,
            vocab_size,
            grid,
            tuple(args.recompute),
            device,
            warmup=args.warmup_runs,
            repeats=args.repeats,
            clock=args.clock,
            progress=say,
        )
        if tp == 1 and args.clock == "wall":  # the search's term, in its tables' clock
            overhead = runtime_overhead_s(
                args, vocab_size, device, table, warmup=args.warmup_runs, repeats=args.repeats
            )
            table["runtime_s_per_microbatch"] = overhead
            say(f"runtime per micro-batch beyond the layer and head: {overhead}")
        ranks = args.cpu_contention_ranks
        if ranks and device.type == "cpu":
            factors = {}
            for b, s in contention_points(grid):
                factors[str(b)] = cpu_contention_factor(args, vocab_size, device, ranks, b, s)
                say(f"CPU seconds of a decoder layer at b={b}, s={s} as the first of {ranks} "
                    f"pipeline stages / alone: {factors[str(b)]:.3f}")  # fmt: skip
            table["cpu_contention_factor"] = {str(ranks): factors}
        if tp > 1:
            bandwidth = allreduce_bus_bandwidth(device)
            latency = allreduce_latency_s(device)
            table["allreduce_bus_bandwidth"] = {str(tp): bandwidth}
            table["allreduce_latency_s"] = {str(tp): latency}
            shapes = decoder_layer_shapes(args, vocab_size, device)
            sdp = sdp_layer_overhead_s(shapes, device, dtype=args.params_dtype)
            table["sdp_layer_forward_s"] = {str(tp): sdp.forward_s}
            table["sdp_layer_backward_s"] = {str(tp): sdp.backward_s}
            table["sdp_layer_transient_bytes"] = {str(tp): sdp.transient_bytes}
            if device.type == "cpu":
                table["sdp_layer_cpu_busy_fraction"] = {str(tp): sdp.cpu_busy_fraction}
            say(
                f"all-reduce bus bandwidth over {tp} ranks: {bandwidth / 1e9:.3f} GB/s, "
                f"latency {latency * 1e3:.3f} ms; FSDP2 on a decoder layer over {tp} ranks: "
                f"forward +{sdp.forward_s * 1e3:.2f} ms, backward +{sdp.backward_s * 1e3:.2f} ms"
            )
    finally:
        ps.destroy()
    if first:
        atomic_write(Path(args.output), (json.dumps(table, indent=1) + "\n").encode())
        say(f"wrote {args.output}")
    return 0


def contention_points(grid) -> list[tuple[int, int]]:
    """Where `--cpu-contention-ranks` measures: the smallest and the largest micro-batch of
    the grid at the longest sequence each may take (a handful of passes is hand-off time, a
    large one its compute; the search interpolates between them)."""
    points = {}
    for b, s in grid.points():
        if not grid.max_tokens or b * s <= grid.max_tokens:
            points[b] = max(points.get(b, 0), s)
    sizes = sorted(points)
    return [(b, points[b]) for b in sorted({sizes[0], sizes[-1]})] if sizes else []


def _flag_value(argv: Sequence[str], flag: str, default: str) -> str:
    """A flag's value read before any parser runs (the thread count must precede torch)."""
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return default


if __name__ == "__main__":
    sys.exit(main())
