"""How a DynaPipe job starts inside megatron.training (`import megatron.dynapipe.enable`): what
replaces megatron.training's functions that run before its loop. `megatron_hooks` installs
them (groups STARTUP and DYNAPIPE) and says why each is a replacement; the parser's are in
`arguments` (`program_parse_args`), CPU initialisation in `cpu_compat`.

- its global tokenizer (`build_tokenizer`): built as DynaPipe's datasets build theirs, the byte
  tokenizer without `--tokenizer-type`, files checked and nothing downloaded;
- its dataset-helper build (`compile_helpers`), which the megatron-core wheel ships prebuilt
  (without the Makefile `make` needs);
- its `pretrain` (`pretrain`): the flags and `--load` are checked before anything is built,
  the saves an earlier run left incomplete in `--save` are removed (with a line), errors end
  the job as DynaPipe's do (`exits`), and the jobs only DynaPipe's own loop runs
  (`job_config.runs_in_own_loop`) go there. The program's dataset provider, a `pretrain`
  argument, is wrapped rather than megatron.training's dataset build
  (`_remembering_training_data`): the training dataset it returns is kept for DynaPipe to
  plan over (`provided_training_dataset`, `data.program_samples`), and under a token budget
  it is asked for as many samples as the budget's full-length windows;
- its data loader (`build_pretraining_data_loader`): one nobody reads for the provider's
  training dataset when DynaPipe plans; DynaPipe reads the dataset through its plans;
- its data-loader build (`build_train_valid_test_data_loaders`): no validation when the
  provider gives no validation data (megatron.training 0.19 would read a missing iterator);
- its checkpoint load and save (`load_checkpoint`, `save_checkpoint`): a checkpoint Megatron
  cannot load (an LR schedule other than the flags', a failed `--verify-integrity`, missing
  optimizer state, a truncated shard) is named in one line (exit status 2), and a save the
  file system refuses (disk full) ends the job in one line per rank (exit status 1).

What changes inside the loop (the schedule, the training step) is `megatron_loop`'s.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import arguments, checkpointing, cpu_compat, megatron_hooks
from . import parallel_state as ps
from .exits import megatron_args, name_bus_errors_in_workers, run_or_exit
from .job_config import JobConfig, runs_in_own_loop

# The training dataset the program's provider returned on this rank (`provided_training_dataset`).
_PROVIDED: dict[str, Any] = {}


def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's `load_checkpoint` (as its loop calls it) with its failures named
    (`checkpointing.named`); on CPU ranks the dropout stream it restores is kept for the first
    step (`cpu_compat.keep_dropout_stream`)."""
    from megatron.training import get_args

    load = megatron_hooks.original("megatron.training.training.load_checkpoint")
    job = get_args()
    named = checkpointing.named(checkpointing.loaded_directory(job.load)) if job.load else None
    with named or contextlib.nullcontext():
        result = load(*args, **kwargs)
        cpu_compat.keep_dropout_stream(result)
        return result


def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
    """megatron.training's `save_checkpoint` (as its loop calls it), a save the file system
    refuses named (`checkpointing.written`)."""
    from megatron.training import get_args

    save = megatron_hooks.original("megatron.training.training.save_checkpoint")
    with checkpointing.written(get_args().save, iteration):
        return save(iteration, *args, **kwargs)


def build_tokenizer(args: Any) -> Any:
    """megatron.training's global tokenizer, built as DynaPipe's datasets build theirs
    (`data.tokenizer`): the byte tokenizer of the built-in corpus when no `--tokenizer-type` is
    given (Megatron would stop), files checked first and nothing downloaded, a bad flag named
    in one line. Megatron's padded vocabulary is set from it as Megatron sets it. Types
    DynaPipe's datasets do not read are Megatron's to build."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

    from .data.tokenizer import SUPPORTED_TOKENIZER_TYPES
    from .data.tokenizer import build_tokenizer as dynapipe_build
    from .model import padded_vocab_size

    if args.tokenizer_type is not None and args.tokenizer_type not in SUPPORTED_TOKENIZER_TYPES:
        return megatron_build(args)
    tokenizer = run_or_exit(lambda: dynapipe_build(args), args)  # before pretrain is called
    if args.padded_vocab_size is None:
        tp = args.tensor_model_parallel_size
        args.padded_vocab_size = padded_vocab_size(args, tokenizer.vocab_size, tp)
    return getattr(tokenizer, "megatron", tokenizer)


def provided_training_dataset() -> Any:
    """The training dataset the program's provider returned on this rank (None where it built
    none, or before megatron.training asked it)."""
    return _PROVIDED.get("train")


def _remembering_training_data(provider: Callable[..., Any]) -> Callable[..., Any]:
    """The program's dataset provider (`pretrain`'s `train_valid_test_dataset_provider`),
    keeping the training dataset it returns. Under DynaPipe's token budget
    (`--tokens-per-global-batch`) Megatron would ask for `--train-iters` x its default global
    batch of samples; a batch may hold as many samples as the budget has `--seq-length`
    windows, so the provider is asked for that many (megatron-core's datasets build their
    indices for the count they are given)."""

    @functools.wraps(provider)
    def train_valid_test_dataset_provider(num_samples: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        job = get_args()
        if JobConfig.of(job).plans and job.tokens_per_global_batch is not None:
            counts = list(num_samples)
            windows = max(1, job.tokens_per_global_batch // job.seq_length)
            counts[0] = max(counts[0], job.train_iters * windows)
            num_samples = counts
        datasets = provider(num_samples, *args, **kwargs)
        _PROVIDED["train"] = datasets[0]
        return datasets

    return train_valid_test_dataset_provider


class _ReadThroughPlans:
    """The training data loader Megatron's loop holds while DynaPipe plans: never read."""

    def __iter__(self) -> _ReadThroughPlans:
        return self

    def __next__(self) -> Any:
        raise RuntimeError("DynaPipe reads the training dataset through its plans")


