"""Command-line flags: Megatron's names for what Megatron users already set, plus DynaPipe's own.

`add_dynapipe_args(parser)` adds only DynaPipe's group and returns the parser, so it also works as
Megatron's `extra_args_provider`. `parse_args()` builds the full parser that `pretrain_gpt.py`
uses: the Megatron flags this runtime honours (same names, same meaning) and DynaPipe's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dynapipe_planner.cluster import GPU_PRESETS
from dynapipe_planner.planner import BATCHING, RECOMPUTE, SCHEDULES

BASELINES = ("megatron-1f1b",)


def add_dynapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DynaPipe's flags, in their own group."""
    g = parser.add_argument_group("dynapipe")
    g.add_argument(
        "--dynamic-micro-batching",
        action="store_true",
        help="plan micro-batches per iteration (same as --batching dynamic)",
    )
    g.add_argument(
        "--batching",
        choices=BATCHING,
        default=None,
        help="micro-batching method (default: dynamic with --dynamic-micro-batching, else "
        "padding to --micro-batch-size)",
    )
    g.add_argument(
        "--tokens-per-global-batch",
        type=int,
        default=None,
        help="global batch size in tokens (default: --global-batch-size x --seq-length)",
    )
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default="adaptive")
    g.add_argument(
        "--baseline",
        choices=BASELINES,
        default=None,
        help="train a baseline instead of DynaPipe's executor: megatron-1f1b packs each global "
        "batch into rows of exactly --seq-length tokens (first-fit-decreasing), "
        "--micro-batch-size rows per micro-batch, run by megatron-core's own schedule "
        "(get_forward_backward_func: 1F1B on PP>1); implies --batching packing",
    )
    g.add_argument(
        "--dynapipe-recompute",
        choices=RECOMPUTE,
        default="auto",
        help="activation recomputation; auto: per iteration, the cheapest mode whose plan fits "
        "in memory (Megatron's --recompute-granularity, chosen by the planner), or each "
        "stage's own mode where a --hetero-plan file names them",
    )
    g.add_argument(
        "--dynapipe-memory-limit",
        type=float,
        default=None,
        help="GiB each GPU may use for the planner (default: the device's memory minus a reserve)",
    )
    g.add_argument(
        "--dynapipe-gpu",
        default="A100-80GB",
        help=f"device the analytic cost model describes: {', '.join(GPU_PRESETS)}",
    )
    g.add_argument(
        "--dynapipe-cost-model",
        default=None,
        help="profiled cost table (JSON from tools/profile_costs.py) instead of the analytic model",
    )
    g.add_argument(
        "--planner-workers",
        type=int,
        default=1,
        help="planner processes planning ahead of training on rank 0 (0: plan inline)",
    )
    h = parser.add_argument_group("heterogeneous jobs")
    h.add_argument(
        "--dynamic-strategies",
        action="store_true",
        help="choose each iteration's parallel strategy (Hydraulis): pipelines of different "
        "TP/PP side by side, optimiser states sharded over all ranks and fixed",
    )
    h.add_argument(
        "--strategy-candidates",
        default=None,
        metavar="FILE",
        help="candidate strategies from `dynapipe-strategy propose --output FILE` (default: "
        "proposed at start-up from the data and the cost model, plus each scheme's "
        "homogeneous strategy)",
    )
    h.add_argument(
        "--strategy-window",
        type=int,
        default=None,
        help="with --dynamic-strategies, price only the proposals for the batch's longest "
        "sequence and this many longer maximum lengths (default: all that hold the batch)",
    )
    h.add_argument(
        "--hetero-plan",
        default=None,
        metavar="FILE",
        help="a static asymmetric layout (JSON: replicas of stages with devices, tp, layers, "
        "and each replica's batch_fraction; see megatron/dynapipe/hetero_plan_file.py)",
    )
    h.add_argument(
        "--max-cached-strategies",
        type=int,
        default=0,
        metavar="N",
        help="with --dynamic-strategies, keep the stage models of the N most recently used "
        "strategies and rebuild others when selected (0: keep every candidate's); the working "
        "weights are pulled every iteration anyway",
    )
    h.add_argument(
        "--overlap-pull-push",
        action="store_true",
        help="hide the disaggregated optimiser's weight pull and gradient push behind "
        "propagation (Hydraulis subgraph scheduling): each stage waits for its weights at its "
        "first forward and sends its gradients as soon as its last backward is done",
    )
    h.add_argument(
        "--device-speed",
        default=None,
        metavar="R0:F0,R1:F1,...",
        help="emulate slower devices: rank R's forward and backward take F times as long "
        "(sleeps on top of the measured compute; a bare list gives every rank's factor)",
    )
    g.add_argument(
        "--dynapipe-timeout",
        type=float,
        default=600.0,
        help="seconds a rank waits for a plan or a peer before failing with an error",
    )
    return parser


