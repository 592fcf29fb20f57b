"""Command-line flags: Megatron's own parser and validation, plus DynaPipe's groups.

`parse_args` runs `megatron.training.arguments.parse_args` with `add_dynapipe_args` as its
`extra_args_provider`, then Megatron's `validate_args`, so every Megatron flag parses with
Megatron's meaning and defaults. What this runtime adds on top:

- DynaPipe's, Hydraulis', HexiScale's flags (`add_dynapipe_args`, also usable as Megatron's
  `extra_args_provider` in a user's own program);
- the flags it cannot honour stop with one line naming the flag and why (`unsupported`),
  instead of being accepted and ignored;
- on machines without CUDA or TransformerEngine, the GPU-only defaults are switched off
  (fused kernels, the TransformerEngine layer spec), each noted once; a GPU-only flag given
  explicitly stops instead (`cpu_defaults`);
- the batch: `--global-batch-size` keeps Megatron's meaning (samples per iteration), and
  `--tokens-per-global-batch` makes every global batch a token budget instead (DynaPipe's
  global batches, seed `dynapipe.txt` §3);
- what DynaPipe derives from its flags is not written back into the args: validation builds
  the job's `job_config.JobConfig` once, and the only writes into Megatron's args are the
  values Megatron's own code reads (`megatron_settings`, and the batch and iteration counts
  `_check_batch` completes).

Errors (Megatron's own checks included) end the program with exit status 2 and one line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import torch

from dynapipe_planner.cli_args import DEBUG_HELP, MAX_GIB, MAX_SEQUENCE, add_renamed
from dynapipe_planner.cluster import DEFAULT_GPU, GPU_PRESETS
from dynapipe_planner.planner import BATCHING, RECOMPUTE, SCHEDULES

from .job_config import PLANNING_FLAGS, JobConfig, PerArgs, plans, runs_in_own_loop

BASELINES = ("megatron-1f1b", "packing-1f1b")


class ArgumentError(SystemExit):
    """A flag the runtime refuses: printed as one line, exit status 2."""

    def __init__(self, message: str) -> None:
        if _first_rank():  # every rank parses; one prints
            program = os.path.basename(sys.argv[0]) or "megatron.dynapipe"
            print(f"{program}: error: {message}", file=sys.stderr, flush=True)
        super().__init__(2)


def _first_rank() -> bool:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


# DynaPipe's spellings before #35, refused with their replacement.
RENAMED = {"--dynapipe-memory-limit": "--dynapipe-memory-limit-gib"}


def add_dynapipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DynaPipe's flags, in their own groups (Megatron's `extra_args_provider` signature)."""
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
        help="make every global batch a budget of this many tokens (as many samples as fit) "
        "instead of --global-batch-size samples",
    )
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default="adaptive")
    g.add_argument(
        "--baseline",
        choices=BASELINES,
        default=None,
        help="train a baseline instead of DynaPipe's executor, through megatron-core's own "
        "schedule (get_forward_backward_func: 1F1B on PP>1) with --micro-batch-size rows of "
        "--seq-length tokens per micro-batch: megatron-1f1b trains Megatron's fixed-length "
        "samples (megatron-core's GPTDataset over the same documents); packing-1f1b packs each "
        "global batch's samples into rows first-fit-decreasing (implies --batching packing)",
    )
    g.add_argument(
        "--dynapipe-recompute",
        choices=RECOMPUTE,
        default=None,
        help="activation recomputation; auto (default): per iteration, the cheapest mode whose "
        "plan fits in memory, or each stage's own mode where a --hetero-plan file names them; "
        "Megatron's --recompute-granularity fixes one mode instead",
    )
    g.add_argument(
        "--dynapipe-memory-limit-gib",
        type=float,
        default=None,
        help="GiB each GPU may use for the planner (default: the device's memory minus a reserve)",
    )
    g.add_argument(
        "--dynapipe-packed-rows",
        choices=("dp", "on", "off"),
        default="dp",
        help="let DynaPipe's plans pack several samples into a row where the cost model prices "
        "that faster (every micro-batch runs as THD sequences with cu_seqlens, each sample "
        "attending within itself): 'dp' (default) also in the micro-batching DP's search (a "
        "second DP per recomputation mode, the faster plan kept), 'on' only per micro-batch "
        "of the DP and as the packing baseline's rows",
    )
    g.add_argument(
        "--dynapipe-gpu",
        default=DEFAULT_GPU,
        help=f"device the analytic cost model describes: {', '.join(GPU_PRESETS)}",
    )
    g.add_argument(
        "--dynapipe-cost-model",
        default=os.environ.get("DYNAPIPE_COST_MODEL", "local"),
        help="what the planner prices plans with: 'local' (default; this machine's device, "
        "profiled on first use and kept under $DYNAPIPE_CACHE_DIR, TP 1 jobs), 'analytic' (the "
        "model of --dynapipe-gpu, for planning other clusters), or a cost table (JSON from "
        "tools/profile_costs.py); $DYNAPIPE_COST_MODEL sets the default",
    )
    g.add_argument(
        "--planner-workers",
        type=int,
        default=1,
        help="planner processes planning ahead of training on rank 0 (0: plan inline)",
    )
    g.add_argument(
        "--dynapipe-timeout",
        type=float,
        default=600.0,
        help="seconds a rank waits for a plan, a peer or a collective before failing with an "
        "error; with --distributed-timeout-minutes the smaller wins, and when DynaPipe plans "
        "Megatron's process groups take it too (default: 600, Megatron's 10 minutes)",
    )
    g.add_argument(
        "--log-peak-memory",
        action="store_true",
        help="trace the tensor memory of the last training iteration and log every rank's "
        "peak on its line (that iteration runs slower; megatron/dynapipe/memory.py says what "
        "is counted)",
    )
    g.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    add_renamed(g, RENAMED)
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
        "and each replica's batch_fraction; see dynapipe_planner/hetero/plan_file.py)",
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
    s = parser.add_argument_group("searched plans")
    s.add_argument(
        "--parallel-plan",
        default=None,
        metavar="FILE",
        help="train the plan `dynapipe-search --output FILE` wrote: its TP and PP degrees, "
        "layers per stage, global batch, micro-batch count and recomputed layers",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check `pretrain_gpt.py`'s flags (the command line when `argv` is None); the
    job's `JobConfig` is built with them (`JobConfig.of(args)`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_megatron_args(argv, add_dynapipe_args)
    _check_dynapipe(args, given_flags(argv, add_dynapipe_args))
    return args


ExtraArgs = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def parse_megatron_args(
    argv: Sequence[str],
    extra_args_provider: ExtraArgs,
    before_validation: Callable[[argparse.Namespace], None] | None = None,
) -> argparse.Namespace:
    """Megatron's flags plus `extra_args_provider`'s, parsed and validated by Megatron's own
    `parse_args` and `validate_args`, with this runtime's refusals and CPU defaults applied;
    `before_validation(args)` checks what a tool needs before Megatron's checks run."""
    from megatron.training import arguments as megatron_arguments

    with _command_line(argv):
        args = megatron_arguments.parse_args(
            extra_args_provider=lambda parser: _our_parser(extra_args_provider(parser))
        )
    _before_validation(args, given_flags(argv, extra_args_provider), extra_args_provider)
    if before_validation is not None:
        before_validation(args)
    _validate(megatron_arguments.validate_args, args, {})
    return args


# The notes `cpu_defaults` made for each args object, until `_check_dynapipe` puts them first
# in its `JobConfig` (a Megatron-LM program parses and validates in two calls of Megatron's).
_CPU_NOTES: PerArgs[tuple[str, ...]] = PerArgs()


def _before_validation(
    args: argparse.Namespace, given: dict[str, str], extra_args_provider: ExtraArgs
) -> None:
    if torch.distributed.is_initialized():  # forked test ranks have no RANK/WORLD_SIZE
        # Megatron's parser took them from RANK/WORLD_SIZE; its validation and groups read them.
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()
    unsupported(args, given, extra_args_provider)
    check_numbers(args, given, extra_args_provider)
    _CPU_NOTES.set(args, tuple(cpu_defaults(args, given)))
    gpt2_tokenizer_default(args)


def _validate(validate_args: Callable, args: argparse.Namespace, defaults: dict) -> None:
    """Megatron's `validate_args`, its failed checks one line each. Defaults for flags Megatron
    requires: micro-batches of one sample (the planner sizes its own), position embeddings for
    the longest sequence, a checkpoint at the end of training."""
    ours = {"micro_batch_size": 1}
    if args.seq_length is not None:
        ours["max_position_embeddings"] = args.seq_length
    if args.train_iters is not None:
        ours["save_interval"] = args.train_iters
    try:
        with _megatron_checks_on_cpu():
            validate_args(args, {**ours, **defaults})
    except (AssertionError, ValueError) as error:
        raise ArgumentError(_megatron_complaint(error)) from None


# The flags the program's command line gave (`program_parse_args`), for `program_validate_args`.
_GIVEN: dict[str, str] = {}


def program_parse_args(
    extra_args_provider: ExtraArgs | None = None, ignore_unknown_args: bool = False
) -> argparse.Namespace:
    """megatron.training's own `parse_args` (what a Megatron-LM program's
    `parse_and_validate_args` calls), as `megatron_hooks` installs it (group PARSER):
    DynaPipe's flags join the program's `extra_args_provider`, and the runtime's refusals and
    CPU defaults apply. When DynaPipe plans (`plans`), the loss is per token over the global
    batch (`--calculate-per-token-loss`): micro-batches of any size weigh each token equally;
    otherwise the program's flags say, as without DynaPipe."""
    from . import megatron_hooks

    megatron_parse = megatron_hooks.original("megatron.training.arguments.parse_args")

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return _our_parser(add_dynapipe_args(parser))

    args = megatron_parse(provider, ignore_unknown_args)
    _GIVEN.clear()
    _GIVEN.update(given_flags(sys.argv[1:], provider))
    _before_validation(args, _GIVEN, provider)
    if plans(args):  # micro-batches of any size weigh each token equally
        args.calculate_per_token_loss = True
    return args


def program_validate_args(args: argparse.Namespace, defaults: dict | None = None) -> None:
    """megatron.training's own `validate_args`, as `megatron_hooks` installs it (group
    PARSER): Megatron's checks, each failure in one line, then DynaPipe's."""
    from . import megatron_hooks

    megatron_validate = megatron_hooks.original("megatron.training.arguments.validate_args")
    # megatron.training's loop needs an evaluation interval; 1000 was Megatron-LM's default.
    _validate(megatron_validate, args, {"eval_interval": 1000, **(defaults or {})})
    _check_dynapipe(args, _GIVEN)


def _our_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's full parser as this runtime presents it: errors in one line, `--help`
    printable."""
    return _printable_help(_one_line_errors(parser))


def _printable_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse fills each help string in with `%`; megatron-core 0.19.2 builds the help of
    `--moe-paged-stash-buffer-size-factor-cuda` from a docstring with a bare `%` ("10%)"), so
    every program's `--help` died with a traceback. Each `%` that starts no `%(name)s` field
    and is not already doubled is doubled."""
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = re.sub(r"%%|%(?!\()", "%%", action.help)
    return parser


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse prints Megatron's whole usage (hundreds of flags) before an error, on every
    rank; say only the error, once."""

    def error(message: str) -> NoReturn:
        raise ArgumentError(message)

    parser.error = error
    return parser


def _megatron_complaint(error: Exception) -> str:
    """The message of a failed Megatron check; a bare `assert` is quoted from its source."""
    if str(error):
        return str(error)
    check = traceback.extract_tb(error.__traceback__)[-1].line or "?"
    flags = re.sub(r"args\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), check)
    return f"Megatron's argument check failed: {flags}"


def given_flags(argv: Sequence[str], extra_args_provider: ExtraArgs) -> dict[str, str]:
    """The flags `argv` names, by destination (what the user set on purpose, as opposed to
    defaults), each with the option string the user typed."""
    options = _parser(extra_args_provider)[0]
    given = {}
    for token in argv:
        name = token.split("=", 1)[0]
        if name in options:
            given[options[name]] = name
    return given


@functools.cache
def _parser(
    extra_args_provider: ExtraArgs,
) -> tuple[dict[str, str], dict[str, object], dict[str, type]]:
    """Of the full parser: option string -> destination, destination -> default, and the
    destinations argparse parses as numbers -> int or float."""
    from megatron.training.arguments import add_megatron_arguments

    parser = extra_args_provider(
        add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    )
    options = {
        option: action.dest for action in parser._actions for option in action.option_strings
    }
    numbers = {a.dest: a.type for a in parser._actions if a.type in (int, float)}
    return options, {action.dest: action.default for action in parser._actions}, numbers


@contextlib.contextmanager
def _command_line(argv: list[str]) -> Iterator[None]:
    """Megatron's `parse_args` reads `sys.argv`; let it read `argv`."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "", *argv]
    try:
        yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _megatron_checks_on_cpu() -> Iterator[None]:
    """`validate_args` asks the GPU's architecture whenever TP > 1, to decide whether
    CUDA_DEVICE_MAX_CONNECTIONS must be 1 (streams of pre-Blackwell GPUs). A CPU has no such
    streams: it answers as a pre-Blackwell device, and the variable is set as Megatron asks
    (it has no effect without CUDA)."""
    from .megatron_hooks import swapped

    if torch.cuda.is_available():
        yield
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with swapped("megatron.training.arguments", "get_device_arch_version", lambda: 0):
        yield


# Megatron features DynaPipe's planned iterations do not run, by destination: why. A flag is
# refused when given with a value other than Megatron's default (--context-parallel-size 1 is
# fine) and with a flag that makes DynaPipe plan (`unsupported`).
_UNSUPPORTED: dict[str, str] = {
    "context_parallel_size": "context parallelism is not supported: DynaPipe's executor runs "
    "whole sequences on each tensor-parallel group",
    "num_layers_per_virtual_pipeline_stage": "interleaved (virtual) pipeline stages are not "
    "supported by DynaPipe's schedules",
    "num_virtual_stages_per_pipeline_rank": "interleaved (virtual) pipeline stages are not "
    "supported by DynaPipe's schedules",
    "num_experts": "mixture-of-experts models are not supported by the planner's cost models",
    "rampup_batch_size": "batch-size ramp-up is not supported yet: every iteration plans one "
    "global batch size",
    "step_batch_size_schedule": "batch-size schedules are not supported yet: every iteration "
    "plans one global batch size (use --global-batch-size)",
    "use_checkpoint_args": "taking the model flags from a checkpoint is not supported yet; give "
    "the model flags",
    "yaml_cfg": "YAML configs are not supported; give flags",
    "fp8": "fp8 needs TransformerEngine on Hopper or newer GPUs",
    "fp8_param_gather": "fp8 needs TransformerEngine on Hopper or newer GPUs",
    "fp4": "fp4 needs TransformerEngine on Blackwell GPUs",
    "overlap_param_gather": "overlapped parameter gathers are not supported yet",
    "use_megatron_fsdp": "Megatron FSDP is not supported by DynaPipe's executor",
    "use_torch_fsdp2": "torch FSDP2 is not supported by DynaPipe's executor",
    "dataloader_type": "DynaPipe reads the training dataset in its own order, as Megatron's "
    "'single' loader does (docs/datasets.md)",
}
# Megatron features its loop keeps under DynaPipe's schedule, which DynaPipe's own loop (the
# jobs `runs_in_own_loop`) and its tools do not offer.
_NOT_IN_OWN_LOOP = {
    "tensorboard_dir": "DynaPipe's own loop writes no TensorBoard events; the iteration lines "
    "carry the metrics",
    "profile": "DynaPipe's own loop does not profile; tools/profile_costs.py makes cost tables",
    "sequence_parallel": "DynaPipe's own loop (strategy switching, asymmetric pipelines) sends "
    "whole activations between stages; sequence parallelism runs in Megatron's loop",
}
# Values of `_UNSUPPORTED` flags that DynaPipe does honour besides the default.
_HONOURED = {"dataloader_type": ("single",)}


def unsupported(
    args: argparse.Namespace, given: dict[str, str], extra_args_provider: ExtraArgs
) -> None:
    """Stop on the first flag given on purpose that DynaPipe cannot honour where DynaPipe runs
    the job: in its tools (whose parsers lack DynaPipe's training flags), and in a program given
    a flag that makes it plan (named in the line). Without one Megatron trains as it would
    without DynaPipe, and takes its flags as it would."""
    where, refused = "", {**_UNSUPPORTED, **_NOT_IN_OWN_LOOP}
    if hasattr(args, "dynamic_micro_batching"):  # a training program, not a tool
        planning = [given[dest] for dest in PLANNING_FLAGS if dest in given]
        if not planning or not plans(args):
            return
        where = f" with {planning[0]}"
        if not runs_in_own_loop(args):
            refused = _UNSUPPORTED
    defaults = _parser(extra_args_provider)[1]
    for dest, why in refused.items():
        if dest in given and getattr(args, dest) not in (defaults[dest], *_HONOURED.get(dest, ())):
            raise ArgumentError(f"{given[dest]}{where}: {why}")


# What the numbers a run is made of must be, by destination, besides an int fitting int64 and a
# float being finite (every numeric flag). argparse checks only the type, and Megatron's checks
# miss most of these: a 0 divides by zero in its validation, a dropout of 1.5 or an Adam beta
# of -1 fails in torch's constructors, a negative interval or a NaN clip is silently taken.
_POSITIVE = (lambda v: v > 0, "positive")
_NONNEGATIVE = (lambda v: v >= 0, "non-negative")
_NUMBERS: dict[str, tuple[Callable[[float], bool], str]] = {
    **dict.fromkeys(
        (
            "tokens_per_global_batch", "num_layers", "hidden_size", "num_attention_heads",
            "ffn_hidden_size",
            "kv_channels", "num_query_groups", "max_position_embeddings",
            "make_vocab_size_divisible_by", "padded_vocab_size", "rotary_base",
            "layernorm_epsilon", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "micro_batch_size", "global_batch_size", "train_iters", "train_samples", "adam_eps",
            "lr_decay_iters", "lr_decay_samples", "loss_scale", "initial_loss_scale",
            "min_loss_scale", "loss_scale_window", "log_interval", "eval_interval",
            "save_interval", "exit_interval", "exit_duration_in_mins",
        ),
        _POSITIVE,
    ),
    **dict.fromkeys(
        (
            "strategy_window", "max_cached_strategies", "lr", "min_lr", "weight_decay",
            "start_weight_decay", "end_weight_decay", "clip_grad", "init_method_std",
            "eval_iters", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init",
            "manual_gc_interval",
        ),
        _NONNEGATIVE,
    ),
    **dict.fromkeys(
        ("hidden_dropout", "attention_dropout", "lr_warmup_fraction"),
        (lambda v: 0 <= v <= 1, "between 0 and 1"),
    ),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (lambda v: 0 <= v < 1, "in [0, 1)")),
    # numpy seeds below 2**32, and Megatron adds 100 x the pipeline rank
    "seed": (lambda v: 0 < v < 2**31, "positive and below 2**31"),
    # timedelta holds at most 10**9 days; a timeout of decades is a typo anyway
    "dynapipe_timeout": (lambda v: 0 < v <= 10**9, "positive and at most 10**9 seconds"),
    "distributed_timeout_minutes": (
        lambda v: 0 < v <= 10**7,
        "positive and at most 10**7 minutes",
    ),
    "planner_workers": (lambda v: 0 <= v <= 1024, "between 0 and 1024 processes"),
    "dynapipe_memory_limit_gib": (
        lambda v: 0 < v <= MAX_GIB,
        f"positive and at most {MAX_GIB} GiB",
    ),
    "seq_length": (lambda v: 0 < v <= MAX_SEQUENCE, f"positive and at most {MAX_SEQUENCE}"),
}  # fmt: skip


