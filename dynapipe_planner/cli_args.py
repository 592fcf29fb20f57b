"""Argument checking and error reporting shared by the planner CLIs (#18): every bad input is
answered with exit status 2 and one line `<prog>: error: ...` naming the offending item, at parse
time where it can be (a number that is not finite, not positive, or past what the planner can
count). `--debug` (or DYNAPIPE_DEBUG=1) adds the traceback of an error raised past parsing, for
whoever debugs the program rather than the input; `pretrain_gpt.py` reports through the same
`report_error`.

One vocabulary (#35): every concept has one flag name, the same in every CLI, Megatron's where
Megatron has the concept (`--seq-length`, `--global-batch-size`, `--tensor-model-parallel-size`)
and the `--dynapipe-` form of the CLIs' name in `pretrain_gpt.py`; a spelling a release used
before is refused with one line naming its replacement (`add_renamed`), and no abbreviation of
a flag is taken for it (as Megatron's parser, `allow_abbrev=False`)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from .cluster import DEFAULT_GPU, GPU_PRESETS

# Counts the planner stores in int64 arrays and C++ `int64_t`s; anything larger is a typo.
MAX_COUNT = 2**62
MAX_GIB = 2**20
MAX_SAMPLES = 10**8  # synthetic samples drawn: int64 arrays of 800 MB
MAX_GPUS = 16384  # as `devices.MAX_CLUSTER_DEVICES`
# Tokens in one sequence: past every context window in use; the planners histogram lengths and
# price attention per token, so a typo of 10**11 asked for terabytes.
MAX_SEQUENCE = 2**24
MAX_BINS = 2**16  # layer-DP memory bins: its tables grow with the bins times the layers


DEBUG_HELP = "on an error, print its traceback before the one-line message (as DYNAPIPE_DEBUG=1)"


class OneLineParser(argparse.ArgumentParser):
    """argparse reporting a bad flag on one line, without the usage block, under the program's
    own name (a subcommand's parser is named `<prog> <command>`). Every such parser takes
    `--debug` for `report_error`, subcommands too; unless given it is absent from the namespace,
    so that a subcommand's default cannot undo `<prog> --debug <command>`. A flag is taken
    only as spelled in full, as Megatron's parser takes them."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP
        )

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.split()[0]}: error: {message}\n")


class _Renamed(argparse.Action):
    """A flag's old spelling: refused, naming the flag that replaced it, whatever follows it."""

    def __init__(self, option_strings, dest, replacement: str = "", **kwargs) -> None:
        hidden = dict(nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **hidden)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        parser.error(f"{option_string} was renamed {self.replacement}")


def add_renamed(parser: argparse.ArgumentParser | argparse._ArgumentGroup, renamed: dict) -> None:
    """Old spellings -> their replacements (a flag, perhaps with a note in parentheses): each
    old one is refused with exit status 2 and one line `<prog>: error: --old was renamed --new`,
    instead of being kept as a silent alias; hidden from `--help`."""
    for old, new in renamed.items():
        parser.add_argument(old, action=_Renamed, replacement=new)


def report_error(prog: str, error: BaseException, args: argparse.Namespace | None) -> None:
    """Tell the user why the run failed: one line `<prog>: error: <the message's first line>`
    on stderr. The traceback comes before it only when asked for (`--debug`, DYNAPIPE_DEBUG=1):
    a user error is the input's fault and the line names the input; frames would bury it."""
    if getattr(args, "debug", False) or os.environ.get("DYNAPIPE_DEBUG") == "1":
        traceback.print_exception(error, file=sys.stderr)
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    # One write: ranks failing together share a stderr, and print's two writes (the text, then
    # the newline) on an unbuffered stream let their lines run into one another.
    sys.stderr.write(f"{prog}: error: {first_line}\n")
    sys.stderr.flush()


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if abs(value) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most {MAX_COUNT})")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    if abs(value) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most {MAX_COUNT})")
    return value


def _require(value, text: str, ok: bool, why: str):
    """`value` when `ok`, else the argparse error `<text> <why>`."""
    if not ok:
        raise argparse.ArgumentTypeError(f"{text} {why}")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    return _require(value, text, value > 0, "must be positive")


