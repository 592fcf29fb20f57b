"""How a DynaPipe job starts inside megatron.training (`import megatron.dynapipe.enable`): the
seams of megatron.training that run before its loop, patched by `install()`.

- torch's checkpoint reader, which loads `.metadata` without running code from it
  (`checkpoint_metadata`);
- its parser (`arguments.hook_megatron_parser`): DynaPipe's flags join the program's, its
  refusals (with DynaPipe's flags), CPU defaults and checks apply, the loss is per token over
  the global batch when DynaPipe plans, and `--eval-interval` has a default (the loop needs
  one);
- its global tokenizer (`_tokenizer_from_flags`): built as DynaPipe's datasets build theirs,
  the byte tokenizer without `--tokenizer-type`, files checked and nothing downloaded;
- on CPU ranks, its initialisation (`cpu_compat.install_training`): gloo, megatron-core's groups
  and seeds as on a GPU; and its dataset-helper build, which the megatron-core wheel ships
  prebuilt (without the Makefile `compile_helpers` runs);
- its dataset build (`_remembering_training_data`): the training dataset the program's provider
  returns is kept for DynaPipe to plan over (`provided_training_dataset`,
  `data.program_samples`), and under a token budget the provider is asked for as many samples
  as the budget's full-length windows; its data loader is one nobody reads
  (`_unread_when_planned`): DynaPipe reads the dataset through its plans;
- its data-loader build (`_no_validation_without_data`): no validation when the provider gives
  no validation data (megatron.training 0.19 would read a missing iterator);
- its `pretrain` (`_reporting`): the flags and `--load` are checked before anything is built,
  the saves an earlier run left incomplete in `--save` are removed (with a line), errors end
  the job as DynaPipe's do (`exits`), and the jobs only DynaPipe's own loop runs
  (`arguments.runs_in_own_loop`) go there;
- its checkpoint load and save (`_named_checkpoints`): a checkpoint Megatron cannot load (an
  LR schedule other than the flags', a failed `--verify-integrity`, missing optimizer state, a
  truncated shard) is named in one line (exit status 2), and a save the file system refuses
  (disk full) ends the job in one line per rank (exit status 1).

What changes inside the loop (the schedule, the training step) is `megatron_loop`'s.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import arguments, checkpoint_metadata, checkpointing, cpu_compat
from . import parallel_state as ps
from .exits import megatron_args, name_bus_errors_in_workers, run_or_exit

# The training dataset the program's provider returned on this rank (`provided_training_dataset`).
_PROVIDED: dict[str, Any] = {}


def install() -> None:
    """Patch the start of megatron.training's `pretrain` (idempotent)."""
    import megatron.training
    from megatron.training import global_vars, training

    arguments.hook_megatron_parser()
    checkpoint_metadata.install()
    checkpointing.lean_writer_manager()
    global_vars.build_tokenizer = _tokenizer_from_flags
    cpu_compat.install_training()
    _use_prebuilt_dataset_helpers()
    if getattr(training.pretrain, "_dynapipe", False):
        return
    training.build_train_valid_test_datasets = _remembering_training_data(
        training.build_train_valid_test_datasets
    )
    training.build_pretraining_data_loader = _unread_when_planned(
        training.build_pretraining_data_loader
    )
    training.build_train_valid_test_data_loaders = _no_validation_without_data(
        training.build_train_valid_test_data_loaders
    )
    megatron.training.pretrain = training.pretrain = _reporting(training.pretrain)
    _named_checkpoints(training)


def _named_checkpoints(training: Any) -> None:
    """megatron.training's `load_checkpoint` and `save_checkpoint` (as its loop calls them)
    with their failures named (`checkpointing.named`, `checkpointing.written`)."""
    load, save = training.load_checkpoint, training.save_checkpoint

    @functools.wraps(load)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        job = get_args()
        if not job.load:
            return load(*args, **kwargs)
        with checkpointing.named(checkpointing.loaded_directory(job.load)):
            return load(*args, **kwargs)

    @functools.wraps(save)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        with checkpointing.written(get_args().save, iteration):
            return save(iteration, *args, **kwargs)

    training.load_checkpoint, training.save_checkpoint = load_checkpoint, save_checkpoint


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


def provided_training_dataset() -> Any:
    """The training dataset the program's provider returned on this rank (None where it built
    none, or before megatron.training asked it)."""
    return _PROVIDED.get("train")


def _remembering_training_data(build_datasets: Callable[..., Any]) -> Callable[..., Any]:
    """megatron.training's dataset build, keeping the training dataset the program's provider
    returns. Under DynaPipe's token budget (`--tokens-per-global-batch`) Megatron would ask
    for `--train-iters` x its default global batch of samples; a batch may hold as many
    samples as the budget has `--seq-length` windows, so the provider is asked for that many
    (megatron-core's datasets build their indices for the count they are given)."""

    @functools.wraps(build_datasets)
    def build_train_valid_test_datasets(provider: Any, num_samples: Any = None) -> Any:
        from megatron.training import get_args
        from megatron.training.training import get_train_valid_test_num_samples

        args = get_args()
        if args.dynapipe_plans and args.tokens_per_global_batch is not None:
            counts = list(num_samples or get_train_valid_test_num_samples())
            windows = max(1, args.tokens_per_global_batch // args.seq_length)
            counts[0] = max(counts[0], args.train_iters * windows)
            num_samples = counts
        datasets = build_datasets(provider, num_samples)
        _PROVIDED["train"] = datasets[0]
        return datasets

    return build_train_valid_test_datasets


class _ReadThroughPlans:
    """The training data loader Megatron's loop holds while DynaPipe plans: never read."""

    def __iter__(self) -> _ReadThroughPlans:
        return self

    def __next__(self) -> Any:
        raise RuntimeError("DynaPipe reads the training dataset through its plans")


def _unread_when_planned(build_loader: Callable[..., Any]) -> Callable[..., Any]:
    """megatron.training's data-loader build, giving the training dataset a loader nobody
    reads while DynaPipe plans: Megatron's sampler would count samples DynaPipe's batches do
    not follow (and refuse a resumed run whose planned samples passed the dataset's length),
    and its worker processes would read ahead samples nobody takes. Megatron's own loaders
    name a data file truncated under their workers (`exits.name_bus_errors_in_workers`)."""

    @functools.wraps(build_loader)
    def build_pretraining_data_loader(dataset: Any, consumed_samples: int) -> Any:
        from megatron.training import get_args

        planned = dataset is not None and dataset is _PROVIDED.get("train")
        if planned and get_args().dynapipe_plans:
            return _ReadThroughPlans()
        return name_bus_errors_in_workers(build_loader(dataset, consumed_samples))

    return build_pretraining_data_loader


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
    flags, its notes on them (rank 0) and the checkpoint `--load` names, so that bad ones stop
    the job before any process group or model exists. The data is the program's provider's,
    read when megatron.training asks for it."""
    arguments.check_training_flags(args)
    if args.rank == 0:
        for note in args.dynapipe_notes:
            print(note, file=sys.stdout, flush=True)
        if args.save:
            checkpointing.remove_interrupted_saves(args.save)
    checkpointing.resume_point(args)
