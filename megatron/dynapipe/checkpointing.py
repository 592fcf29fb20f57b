"""Save and resume training in Megatron-LM's checkpoint format, with Megatron's own code.

`save` hands the model, optimiser and LR schedule to `megatron.training.checkpointing.
save_checkpoint`: with `--ckpt-format torch_dist` (Megatron's default) that is a megatron-core
`dist_checkpointing` directory `<save>/iter_<NNNNNNN>/` built from the model's and optimiser's
`sharded_state_dict`, and `<save>/latest_checkpointed_iteration.txt`; `--ckpt-format torch`
writes Megatron's legacy `mp_rank_*/model_optim_rng.pt` files. `load` hands the same objects to
Megatron's `load_checkpoint`. A Megatron-LM run therefore continues under DynaPipe, a DynaPipe
run continues under Megatron-LM, and megatron-core's `dist_checkpointing.load` reads the
weights into a freshly built model. Megatron writes the tracker file only after every rank has
written its part, so a save that dies half-way leaves the previous checkpoint in force; what it
did write, an `iter_NNNNNNN` directory later than the tracker's and incomplete, is removed when
the next run starts (`remove_interrupted_saves`).

The data position lives where Megatron keeps it, in the saved arguments: `consumed_train_samples`
(Megatron's), plus DynaPipe's sampler place (`dynapipe_data_position`: global batches of a
token budget vary in size, so a sample count alone does not locate them) and the real tokens
consumed (`dynapipe_consumed_tokens`). They are written into the copy of the job's arguments
that the checkpoint keeps (`_checkpoint_args`), never into the job's own. `resume_point` reads
them before the model exists, so planning starts while the model is built. A checkpoint without
DynaPipe's position (written by Megatron-LM) resumes the sampler at the checkpoint's iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import pickle
import re
import shutil
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dynapipe_planner.processes import main_hidden

from . import checkpoint_metadata, megatron_hooks

# The files of DynaPipe's layout-independent checkpoints (heterogeneous jobs, `hetero`).
LATEST = "latest_iteration.txt"
FULL_STATE = "full_state.pt"


@dataclass
class TrainState:
    """Where training stands, besides the weights and the optimiser."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    floating_point_operations: float = 0.0


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or from a different job layout; names the path."""


class CheckpointWriteError(RuntimeError):
    """A save failed on the file system (disk full, no permission); names where and why."""


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint's place in training, read before the model is built."""

    directory: Path
    state: TrainState
    data_position: dict | None  # DynaPipe's sampler place; None in Megatron-LM's checkpoints


def _megatron():
    from megatron.training import checkpointing

    return checkpointing


def get_write_results_queue(*args: object, **kwargs: object) -> PickledResults:
    """megatron-core's torch_dist writer starts one multiprocessing manager per rank (it carries
    asynchronous saves' results) with "spawn", which re-imports the training script in it:
    10 s of CPU and ~400 MB per rank at the first save, for a process that needs neither torch
    nor megatron. Start it with `__main__` hidden (`dynapipe_planner.processes`) and hand the
    writer its queue as `PickledResults`; installed by `megatron_hooks` (group CHECKPOINTS)."""
    start = megatron_hooks.original(
        "megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue"
    )
    with main_hidden():
        return PickledResults(start(*args, **kwargs))


class PickledResults:
    """The writer's results queue, its items crossing it as pickled bytes. A manager process
    unpickles what is put in its queue, and the writer's results are torch.distributed.checkpoint
    objects: holding them imported torch in the manager (4-5 CPU-s and ~400 MB a rank). Bytes
    leave it a bare interpreter; the rank that put them unpickles them. megatron-core puts and
    takes with `put` and `get_nowait` only. Pickles (with the manager's proxy) into the process
    that writes an asynchronous save."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def put(self, item: object, *args: object, **kwargs: object) -> None:
        self.queue.put(pickle.dumps(item), *args, **kwargs)

    def get_nowait(self) -> object:
        return pickle.loads(self.queue.get_nowait())


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a Megatron-format checkpoint (its tracker file)."""
    return _megatron().checkpoint_exists(str(directory))


