"""How a DynaPipe job ends when something goes wrong, in `pretrain_gpt.py` and in a Megatron-LM
program under `import megatron.dynapipe.enable` alike.

The input's fault (bad data, tokenizer files, checkpoint, plan file, device speeds, a model that
fits nowhere) ends the job with exit status 2 and one line on rank 0: every rank meets the same
input, so one report is enough. A fault of the running job (a peer that died, a plan that never
came or was refused, a failed transfer) ends it with exit status 1 and one line on each rank
that saw it; each message names that rank and the iteration. `--debug` (or DYNAPIPE_DEBUG=1)
adds the traceback to either. The program's own code failing the plan (a `forward_step` that
drops a packed micro-batch's boundaries) ends with exit status 2 and one line on each rank that
met it, since only the ranks of the stages concerned do. A data file that shrinks under its
memory map while the job reads it ends the rank with exit status 1 and a line naming the file
(`_bus_error`, native: the fault cannot be handled in Python), in its data-loader workers too.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from dynapipe_planner.cli_args import report_error
from dynapipe_planner.errors import PlanningError, PlanningServiceError

from . import _bus_error
from .checkpoint_metadata import MetadataRefused
from .checkpointing import CheckpointError, CheckpointWriteError
from .data.base import DataError
from .device_speed import DeviceSpeedError
from .pipeline.executor import MissingPackedParams
from .pipeline.liveness import PeerFailure
from .pipeline.p2p import TransferError
from .pipeline.plan_source import PlanMismatch

USER_ERRORS = (
    DataError,
    CheckpointError,
    MetadataRefused,
    DeviceSpeedError,
    PlanningError,
)
JOB_FAULTS = (PeerFailure, PlanningServiceError, PlanMismatch, TransferError, CheckpointWriteError)
PROGRAM_ERRORS = (MissingPackedParams,)
# torch's words for a process of the job that is gone: a data-loader worker that died (the
# worker's own line comes first) and, under gloo, a peer rank whose connection closed.
_LOST_PROCESS = ("DataLoader worker (pid", "Connection closed by peer", "Connection reset by peer")


def exit_status(
    program: str, run: Callable[[], object], args: argparse.Namespace | None = None
) -> int:
    """Run `run()` and return the job's exit status (0, or 2 / 1 as above, the line printed).
    `args` carries `--debug`; by default Megatron's global arguments, once parsed."""
    rank = os.environ.get("RANK", "0")
    _name_bus_errors(program)
    try:
        run()
    except USER_ERRORS as error:
        if rank == "0":
            report_error(program, error, args or megatron_args())
        return 2
    except JOB_FAULTS as error:
        report_error(program, error, args or megatron_args())
        return 1
    except PROGRAM_ERRORS as error:
        report_error(program, error, args or megatron_args())
        return 2
    except RuntimeError as error:  # torch's, from megatron.training's own loop
        if not any(words in str(error) for words in _LOST_PROCESS):
            raise
        report_error(program, RuntimeError(f"rank {rank}: {error}"), args or megatron_args())
        return 1
    return 0


def program_name() -> str:
    """The running program's file name (`pretrain_gpt.py`, a Megatron-LM program's), which
    starts every line that ends the job."""
    return Path(sys.argv[0]).name or "megatron.training"


def name_bus_errors_in_workers[L](loader: L) -> L:
    """`loader` (a torch DataLoader, or None) with the bus-error line in its worker processes
    too: torch gives each worker a SIGBUS handler of its own (which blames shared memory) and
    then calls `worker_init_fn`, where this one is put back."""
    if getattr(loader, "num_workers", 0) > 0:
        loader.worker_init_fn = functools.partial(  # type: ignore[attr-defined]
            _worker_reports_bus_errors,
            program_name(),
            loader.worker_init_fn,  # type: ignore[attr-defined]
        )
    return loader


def _worker_reports_bus_errors(
    program: str, init: Callable[[int], object] | None, worker_id: int
) -> None:
    _name_bus_errors(program, worker_id)
    if init is not None:
        init(worker_id)


def _name_bus_errors(program: str, worker: int | None = None) -> None:
    """This process's bus errors end it with a line naming the file, after `program`, the rank
    and the data-loader `worker` (None: the rank itself)."""
    where = f"rank {os.environ.get('RANK', '0')}"
    if worker is not None:
        where += f", data-loader worker {worker}"
    _bus_error.install(f"{program}: error: {where}: ")


def run_or_exit[T](run: Callable[[], T], args: argparse.Namespace | None = None) -> T:
    """`run()`'s value, or the program's end as `exit_status` says (for a Megatron-LM program,
    named by its file, where an error would otherwise escape as a traceback)."""
    value: list[T] = []
    status = exit_status(program_name(), lambda: value.append(run()), args)
    if status:
        sys.exit(status)
    return value[0]


def megatron_args() -> argparse.Namespace | None:
    """megatron.training's parsed arguments, None before the program parses them."""
    from megatron.training.global_vars import get_args

    try:
        return get_args()
    except AssertionError:  # not parsed yet
        return None