def check_numbers(
    args: argparse.Namespace, given: dict[str, str], extra_args_provider: ExtraArgs
) -> None:
    """Stop on the first number given that the run cannot be made of (`_NUMBERS`), naming the
    flag as typed: before Megatron's own checks, which divide by some of them."""
    numbers = _parser(extra_args_provider)[2]
    for dest, option in given.items():
        value = getattr(args, dest, None)
        if dest not in numbers or value is None:
            continue
        rule = _NUMBERS.get(dest)
        for v in value if isinstance(value, list) else [value]:
            if numbers[dest] is int and not -(2**63) <= v < 2**63:
                raise ArgumentError(f"{option} must fit in int64, got {v}")
            if numbers[dest] is float and not math.isfinite(v):
                what = "finite" if rule is None else f"finite and {rule[1]}"
                raise ArgumentError(f"{option} must be {what}, got {v}")
            if rule is not None and not rule[0](v):
                raise ArgumentError(f"{option} must be {rule[1]}, got {v}")


# Fused kernels Megatron uses by default. These come from TransformerEngine (or apex) builds:
# without one, megatron-core would fail on the first bf16 softmax, rotary embedding or weight
# gradient, or (persist_layer_norm) when the local spec builds torch's LayerNorm.
_KERNEL_FUSIONS = ("masked_softmax_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")
# These are torch.jit/triton fusions: any CUDA device runs them, a CPU does not.
_CUDA_FUSIONS = (
    "bias_gelu_fusion",
    "bias_swiglu_fusion",
    "bias_dropout_fusion",
    "gradient_reduce_div_fusion",
)