def resume_point(args: argparse.Namespace) -> ResumePoint | None:
    """The checkpoint `--load` names, or None to start from scratch: no --load, or (as
    Megatron does) a --load directory without a checkpoint yet."""
    # What loads the checkpoint reads .metadata without running code; lean writer processes.
    megatron_hooks.install(megatron_hooks.CHECKPOINTS)
    if not args.load:
        return None
    directory = Path(args.load)
    if not has_checkpoint(directory):
        if (directory / LATEST).is_file():
            raise CheckpointError(
                f"--load {directory} holds a heterogeneous job's layout-independent checkpoint; "
                "resume it with --dynamic-strategies or --hetero-plan"
            )
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {directory}: no checkpoint there")
        return None
    saved = _saved_args(directory)
    state = TrainState(
        iteration=int(getattr(saved, "iteration", 0) or 0),
        consumed_samples=int(getattr(saved, "consumed_train_samples", 0) or 0),
        consumed_tokens=int(getattr(saved, "dynapipe_consumed_tokens", 0) or 0),
    )
    return ResumePoint(directory, state, getattr(saved, "dynapipe_data_position", None))


def _tracked_iteration(directory: Path) -> tuple[int, bool]:
    """The iteration (or release) Megatron's tracker file names; a bad one is named."""
    tracker = Path(_megatron().get_checkpoint_tracker_filename(str(directory)))
    text = tracker.read_text().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise CheckpointError(f"{tracker} does not hold an iteration number: {text[:40]!r}")
    return iteration, False


def _saved_args(directory: Path) -> argparse.Namespace:
    """The arguments (and iteration) the latest checkpoint in `directory` was saved with,
    read without the model: the common state of a dist_checkpointing directory, or the first
    legacy file. Both are unpickled with `weights_only=True` (megatron-core registers the
    argument types as safe)."""
    from megatron.core import dist_checkpointing

    iteration, release = _tracked_iteration(directory)
    base = _iteration_dir(directory, iteration, release)
    if not base.is_dir():
        raise CheckpointError(f"checkpoint directory {base} is missing")
    checkpoint_metadata.check(base)
    with named(base):
        if dist_checkpointing.check_is_distributed_checkpoint(str(base)):
            common = dist_checkpointing.load_common_state_dict(str(base))
        else:
            first = _megatron().find_checkpoint_rank_0(str(directory), iteration, release)
            if first is None:
                raise CheckpointError(f"{base} holds neither a torch_dist nor a torch checkpoint")
            common = torch.load(first, map_location="cpu", weights_only=True)
    saved = common.get("args") or argparse.Namespace()
    saved.iteration = 0 if release else common.get("iteration", iteration)
    return saved


def _iteration_dir(directory: Path, iteration: int, release: bool = False) -> Path:
    """Where Megatron keeps the checkpoint of `iteration` (or the release) in `directory`."""
    return Path(
        _megatron().get_checkpoint_name(str(directory), iteration, release, return_base_dir=True)
    )


@contextlib.contextmanager
def named(path: Path) -> Iterator[None]:
    """Any failure to read `path` becomes a CheckpointError naming it, or the damaged file in
    it (a torch_dist shard shorter than its metadata says). torch.distributed.checkpoint's
    CheckpointException is a BaseException, and Megatron's loader calls sys.exit on some bad
    checkpoints; both are caught too."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointError, checkpoint_metadata.MetadataRefused):
        raise
    except (Exception, CheckpointException, SystemExit) as err:  # many types for bad files
        refused = _refused_global(err)
        if refused is not None:
            where = path / "common.pt" if (path / "common.pt").is_file() else path
            raise CheckpointError(
                f"checkpoint {where} names {refused}, which checkpoints never hold; not loading "
                "it (a crafted pickle could run code)"
            ) from err
        damaged = _damaged_file(path)
        if damaged is not None:
            raise CheckpointError(
                f"checkpoint {damaged} is corrupt: shorter than {path / '.metadata'} records"
            ) from err
        first_line = _first_line(err)
        if "OptimizerParamScheduler" in first_line:  # Megatron's resume rule for the LR schedule
            first_line += (
                "; --override-opt-param-scheduler takes this run's flags, "
                "--use-checkpoint-opt-param-scheduler the checkpoint's"
            )
        elif "optimizer.state." in first_line and "not in state dict" in first_line:
            first_line = (
                "it holds no optimizer state, as a save before the first optimizer step leaves "
                "it (fp16 skips steps while its loss scale settles); --no-load-optim loads the "
                "rest"
            )
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {first_line}") from err


# How torch's weights-only unpickler (torch.load's default, which megatron-core's common.pt
# reader relies on) names the global it refused.
_REFUSED_GLOBAL = re.compile(r"Weights only load failed.*?GLOBAL ([\w.]+)", re.DOTALL)


def _refused_global(err: BaseException) -> str | None:
    """The code a checkpoint's pickle asked for, when torch.load refused it (also inside the
    first failure torch's CheckpointException holds)."""
    match = _REFUSED_GLOBAL.search(str(_first_failure(err)))
    return match.group(1) if match else None


