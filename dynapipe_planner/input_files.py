"""What every reader of a user's file checks first: plans, clusters, models, cost tables and
length files, in the tools and in the runtime.

Nothing a file holds may exhaust the machine or crash a reader: only regular files are read
(a device such as /dev/zero, or a FIFO, never ends), at most `MAX_INPUT_BYTES` of them; JSON
numbers are whole int64 values or finite floats (Python's reader takes any number of digits,
up to its 4,300-digit limit, and NaN or Infinity, which no count, size or time may be); nesting
deeper than the parser's recursion fails as a ValueError the caller names, not a crash.

`load_json_file` is how every reader of a user's JSON file (a plan, a model, a cost table, a
candidates file, a flag's file in the runtime) opens it, so a bad file is one line in the same
words whichever tool or flag read it: the reader's name for the file (its flag or role), the
path, and what is wrong (missing, not a regular file, unreadable, not UTF-8, invalid JSON at a
line and column, or a top-level value of the wrong type).
"""

from __future__ import annotations

import json
import math
import os
import stat
import types
from pathlib import Path
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


def read_input_file(
    path: str | os.PathLike[str], what: str, error: type[Exception] = PlanningError
) -> bytes:
    """The bytes of the user's file `path` (named as `what`), after `check_input_file`; a file
    that is missing or cannot be read is one line naming it, not a traceback."""
    check_input_file(path, what, error)
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise error(f"cannot read {what} {path}: the file does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None


def parse_json_document(
    raw: bytes,
    named: str,
    error: type[Exception] = PlanningError,
    kind: type | None = None,
    invalid: str = "not valid JSON",
) -> Any:
    """`raw` (the file `named`, e.g. "cost table t.json") decoded as UTF-8 and parsed by
    `json_loads`, its top-level value of type `kind` when one is given. A decoding error gives
    its line and column (where to look in an editor); `invalid` says what the file is not (a
    reader that also takes another format names both)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{named}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json_loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{named}: {invalid} ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise error(f"{named}: {invalid} ({e})") from None
    if kind is not None and not isinstance(data, kind):
        raise error(f"{named}: its top level is {_json_type(type(data))}, not {_json_type(kind)}")
    return data


def load_json_file(
    path: str | os.PathLike[str],
    what: str,
    error: type[Exception] = PlanningError,
    kind: type | None = dict,
) -> Any:
    """The JSON document in the user's file `path`, which the caller calls `what` (its flag or
    role: "--hetero-plan", "cost table"); every failure is one `error` naming both
    (`read_input_file`, `parse_json_document`). `kind=None` leaves the top-level type to a
    caller whose own message says more (e.g. the format it expected)."""
    return parse_json_document(read_input_file(path, what, error), f"{what} {path}", error, kind)


def _json_type(kind: type) -> str:
    """What JSON calls a type `json_loads` returns, with its article."""
    names: tuple[tuple[type | types.UnionType, str], ...] = (
        (type(None), "null"),
        (bool, "a boolean"),  # before int, which bool subclasses
        (int | float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    )
    return next((name for t, name in names if issubclass(kind, t)), kind.__name__)


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