def _add_megatron_args(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model (Megatron names)")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    m.add_argument("--seq-length", type=int, required=True, help="longest training sequence")
    m.add_argument("--max-position-embeddings", type=int, default=None)
    m.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
    )
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--bf16", action="store_true")
    m.add_argument("--fp16", action="store_true")
    p = parser.add_argument_group("parallelism and batch (Megatron names)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=None)
    t = parser.add_argument_group("training (Megatron names)")
    t.add_argument("--train-iters", type=int, required=True)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--log-interval", type=int, default=1)
    d = parser.add_argument_group("data and checkpoints (Megatron names)")
    d.add_argument(
        "--data-path",
        default="stdlib",
        help="'stdlib' (built-in corpus: the Python standard library's sources, byte tokens), "
        "'synthetic:<preset>', a .jsonl file, or a Megatron .bin/.idx prefix",
    )
    d.add_argument("--save", default=None, help="checkpoint directory")
    d.add_argument("--save-interval", type=int, default=None)
    d.add_argument("--load", default=None, help="checkpoint directory to resume from")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check `pretrain_gpt.py`'s flags."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train a megatron-core GPT with per-iteration DynaPipe plans.",
    )
    _add_megatron_args(parser)
    add_dynapipe_args(parser)
    args = parser.parse_args(argv)
    if args.baseline:
        if args.device_speed:
            parser.error("--device-speed slows DynaPipe's executor; the baseline runs megatron's")
        if args.dynamic_micro_batching or args.batching not in (None, "packing"):
            parser.error(f"--baseline {args.baseline} trains packing; drop the other batching")
        args.batching = "packing"
    if args.dynamic_strategies or args.hetero_plan:
        if args.dynamic_strategies and args.hetero_plan:
            parser.error("--dynamic-strategies and --hetero-plan exclude each other")
        if args.baseline:
            parser.error("--baseline trains homogeneous layouts only")
        if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
            parser.error(
                "with --dynamic-strategies or --hetero-plan the layouts set TP and PP; drop "
                "--tensor-model-parallel-size and --pipeline-model-parallel-size"
            )
    elif args.strategy_candidates or args.strategy_window is not None:
        parser.error("--strategy-candidates and --strategy-window need --dynamic-strategies")
    elif args.overlap_pull_push:
        parser.error("--overlap-pull-push needs --dynamic-strategies or --hetero-plan")
    if args.max_cached_strategies < 0:
        parser.error(f"--max-cached-strategies must be >= 0, got {args.max_cached_strategies}")
    if args.batching is None:
        args.batching = "dynamic" if args.dynamic_micro_batching else "padding"
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.tokens_per_global_batch is None:
        if args.global_batch_size is None:
            parser.error("give --tokens-per-global-batch or --global-batch-size")
        args.tokens_per_global_batch = args.global_batch_size * args.seq_length
    if args.bf16 and args.fp16:
        parser.error("--bf16 and --fp16 exclude each other")
    if args.save_interval is None:
        args.save_interval = args.train_iters
    return args