def _first_failure(err: BaseException) -> BaseException:
    """`err`, or the first rank's failure when it is torch's CheckpointException (which holds
    one per failed rank)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        return _first_failure(next(iter(err.failures.values()))[0])
    return err


def _first_line(err: BaseException) -> str:
    """What went wrong, in one line: the first line of `err`'s message (and the first item of
    a list it introduces), or of the first rank's failure torch's CheckpointException holds."""
    err = _first_failure(err)
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    first_line = lines[0] if lines else type(err).__name__
    if first_line.endswith(":") and len(lines) > 1:  # a list follows: name its first item
        first_line += " " + lines[1]
    return first_line


def _damaged_file(base: Path) -> Path | None:
    """The first file of a torch_dist directory shorter than its `.metadata` records."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (base / ".metadata").is_file():
        return None
    try:
        storage = FileSystemReader(str(base)).read_metadata().storage_data
    except checkpoint_metadata.MetadataRefused:  # refused, not damaged
        raise
    except Exception:
        return base / ".metadata"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        path = base / name
        if not path.is_file() or path.stat().st_size < size:
            return path
    return None


def loaded_directory(load: str | os.PathLike) -> Path:
    """The directory a load of `load` reads: its tracked iteration's, or `load` itself when
    it holds no checkpoint (or its tracker names none)."""
    directory = Path(load)
    if not has_checkpoint(directory):
        return directory
    try:
        iteration, release = _tracked_iteration(directory)
    except CheckpointError:
        return directory
    return _iteration_dir(directory, iteration, release)


@contextlib.contextmanager
def written(directory: str | os.PathLike, iteration: int) -> Iterator[None]:
    """A save of `iteration` into `directory` that fails on the file system (disk full, no
    permission: an OSError on any rank, also inside torch's checkpoint writer) becomes a
    CheckpointWriteError naming the directory and the reason; the incomplete iteration is
    removed when the next run starts (`remove_interrupted_saves`)."""
    try:
        yield
    except BaseException as err:  # torch's CheckpointException is a BaseException
        reason = _write_failure(err, Path(directory))
        if reason is None:
            raise
        raise CheckpointWriteError(
            f"saving iteration {iteration} to {directory} failed: {reason}; the incomplete "
            "save is removed when the next run starts"
        ) from err


def _write_failure(err: BaseException, directory: Path) -> str | None:
    """Why a save failed on the file system or in torch's checkpoint writer, or None when it
    failed otherwise. megatron-core's writer processes report an OSError by its class name
    only; the disk is then asked. A rank whose own writes went through learns only that
    another rank's did not."""
    from torch.distributed.checkpoint.api import CheckpointException

    cause = _os_error(err)
    if cause is not None:
        reason = os.strerror(cause.errno) if cause.errno else str(cause)
        return reason + (f" ({cause.filename})" if cause.filename else "")
    if "OSError" not in str(err):
        if isinstance(err, CheckpointException):
            return _first_line(err) if err.failures else "another rank's writes failed"
        return None
    existing = next((p for p in (directory, *directory.parents) if p.is_dir()), Path("/"))
    free = shutil.disk_usage(existing).free
    if free < 2**20:
        return f"{os.strerror(errno.ENOSPC)} ({free:,} bytes free)"
    return "a writer process of the checkpoint hit an OSError"


def _os_error(err: BaseException, depth: int = 0) -> OSError | None:
    """The first OSError in `err`, its causes, or the per-rank failures torch's
    CheckpointException collects."""
    from torch.distributed.checkpoint.api import CheckpointException

    if err is None or depth > 16:
        return None
    if isinstance(err, OSError):
        return err
    nested: list[BaseException | None] = [err.__cause__, err.__context__]
    if isinstance(err, CheckpointException):
        nested += [failure[0] for failure in err.failures.values()]
    for inner in nested:
        found = _os_error(inner, depth + 1) if inner is not None else None
        if found is not None:
            return found
    return None


def save(
    args: argparse.Namespace,
    state: TrainState,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    data_position: dict | None,
) -> None:
    """Megatron's save_checkpoint of iteration `state.iteration` (a collective), its saved
    arguments holding where training stands (`_checkpoint_args`)."""
    with written(args.save, state.iteration), _checkpoint_args(args, state, data_position):
        _megatron().save_checkpoint(
            state.iteration, [model], optimizer, scheduler, state.floating_point_operations
        )