# What only TransformerEngine's layer spec provides, by destination: (refused when, why).
_NEEDS_TRANSFORMER_ENGINE: dict[str, tuple[Callable[[object], bool], str]] = {
    "transformer_impl": (
        lambda v: v == "transformer_engine",
        "the TransformerEngine layer spec was asked for",
    ),
    "attention_backend": (
        lambda v: v.name not in ("auto", "local"),
        "this attention backend is TransformerEngine's (use local or auto)",
    ),
    "layernorm_zero_centered_gamma": (
        lambda v: v,
        "zero-centred layer-norm weights need TransformerEngine's (or apex's) norms",
    ),
    "fp8": (lambda v: v is not None, "fp8 needs TransformerEngine on Hopper or newer GPUs"),
    "fp4": (lambda v: v is not None, "fp4 needs TransformerEngine on Blackwell GPUs"),
}


def transformer_engine_installed() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_defaults(args: argparse.Namespace, given: dict[str, str]) -> list[str]:
    """Megatron's GPU-only defaults switched off where they cannot run; returns the notes that
    say so (once each, at start-up).

    Without TransformerEngine the model is built from megatron-core's local layer spec; a user
    who asked for TransformerEngine or one of its attention backends explicitly is stopped.
    Without CUDA the fused kernels (all default on) are switched off and weights are
    initialised on the CPU. These are Megatron's own flags, written for Megatron's model
    builder to read.
    """
    notes = []
    if not transformer_engine_installed():
        for dest, (refused, why) in _NEEDS_TRANSFORMER_ENGINE.items():
            if dest in given and refused(getattr(args, dest)):
                raise ArgumentError(
                    f"{given[dest]}: {why}, and TransformerEngine is not installed "
                    "(pip install megatron-dynapipe[gpu] on a GPU machine)"
                )
        if args.transformer_impl != "local":
            args.transformer_impl = "local"
            notes.append("TransformerEngine is not installed: megatron-core's local layer spec")
        args.no_persist_layer_norm = True
        notes += _switch_off(args, _KERNEL_FUSIONS, "no TransformerEngine")
    if not torch.cuda.is_available():
        notes += _switch_off(args, _CUDA_FUSIONS, "no CUDA")
        args.use_cpu_initialization = True
    return notes