def build_pretraining_data_loader(dataset: Any, consumed_samples: int) -> Any:
    """megatron.training's data-loader build, giving the training dataset a loader nobody
    reads while DynaPipe plans: Megatron's sampler would count samples DynaPipe's batches do
    not follow (and refuse a resumed run whose planned samples passed the dataset's length),
    and its worker processes would read ahead samples nobody takes. Megatron's own loaders
    name a data file truncated under their workers (`exits.name_bus_errors_in_workers`)."""
    from megatron.training import get_args

    build_loader = megatron_hooks.original(
        "megatron.training.training.build_pretraining_data_loader"
    )
    planned = dataset is not None and dataset is _PROVIDED.get("train")
    if planned and JobConfig.of(get_args()).plans:
        return _ReadThroughPlans()
    return name_bus_errors_in_workers(build_loader(dataset, consumed_samples))


def build_train_valid_test_data_loaders(*args: Any, **kwargs: Any) -> Any:
    """megatron.training's data-loader build, not validating when the program's dataset
    provider gives no validation data: megatron.training 0.19 wraps the validation loader in a
    list, finds the list not None, and its evaluation then reads a None iterator."""
    from megatron.training import get_args

    build_loaders = megatron_hooks.original(
        "megatron.training.training.build_train_valid_test_data_loaders"
    )
    train, valid, test = build_loaders(*args, **kwargs)
    missing = isinstance(valid, list) and all(loader is None for loader in valid)
    flag = torch.tensor([int(missing)], dtype=torch.int64, device=ps.device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # ranks that built no loaders agree
    if int(flag):
        get_args().do_valid = False
    return train, valid, test


def compile_helpers() -> None:
    """megatron.training's initialisation runs `make` on megatron-core's dataset helpers; the
    wheel ships them built and without a Makefile, so use the built module when it imports."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        megatron_hooks.original("megatron.core.datasets.utils.compile_helpers")()


def pretrain(*args: Any, **kwargs: Any) -> None:
    """megatron.training's `pretrain`, ending as DynaPipe jobs end on errors (`exits`): the
    input's fault in one line on rank 0 and exit status 2, a fault of the running job in one
    line per rank and exit status 1. A job `job_config.runs_in_own_loop` names runs in DynaPipe's
    loop with the program's flags instead (its model and data come from those flags). The
    program's dataset provider is given to Megatron's `pretrain` keeping its training dataset
    (`_remembering_training_data`)."""
    megatron_pretrain = megatron_hooks.original("megatron.training.training.pretrain")
    parsed = megatron_args()  # a 0.19 program parses before it calls pretrain
    if parsed is not None and runs_in_own_loop(parsed):
        from .training import pretrain as dynapipe_pretrain

        run_or_exit(lambda: dynapipe_pretrain(parsed))
        return

    def run() -> None:
        if parsed is not None:
            _before_megatron(parsed)
        call = inspect.signature(megatron_pretrain).bind(*args, **kwargs)
        provider = call.arguments["train_valid_test_dataset_provider"]
        if provider is not None:
            remembering = _remembering_training_data(provider)
            call.arguments["train_valid_test_dataset_provider"] = remembering
        megatron_pretrain(*call.args, **call.kwargs)

    run_or_exit(run)


def _before_megatron(args: Any) -> None:
    """What DynaPipe checks and says before megatron.training builds anything: the training
    flags, its notes on them (rank 0) and the checkpoint `--load` names, so that bad ones stop
    the job before any process group or model exists. The data is the program's provider's,
    read when megatron.training asks for it."""
    arguments.check_training_flags(args)
    if args.rank == 0:
        for note in JobConfig.of(args).notes:
            print(note, file=sys.stdout, flush=True)
        if args.save:
            checkpointing.remove_interrupted_saves(args.save)
    checkpointing.resume_point(args)
