"""What every reader of a user's file checks first: plans, clusters, models, cost tables and
length files, in the tools and in the runtime.

Nothing a file holds may exhaust the machine or crash a reader: only regular files are read
(a device such as /dev/zero, or a FIFO, never ends), at most `MAX_INPUT_BYTES` of them; JSON
numbers are whole int64 values or finite floats (Python's reader takes any number of digits,
up to its 4,300-digit limit, and NaN or Infinity, which no count, size or time may be); nesting
deeper than the parser's recursion fails as a ValueError the caller names, not a crash.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from .errors import PlanningError

# 1 GiB: lengths of a hundred million samples as text, or a plan of millions of micro-batches.
MAX_INPUT_BYTES = 1 << 30


def check_input_file(
    path: str | os.PathLike[str],
    what: str,
    error: type[Exception] = PlanningError,
    limit: int = MAX_INPUT_BYTES,
) -> None:
    """Refuse `path` (named as `what` in the one-line error) when it exists but is not a
    regular file or is larger than `limit` bytes. A missing file is left to the reader, whose
    message names it."""
    try:
        info = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} {path}: not a regular file")
    if info.st_size > limit:
        raise error(f"{what} {path}: {info.st_size:,} bytes, more than the {limit:,} read")


def json_loads(text: str | bytes) -> Any:
    """`json.loads` whose integers fit int64 and whose floats are finite; anything else, and
    nesting past the parser's recursion, raises ValueError."""
    try:
        return json.loads(text, parse_int=_int64, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def json_reason(error: ValueError) -> str:
    """What `json_loads` refused, in a few words (a decoding error's message without its
    position, which callers give as a line number)."""
    return error.msg if isinstance(error, json.JSONDecodeError) else str(error)


def fits_int64(digits: str) -> bool:
    """Whether a decimal integer's digits (an optional sign, then digits) fit int64; the
    digits are counted first, since Python refuses to convert more than 4,300."""
    return len(digits.lstrip("+-")) <= 19 and -(2**63) <= int(digits) < 2**63


def _int64(digits: str) -> int:
    if not fits_int64(digits):
        raise ValueError(
            f"integer {digits[:24]}{'...' if len(digits) > 24 else ''} does not fit int64"
        )
    return int(digits)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is not finite")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")