def nonnegative_int(text: str) -> int:
    value = _int(text)
    return _require(value, text, value >= 0, "must not be negative")


def sample_count(text: str) -> int:
    value = positive_int(text)
    return _require(value, text, value <= MAX_SAMPLES, f"is more than {MAX_SAMPLES} samples")


def sequence_length(text: str) -> int:
    value = positive_int(text)
    why = f"is more than {MAX_SEQUENCE} tokens in one sequence"
    return _require(value, text, value <= MAX_SEQUENCE, why)


def sequence_cap(text: str) -> int:
    """A truncation length: 0 for none, else a `sequence_length`."""
    return 0 if nonnegative_int(text) == 0 else sequence_length(text)


def bin_count(text: str) -> int:
    value = positive_int(text)
    return _require(value, text, value <= MAX_BINS, f"is more than {MAX_BINS} bins")


def gpu_count(text: str) -> int:
    value = positive_int(text)
    return _require(value, text, value <= MAX_GPUS, f"is more than {MAX_GPUS} GPUs")


def seed(text: str) -> int:
    """A random seed: numpy's generators take 0 .. 2**32 - 1."""
    value = _int(text)
    return _require(value, text, 0 <= value < 2**32, "is not a seed in 0 .. 2**32 - 1")


def positive_float(text: str) -> float:
    value = _float(text)
    return _require(value, text, value > 0, "must be positive")


def memory_gib(text: str) -> float:
    """GiB per GPU (0: the GPU's own); a PiB or more is a typo. Refusals speak in GiB."""
    value = _float(text)
    _require(value, text, value >= 0, "GiB per GPU: a memory size must not be negative")
    return _require(value, text, value <= MAX_GIB, f"GiB is more than {MAX_GIB} GiB per GPU")


MEMORY_LIMIT_HELP = "usable GiB per GPU (default 0: the GPU's memory minus a reserve)"


def add_cluster_flags(
    group: argparse._ArgumentGroup, num_gpus: int | None, num_gpus_help: str | None = None
) -> None:
    """`--gpu`, `--num-gpus` and `--gpus-per-node`, spelled and defaulted alike in every CLI
    (only the number of GPUs differs by command)."""
    group.add_argument("--gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPU_PRESETS)}")
    group.add_argument("--num-gpus", type=gpu_count, default=num_gpus, help=num_gpus_help)
    group.add_argument("--gpus-per-node", type=positive_int, default=8)


def add_memory_limit_flag(group: argparse._ArgumentGroup, help: str = MEMORY_LIMIT_HELP) -> None:
    """`--memory-limit-gib`, the same in every CLI (0: the GPU's memory minus a reserve)."""
    group.add_argument("--memory-limit-gib", type=memory_gib, default=0, help=help)


def _named(flag: str) -> str:
    return f"argument {flag}"


def check_output_file(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """An output file must be writable where it is asked for, before any work is done: not a
    directory nor any other file that is not a regular one (a device, a FIFO: the atomic
    writer would replace it), in a writable directory that exists."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        parser.error(f"{_named(flag)}: {path} is a directory")
    if target.exists() and not target.is_file():
        parser.error(f"{_named(flag)}: {path} is not a regular file")
    _check_parent(parser, flag, path, target.parent)


def check_output_dir(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """An output directory must be a directory, or creatable as one in a directory that
    exists."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        _check_parent(parser, flag, path, target)
    elif target.exists():
        parser.error(f"{_named(flag)}: {path} exists and is not a directory")
    else:
        _check_parent(parser, flag, path, target.parent)


def _check_parent(parser: argparse.ArgumentParser, flag: str, path: str, parent: Path) -> None:
    parent = parent if str(parent) else Path(".")
    if not parent.exists():
        parser.error(f"{_named(flag)}: {path}: directory {parent} does not exist")
    if not parent.is_dir():
        parser.error(f"{_named(flag)}: {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        parser.error(f"{_named(flag)}: {path}: directory {parent} is not writable")
