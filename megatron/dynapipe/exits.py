"""How a DynaPipe job ends when something goes wrong, in `pretrain_gpt.py` and in a Megatron-LM
program under `import megatron.dynapipe.enable` alike.

The input's fault (bad data, tokenizer files, checkpoint, plan file, device speeds, a model that
fits nowhere) ends the job with exit status 2 and one line on rank 0: every rank meets the same
input, so one report is enough. A fault of the running job (a peer that died, a plan that never
came or was refused, a failed transfer) ends it with exit status 1 and one line on each rank
that saw it; each message names that rank and the iteration. `--debug` (or DYNAPIPE_DEBUG=1)
adds the traceback to either. The program's own code failing the plan (a `forward_step` that
drops a packed micro-batch's boundaries) ends with exit status 2 and one line on each rank that
met it, since only the ranks of the stages concerned do.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from dynapipe_planner.cli_args import report_error
from dynapipe_planner.errors import PlanningError, PlanningServiceError

from .checkpoint_metadata import MetadataRefused
from .checkpointing import CheckpointError, CheckpointWriteError
from .data.base import DataError
from .device_speed import DeviceSpeedError
from .hetero.candidates import CandidateError
from .hetero.plan_file import HeteroPlanError
from .pipeline.executor import MissingPackedParams
from .pipeline.liveness import PeerFailure
from .pipeline.p2p import TransferError
from .pipeline.plan_source import PlanMismatch

USER_ERRORS = (
    DataError,
    CheckpointError,
    MetadataRefused,
    DeviceSpeedError,
    HeteroPlanError,
    CandidateError,
    PlanningError,
)
JOB_FAULTS = (PeerFailure, PlanningServiceError, PlanMismatch, TransferError, CheckpointWriteError)
PROGRAM_ERRORS = (MissingPackedParams,)


def exit_status(
    program: str, run: Callable[[], object], args: argparse.Namespace | None = None
) -> int:
    """Run `run()` and return the job's exit status (0, or 2 / 1 as above, the line printed).
    `args` carries `--debug`; by default Megatron's global arguments, once parsed."""
    try:
        run()
    except USER_ERRORS as error:
        if os.environ.get("RANK", "0") == "0":
            report_error(program, error, args or megatron_args())
        return 2
    except JOB_FAULTS as error:
        report_error(program, error, args or megatron_args())
        return 1
    except PROGRAM_ERRORS as error:
        report_error(program, error, args or megatron_args())
        return 2
    return 0


def run_or_exit[T](run: Callable[[], T], args: argparse.Namespace | None = None) -> T:
    """`run()`'s value, or the program's end as `exit_status` says (for a Megatron-LM program,
    named by its file, where an error would otherwise escape as a traceback)."""
    value: list[T] = []
    status = exit_status(
        Path(sys.argv[0]).name or "megatron.training", lambda: value.append(run()), args
    )
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
