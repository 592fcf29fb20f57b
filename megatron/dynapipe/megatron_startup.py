"""How a DynaPipe job starts inside megatron.training (`import megatron.dynapipe.enable`): the
seams of megatron.training that run before its loop, patched by `install()`.

- its parser (`arguments.hook_megatron_parser`): DynaPipe's flags join the program's, its
  refusals (with DynaPipe's flags), CPU defaults and checks apply, the loss is per token over
  the global batch when DynaPipe plans, and `--eval-interval` has a default (the loop needs
  one);
- its global tokenizer (`_tokenizer_from_flags`): built as DynaPipe's datasets build theirs,
  the byte tokenizer without `--tokenizer-type`, files checked and nothing downloaded;
- on CPU ranks, its initialisation (`cpu_compat.install_training`): gloo, megatron-core's groups
  and seeds as on a GPU; and its dataset-helper build, which the megatron-core wheel ships
  prebuilt (without the Makefile `compile_helpers` runs);
- its data-loader build (`_no_validation_without_data`): no validation when the provider gives
  no validation data (megatron.training 0.19 would read a missing iterator);
- its `pretrain` (`_reporting`): the flags, the data and `--load` are checked before anything
  is built, errors end the job as DynaPipe's do (`exits`), and the jobs only DynaPipe's own
  loop runs (`arguments.runs_in_own_loop`) go there.

What changes inside the loop (the schedule, the training step) is `megatron_loop`'s.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import arguments, cpu_compat
from . import parallel_state as ps
from .checkpointing import resume_point
from .data.datasets import job_datasets
from .exits import megatron_args, run_or_exit


def install() -> None:
    """Patch the start of megatron.training's `pretrain` (idempotent)."""
    import megatron.training
    from megatron.training import global_vars, training

    arguments.hook_megatron_parser()
    global_vars.build_tokenizer = _tokenizer_from_flags
    cpu_compat.install_training()
    _use_prebuilt_dataset_helpers()
    if getattr(training.pretrain, "_dynapipe", False):
        return
    training.build_train_valid_test_data_loaders = _no_validation_without_data(
        training.build_train_valid_test_data_loaders
    )
    megatron.training.pretrain = training.pretrain = _reporting(training.pretrain)


def _tokenizer_from_flags(args: Any) -> Any:
    """megatron.training's global tokenizer, built as DynaPipe's datasets build theirs
    (`data.tokenizer`): the byte tokenizer of the built-in corpus when no `--tokenizer-type` is
    given (Megatron would stop), files checked first and nothing downloaded, a bad flag named
    in one line. Megatron's padded vocabulary is set from it as Megatron sets it. Types
    DynaPipe's datasets do not read are Megatron's to build."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

    from .data.tokenizer import SUPPORTED_TOKENIZER_TYPES, build_tokenizer
    from .model import padded_vocab_size

    if args.tokenizer_type is not None and args.tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        return megatron_build(args)
    tokenizer = run_or_exit(lambda: build_tokenizer(args), args)  # before pretrain is called
    if args.padded_vocab_size is None:
        tp = args.tensor_model_parallel_size
        args.padded_vocab_size = padded_vocab_size(args, tokenizer.vocab_size, tp)
    return getattr(tokenizer, "megatron", tokenizer)


def _no_validation_without_data(build_loaders: Callable[..., Any]) -> Callable[..., Any]:
    """megatron.training's data-loader build, not validating when the program's dataset
    provider gives no validation data: megatron.training 0.19 wraps the validation loader in a
    list, finds the list not None, and its evaluation then reads a None iterator."""

    @functools.wraps(build_loaders)
    def build_train_valid_test_data_loaders(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        train, valid, test = build_loaders(*args, **kwargs)
        missing = isinstance(valid, list) and all(loader is None for loader in valid)
        flag = torch.tensor([int(missing)], dtype=torch.int64, device=ps.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # ranks that built no loaders agree
        if int(flag):
            get_args().do_valid = False
        return train, valid, test

    return build_train_valid_test_data_loaders


def _use_prebuilt_dataset_helpers() -> None:
    """megatron.training's initialisation runs `make` on megatron-core's dataset helpers; the
    wheel ships them built and without a Makefile, so use the built module when it imports."""
    from megatron.core.datasets import utils

    build = utils.compile_helpers
    if getattr(build, "_prebuilt", False):
        return

    def compile_helpers() -> None:
        try:
            import megatron.core.datasets.helpers_cpp  # noqa: F401
        except ImportError:
            build()

    compile_helpers._prebuilt = True  # type: ignore[attr-defined]
    utils.compile_helpers = compile_helpers


def _reporting(megatron_pretrain: Callable[..., Any]) -> Callable[..., Any]:
    """megatron.training's `pretrain`, ending as DynaPipe jobs end on errors (`exits`): the
    input's fault in one line on rank 0 and exit status 2, a fault of the running job in one
    line per rank and exit status 1. A job `arguments.runs_in_own_loop` names runs in DynaPipe's
    loop with the program's flags instead (its model and data come from those flags)."""

    @functools.wraps(megatron_pretrain)
    def pretrain(*args: Any, **kwargs: Any) -> None:
        parsed = megatron_args()  # a 0.19 program parses before it calls pretrain
        if parsed is not None and arguments.runs_in_own_loop(parsed):
            from .training import pretrain as dynapipe_pretrain

            run_or_exit(lambda: dynapipe_pretrain(parsed))
            return

        def run() -> None:
            if parsed is not None:
                _before_megatron(parsed)
            megatron_pretrain(*args, **kwargs)

        run_or_exit(run)

    pretrain._dynapipe = True  # type: ignore[attr-defined]
    return pretrain


def _before_megatron(args: Any) -> None:
    """What DynaPipe checks and says before megatron.training builds anything: the training
    flags, its notes on them (rank 0), the data (when it plans) and the checkpoint `--load`
    names, so that bad ones stop the job before any process group or model exists."""
    arguments.check_training_flags(args)
    if args.rank == 0:
        for note in args.dynapipe_notes:
            print(note, file=sys.stdout, flush=True)
    if args.dynapipe_plans:
        job_datasets(args)
    resume_point(args)
