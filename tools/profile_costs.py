"""Profile the per-layer cost table the planner's ProfiledCostModel reads (DynaPipe seed
`dynapipe.txt` §3 "Cost models"), on this machine's device: CUDA when available, else the CPU.

    python tools/profile_costs.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
        --seq-length 1024 --output costs.json

Takes Megatron's model flags (TP 1), measures `embedding`, `decoder_layer` and `lm_head` over a
grid of micro-batch sizes and sequence lengths, prints one line per grid point and writes the JSON
documented in README "Cost tables" atomically (a failed run leaves no partial file). On the CPU,
set `--cpu-threads` to what each training rank uses (torchrun gives ranks 1 thread), or the
times will not describe training.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from dynapipe_planner.plan import atomic_write

RECOMPUTE = ("none", "selective", "full")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def default_seqlens(max_seqlen: int, smallest: int = 32) -> list[int]:
    """Powers of two and the points halfway between them in log scale (x1.5), up to and
    including `max_seqlen`: attention grows with s^2, so linear interpolation needs points
    closer than an octave."""
    points, p = [], smallest
    while p < max_seqlen:
        points += [p, p * 3 // 2]
        p *= 2
    return sorted({x for x in points if x < max_seqlen} | {max_seqlen})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="profile_costs.py", description=__doc__.split("\n\n")[0])
    m = parser.add_argument_group("model (Megatron names)")
    m.add_argument("--num-layers", type=int, default=1, help="recorded only: costs are per layer")
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    m.add_argument("--seq-length", type=int, required=True, help="longest sequence to profile")
    m.add_argument("--max-position-embeddings", type=int, default=None)
    m.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="tokenizer vocabulary, padded to a multiple of 128 as Megatron does (default: the "
        "byte tokenizer of the built-in corpora)",
    )
    m.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
    )
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--bf16", action="store_true")
    m.add_argument("--fp16", action="store_true")
    m.add_argument("--tensor-model-parallel-size", type=int, default=1)
    m.add_argument("--seed", type=int, default=1234)
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
    g.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads on the CPU; match the training ranks (torchrun: 1)",
    )
    g.add_argument("--output", required=True, help="JSON cost table to write")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    positive = (
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "num_layers",
        "warmup",
        "repeats",
        "cpu_threads",
    )
    for name in positive:
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.tensor_model_parallel_size != 1:
        parser.error("--tensor-model-parallel-size: this profiler measures TP 1 only")
    if args.hidden_size % args.num_attention_heads:
        parser.error(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    if args.bf16 and args.fp16:
        parser.error("--bf16 and --fp16 exclude each other")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        parser.error(
            f"--max-position-embeddings {args.max_position_embeddings} < --seq-length "
            f"{args.seq_length}"
        )
    args.seqlens = args.seqlens or default_seqlens(args.seq_length)
    if max(args.seqlens) > args.seq_length:
        parser.error(f"--seqlens: {max(args.seqlens)} exceeds --seq-length {args.seq_length}")
    if not args.microbatch_sizes or args.microbatch_sizes[0] != 1:
        parser.error(f"--microbatch-sizes must start at 1, got {args.microbatch_sizes}")
    for flag, values in (
        ("--microbatch-sizes", args.microbatch_sizes),
        ("--seqlens", args.seqlens),
    ):
        if values != sorted(set(values)) or min(values) < 1:
            parser.error(f"{flag} must be positive and strictly increasing, got {values}")
    output = Path(args.output)
    if not output.parent.is_dir():
        parser.error(f"--output: directory {output.parent} does not exist")
    return args


def _single_rank_environment() -> None:
    """A one-rank gloo/nccl world for megatron-core's parallel state."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # The CPU thread pool is sized when torch loads, so before importing it.
    os.environ["OMP_NUM_THREADS"] = str(args.cpu_threads)
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    import torch

    from dynapipe_planner.model_spec import ModelSpec
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.cost_profiler import ProfileGrid, device_name, profile_cost_table
    from megatron.dynapipe.data import BYTE_VOCAB_SIZE
    from megatron.dynapipe.model import ModelOptions, padded_vocab_size

    torch.set_num_threads(args.cpu_threads)
    spec = ModelSpec(
        "profiled_gpt",
        "gpt",
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.ffn_hidden_size,
        padded_vocab_size(args.vocab_size or BYTE_VOCAB_SIZE, 1),
        max_position_embeddings=args.max_position_embeddings,
    )
    options = ModelOptions(
        dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        position_embedding=args.position_embedding_type,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        seed=args.seed,
    )
    grid = ProfileGrid(tuple(args.microbatch_sizes), tuple(args.seqlens), args.max_tokens)
    cpu_compat.install()
    _single_rank_environment()
    ps.initialize(1, 1, 1)
    try:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        print(f"profiling {spec.to_dict()} on {device_name(device)}", flush=True)
        table = profile_cost_table(
            spec,
            options,
            grid,
            tuple(args.recompute),
            device,
            warmup=args.warmup,
            repeats=args.repeats,
            progress=lambda line: print(line, flush=True),
        )
    finally:
        ps.destroy()
    atomic_write(Path(args.output), (json.dumps(table, indent=1) + "\n").encode())
    print(f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