def gpt2_tokenizer_default(args: argparse.Namespace) -> None:
    """Upstream's `pretrain_gpt.py` defaults `--tokenizer-type` to GPT2BPETokenizer, and its
    GPT-3 script gives only `--vocab-file` and `--merge-file`: with both of them and no type,
    that default. Without any tokenizer flag the built-in byte tokenizer stays the default."""
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"


def _switch_off(args: argparse.Namespace, fusions: tuple[str, ...], why: str) -> list[str]:
    """Turn the named fusions off; the note to print, if any was on."""
    on = [name for name in fusions if getattr(args, name)]
    for name in on:
        setattr(args, name, False)
    return [f"{why}: fused kernels off ({', '.join(on)})"] if on else []


def check_training_flags(args: argparse.Namespace) -> None:
    """What training needs beyond what parsing checks (tools that only build a model parse the
    same flags): a learning rate, which Megatron has no default for either; without one its
    optimiser fails deep inside."""
    if args.lr is None:
        raise ArgumentError("--lr: give the learning rate (it has no default)")


def _check_dynapipe(args: argparse.Namespace, given: dict[str, str]) -> JobConfig:
    """DynaPipe's own flags against each other and against Megatron's; then the job's
    `JobConfig`, built once, and the Megatron settings it implies (`megatron_settings`)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and per_node > torch.cuda.device_count():
        raise ArgumentError(
            f"{per_node} processes on this node but {torch.cuda.device_count()} CUDA devices: "
            "NCCL needs one GPU per process (lower --nproc-per-node)"
        )
    _check_parallel_plan(args, given)
    if args.baseline:
        if args.device_speed:
            raise ArgumentError(
                "--device-speed slows DynaPipe's executor; the baseline runs megatron's"
            )
        if args.dynamic_micro_batching or args.batching not in (None, "packing"):
            raise ArgumentError(
                f"--baseline {args.baseline} batches as Megatron does; drop the other batching"
            )
    if args.dynamic_strategies or args.hetero_plan:
        if args.dynamic_strategies and args.hetero_plan:
            raise ArgumentError("--dynamic-strategies and --hetero-plan exclude each other")
        if args.baseline:
            raise ArgumentError("--baseline trains homogeneous layouts only")
        if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
            raise ArgumentError(
                "with --dynamic-strategies or --hetero-plan the layouts set TP and PP; drop "
                "--tensor-model-parallel-size and --pipeline-model-parallel-size"
            )
        if args.use_distributed_optimizer:
            raise ArgumentError(
                "--use-distributed-optimizer: --dynamic-strategies and --hetero-plan always "
                "shard the optimiser states over all ranks (their own disaggregated optimiser)"
            )
        if args.log_peak_memory:
            raise ArgumentError(
                "--log-peak-memory: the heterogeneous loop (--dynamic-strategies, --hetero-plan) "
                "does not trace memory"
            )
    elif args.strategy_candidates or args.strategy_window is not None:
        raise ArgumentError("--strategy-candidates and --strategy-window need --dynamic-strategies")
    elif args.overlap_pull_push:
        raise ArgumentError("--overlap-pull-push needs --dynamic-strategies or --hetero-plan")
    _check_checkpoint_dirs(args)
    if args.seq_length is None:
        raise ArgumentError("--seq-length is required (the longest training sequence)")
    if args.baseline == "megatron-1f1b":
        _megatron_global_batch(args)
    _check_batch(args, given)
    _check_recompute(args)
    job = JobConfig.from_args(args, given, _CPU_NOTES.pop(args, ()))
    megatron_settings(args, job)
    return job


def megatron_settings(args: argparse.Namespace, job: JobConfig) -> None:
    """Megatron's own flags, set as the job DynaPipe decided needs Megatron's code to read
    them: when DynaPipe plans, per-sample attention and the job's one timeout; and the model
    built without recomputation. What DynaPipe decides for itself stays in `job`."""
    if job.plans:
        # DynaPipe's micro-batches are THD sequences whose samples attend only within
        # themselves (`data.microbatches`): Megatron's --dataloader-inter-document-masking
        # form, which a Megatron-LM program's `get_batch` turns into `PackedSeqParams`; and,
        # as Megatron's own check does for that flag, no attention mask in the data loader
        # (there is none to broadcast). `JobConfig.notes` says so once.
        args.create_attention_mask_in_dataloader = False
        args.dataloader_inter_document_masking = True
        # Megatron's process groups take the job's one timeout, so a collective with a frozen
        # rank fails within it and DynaPipe's heartbeats name the rank; without a DynaPipe flag
        # Megatron's groups keep Megatron's timeout.
        if job.timeout_s != 60.0 * args.distributed_timeout_minutes:
            args.distributed_timeout_minutes = job.timeout_s / 60  # a timedelta's minutes
    if job.plans or args.dynapipe_recompute is not None:
        # Megatron builds the model without recomputation; the executor switches each plan's
        # mode (`job.recompute`) on.
        args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None


# What a --parallel-plan file decides, by destination: flags that would set it too are refused.
_SET_BY_PARALLEL_PLAN = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "micro_batch_size",
    "global_batch_size",
    "tokens_per_global_batch",
    "train_samples",
    "dynamic_micro_batching",
    "batching",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "dynapipe_recompute",
    "dynamic_strategies",
    "hetero_plan",
    "baseline",
)


def _check_parallel_plan(args: argparse.Namespace, given: dict[str, str]) -> None:
    """--parallel-plan decides the layout, the batch and the recomputation itself."""
    if args.parallel_plan is None:
        return
    for dest in _SET_BY_PARALLEL_PLAN:
        if dest in given:
            raise ArgumentError(
                f"{given[dest]}: --parallel-plan {args.parallel_plan} sets the parallel layout, "
                "the batch and the recomputed layers; drop the flag"
            )


def _check_checkpoint_dirs(args: argparse.Namespace) -> None:
    """`--load` and `--save` name directories. A file given as --load would start training
    from scratch (Megatron finds no tracker in it), and a --save that cannot be made would fail
    at the first save, after the training it was meant to keep: both stop here instead."""
    if args.load and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ArgumentError(f"--load {args.load} is not a directory")
    if not args.save:
        return
    existing = os.path.abspath(args.save)
    while not os.path.exists(existing):  # Megatron creates the missing directories
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ArgumentError(f"--save {args.save}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ArgumentError(f"--save {args.save}: directory {existing} is not writable")


def _megatron_global_batch(args: argparse.Namespace) -> None:
    """--baseline megatron-1f1b trains --global-batch-size fixed-length samples; a token budget
    becomes that many whole samples. Either way it splits into micro-batches evenly."""
    if args.tokens_per_global_batch is not None:  # Megatron's loop trains this many samples
        args.global_batch_size = args.tokens_per_global_batch // args.seq_length
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size < per_step or args.global_batch_size % per_step:
        raise ArgumentError(
            f"--baseline megatron-1f1b: a global batch of {args.global_batch_size} samples of "
            f"{args.seq_length} tokens does not split into micro-batches of "
            f"{args.micro_batch_size} x {args.data_parallel_size} data-parallel ranks"
        )


def _check_batch(args: argparse.Namespace, given: dict[str, str]) -> None:
    """Samples per iteration (Megatron's --global-batch-size) or a token budget (DynaPipe's
    --tokens-per-global-batch), and iterations (--train-iters, or --train-samples with a
    sample count per batch)."""
    if args.tokens_per_global_batch is not None:
        if args.tokens_per_global_batch < args.seq_length:
            raise ArgumentError(
                f"--tokens-per-global-batch {args.tokens_per_global_batch} is below one sequence "
                f"(--seq-length {args.seq_length}): a global batch must hold the longest sample"
            )
        if "global_batch_size" in given:
            raise ArgumentError(
                "--global-batch-size (samples) and --tokens-per-global-batch (tokens) both set "
                "the global batch; give one"
            )
        for dest in ("train_samples", "lr_decay_samples", "lr_warmup_samples"):
            if dest in given:
                raise ArgumentError(
                    f"--{dest.replace('_', '-')} counts samples, but with "
                    "--tokens-per-global-batch an iteration's sample count varies; use "
                    "--train-iters and the --lr-*-iters flags"
                )
    if args.train_iters is None:
        if args.train_samples is None:
            raise ArgumentError("give --train-iters or --train-samples")
        # Megatron's loop and LR schedule count iterations, not samples
        args.train_iters = args.train_samples // args.global_batch_size


def _check_recompute(args: argparse.Namespace) -> None:
    """One recomputation mode (`JobConfig.recompute`): Megatron's --recompute-granularity fixes
    it (full recomputation of every layer, or selective), --dynapipe-recompute also offers auto
    (the default); the two must agree. Where DynaPipe does not plan (Megatron's loop without a
    batching flag), Megatron recomputes as its flags say."""
    megatron_mode = args.recompute_granularity
    if not plans(args) and args.dynapipe_recompute is None:
        return
    if megatron_mode is not None:
        if args.dynapipe_recompute not in (None, megatron_mode):
            raise ArgumentError(
                f"--recompute-granularity {megatron_mode} and --dynapipe-recompute "
                f"{args.dynapipe_recompute} disagree; give one"
            )
        if megatron_mode == "full" and not (
            args.recompute_method == "uniform" and args.recompute_num_layers == 1
        ):
            raise ArgumentError(
                "--recompute-granularity full: DynaPipe recomputes every layer (--recompute-method "
                "uniform --recompute-num-layers 1); other methods are not supported"
            )