@contextlib.contextmanager
def _checkpoint_args(
    args: argparse.Namespace, state: TrainState, data_position: dict | None
) -> Iterator[None]:
    """Megatron's save_checkpoint keeps the arguments Megatron's global holds (`get_args()`):
    inside the block that global is a copy of `args` with where training stands
    (`consumed_train_samples`, DynaPipe's `dynapipe_consumed_tokens` and
    `dynapipe_data_position`), which `resume_point` reads back; the job's own `args` are left
    as they were."""
    from megatron.training import global_vars

    saved = argparse.Namespace(**vars(args))
    saved.consumed_train_samples = state.consumed_samples
    saved.dynapipe_consumed_tokens = state.consumed_tokens
    saved.dynapipe_data_position = data_position
    megatron_args = global_vars.get_args()
    global_vars.set_args(saved)
    try:
        yield
    finally:
        global_vars.set_args(megatron_args)


def load(
    args: argparse.Namespace, point: ResumePoint, model: torch.nn.Module, optimizer, scheduler
) -> TrainState:
    """Megatron's load_checkpoint: weights, optimiser, LR schedule and random streams."""
    base = _iteration_dir(point.directory, point.state.iteration)
    with named(base):
        iteration, flops = _megatron().load_checkpoint([model], optimizer, scheduler)
    if iteration != point.state.iteration:
        raise CheckpointError(
            f"{point.directory} changed while loading: iteration {point.state.iteration} was "
            f"tracked, {iteration} loaded"
        )
    dist.barrier()
    return TrainState(
        iteration,
        point.state.consumed_samples,
        point.state.consumed_tokens,
        float(flops or 0.0),
    )


def remove_interrupted_saves(directory: str | os.PathLike) -> None:
    """Remove the iterations a killed save left in `directory` (the --save directory; rank 0,
    at start): see `remove_partial_iterations`, after the iteration Megatron's tracker names.
    A tracker that names no iteration (release, or damaged) leaves everything in place."""
    directory = Path(directory)
    tracked = None
    if has_checkpoint(directory):
        try:
            tracked, release = _tracked_iteration(directory)
        except CheckpointError:  # a --load of it names the damage; nothing is judged by it
            return
        if release:
            return
    remove_partial_iterations(directory, tracked)


def remove_partial_iterations(directory: Path, tracked: int | None) -> None:
    """Remove each `iter_NNNNNNN` directory later than `tracked` (the iteration the tracker
    names; None: no tracker yet) that a save did not complete, with one warning line naming it.
    The tracker moves only after a whole save, so such a directory was never in force and no
    load reads it; it only holds the disk. Nothing tracked or earlier, and nothing complete
    (a save killed between its last file and the tracker), is touched."""
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("iter_*")):
        number = path.name.removeprefix("iter_")
        if not (number.isdigit() and path.is_dir()):
            continue
        if (tracked is not None and int(number) <= tracked) or _complete_save(path):
            continue
        shutil.rmtree(path)
        say_removed(path)


def say_removed(path: Path) -> None:
    """The line that names what an interrupted save left and the start removed (on stderr,
    where Megatron's logging configuration cannot hide it)."""
    print(f"removed {path}: a save interrupted before it was complete", file=sys.stderr, flush=True)


def _complete_save(path: Path) -> bool:
    """Whether the `iter_NNNNNNN` directory `path` holds a whole save in any format this
    runtime writes: torch.distributed.checkpoint's `.metadata` (rank 0 writes it once every
    rank's shards are written; torch_dist adds `metadata.json` after it); a heterogeneous
    job's `full_state.pt` (renamed into place whole); or `--ckpt-format torch`'s
    `mp_rank_*/model_optim_rng.pt`, each a whole zip archive (torch.save's format: a write
    cut short lacks the archive's closing record)."""
    if any((path / name).is_file() for name in (".metadata", "metadata.json", FULL_STATE)):
        return True
    ranks = list(path.glob("mp_rank_*"))
    return bool(ranks) and all(zipfile.is_zipfile(r / "model_optim_rng.pt") for r in ranks)


def release_writer_processes() -> None:
    """dist_checkpointing's torch_dist writer starts a multiprocessing manager process per
    rank at its first save (a module global holding the write results) and never stops it;
    stop it when training ends, so no process outlives the job."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    megatron_hooks.assign(filesystem_async.__name__, {"_results_queue": None})
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()


def rng_state() -> dict:
    """This rank's random streams: the default generator (dropout outside TP regions), the
    device generator on a GPU, and megatron's TP RNG tracker (dropout inside TP regions)."""
    from megatron.core import tensor_parallel

    state = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Resume the streams `rng_state` saved (after the model drew its initialisation)."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
