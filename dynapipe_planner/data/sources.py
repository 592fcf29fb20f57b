"""Read per-sample sequence lengths from the files a training job already has.

The planner only needs how long each sample is, not its tokens, so each reader extracts lengths
and nothing else: plain text (one length, or input and target length, per line), `.npy` arrays,
`.jsonl` records (token-id lists, raw text counted as UTF-8 bytes, or explicit lengths) and
Megatron indexed datasets (`.idx`/`.bin` pairs, whose index already stores every sequence length).
Bad input raises `PlanningError` naming the file and the offending line or sample, because a
planning job over millions of samples is useless if it only says "invalid value".
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
import warnings
from collections.abc import Callable
from os import PathLike
from pathlib import Path

import numpy as np

from ..errors import PlanningError
from ..input_files import check_input_file, fits_int64, json_loads, json_reason
from .validation import check_positive, check_shape

INPUT_KEYS = ("input_ids", "text", "length")
TARGET_KEYS = ("target_ids", "targets", "target")

_INTEGER = re.compile(r"[+-]?[0-9]+")

# Megatron MMIDIDX header: magic, version, token dtype code, sequence count, document count.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")
_IDX_DTYPE_CODES = range(1, 9)  # uint8, int8, int16, int32, int64, float64, float32, uint16


def load_lengths(
    path: str | PathLike[str], *, field: str | None = None, target_field: str | None = None
) -> np.ndarray:
    """Per-sample lengths of a dataset file as int64, shape (N,) or (N, 2) with target lengths.

    The format follows the suffix: `.npy`, `.jsonl`, `.idx`/`.bin` (Megatron indexed dataset; a
    bare prefix works when `<prefix>.idx` exists), anything else is plain text. `field` and
    `target_field` pick the `.jsonl` keys of input and target (see `INPUT_KEYS`, `TARGET_KEYS`).
    """
    path = Path(path)
    kind, source = _resolve(path)
    if kind != "jsonl" and (field is not None or target_field is not None):
        raise PlanningError(f"{path}: field/target_field apply only to .jsonl files")
    readers: dict[str, Callable[[Path], np.ndarray]] = {
        "text": _load_text,
        "npy": _load_npy,
        "megatron": _load_megatron_index,
        "jsonl": lambda p: _load_jsonl(p, field, target_field),
    }
    return readers[kind](source)


def _resolve(path: Path) -> tuple[str, Path]:
    """(format, file to read) for a user-given path; a Megatron dataset is read via its index."""
    suffix = path.suffix.lower()
    prefix_index = Path(f"{path}.idx")
    if suffix == ".bin" or (suffix != ".idx" and not path.exists() and prefix_index.exists()):
        index = path.with_suffix(".idx") if suffix == ".bin" else prefix_index
        if not index.is_file():
            raise PlanningError(f"{path}: Megatron index {index} not found")
        return "megatron", index
    if not path.exists():
        raise PlanningError(f"{path}: no such file")
    check_input_file(path, "lengths file")
    kinds = {".idx": "megatron", ".npy": "npy", ".jsonl": "jsonl"}
    return kinds.get(suffix, "text"), path


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise PlanningError(f"{path}: not UTF-8 text ({error})") from None


# ---------------------------------------------------------------- plain text


def _load_text(path: Path) -> np.ndarray:
    """One length, or input and target length (whitespace or comma separated), per line.

    `#` starts a comment; blank lines are skipped. numpy's C parser reads well-formed files fast;
    anything it rejects, or lengths that fail validation, go through the line-by-line parser,
    which is slower but names the offending line.
    """
    text = _read_text(path)
    lengths = _parse_text_fast(text.replace(",", " "))
    return lengths if lengths is not None else _parse_text_lines(path, text)


def _parse_text_fast(text: str) -> np.ndarray | None:
    """Valid lengths via `np.loadtxt`, or None when the text needs the line-by-line parser."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            values = np.loadtxt(io.StringIO(text), dtype=np.int64, comments="#", ndmin=2)
    except ValueError:
        return None
    if values.shape[0] == 0 or values.shape[1] > 2 or values.min() <= 0:
        return None
    return values[:, 0].copy() if values.shape[1] == 1 else values


def _parse_text_lines(path: Path, text: str) -> np.ndarray:
    lines = text.splitlines()
    numbers, rows = [], []
    for number, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if fields:
            numbers.append(number)
            rows.append(fields)
    if not rows:
        raise PlanningError(f"{path}: no samples")

    def where(row: int) -> str:
        return f"{path} line {numbers[row]}"

    def content(row: int) -> str:
        return _excerpt(lines[numbers[row] - 1])

    width = len(rows[0])
    for row, fields in enumerate(rows):
        if len(fields) != width or width > 2:
            raise PlanningError(
                f"{where(row)}: expected 1 or 2 integers per line, the same on every line "
                f"(line {numbers[0]} has {width}), got {content(row)}"
            )
        bad = next((field for field in fields if not _is_int64(field)), None)
        if bad is not None:
            raise PlanningError(
                f"{where(row)}: {_excerpt(bad, 24)} is not an integer length in {content(row)}"
            )
    lengths = np.array(rows, dtype=np.int64).reshape(-1, width)
    lengths = lengths[:, 0] if width == 1 else lengths
    check_positive(lengths, where)
    return lengths


def _is_int64(field: str) -> bool:
    """A plain decimal integer (what `np.loadtxt` parses) that fits int64."""
    return bool(_INTEGER.fullmatch(field)) and fits_int64(field)


# ---------------------------------------------------------------- .npy


def _load_npy(path: Path) -> np.ndarray:
    """A 1-D or (N, 2) integer array; whole-number floats are accepted, other floats are not.
    The header's shape must match the file's size before anything is allocated."""
    _check_npy_header(path)
    try:
        values = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise PlanningError(f"{path}: not a readable .npy array ({error})") from None
    check_shape(values, str(path))
    if values.dtype.kind not in "iuf":
        raise PlanningError(f"{path}: expected an integer array, got dtype {values.dtype}")
    if values.dtype.kind != "i":
        _check_whole_int64(values, path)
    lengths = values.astype(np.int64)
    check_positive(lengths, lambda _row: str(path))
    return lengths


def _check_npy_header(path: Path) -> None:
    """A `.npy` header whose shape holds more elements than the file's bytes is refused before
    numpy allocates them (a 100-byte file can declare 10^13 elements)."""
    try:
        with path.open("rb") as file:
            version = np.lib.format.read_magic(file)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(file)
            offset = file.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as error:
        raise PlanningError(f"{path}: not a readable .npy array ({error})") from None
    needed = math.prod(shape) * dtype.itemsize
    held = path.stat().st_size - offset
    if needed != held:
        raise PlanningError(
            f"{path}: its header declares shape {tuple(shape)} of {dtype} ({needed:,} bytes), "
            f"the file holds {held:,}"
        )


def _check_whole_int64(values: np.ndarray, path: Path) -> None:
    """Floats and unsigned values must be whole numbers that fit int64."""
    as_float = values.astype(np.float64)
    bad = ~np.isfinite(as_float) | (as_float != np.floor(as_float)) | (np.abs(as_float) >= 2.0**63)
    rows = np.flatnonzero(bad.any(axis=1) if bad.ndim == 2 else bad)
    if rows.size:
        row = int(rows[0])
        raise PlanningError(
            f"{path}: sample {row} has length {values[row].tolist()}; "
            "lengths must be whole numbers that fit int64"
        )


# ---------------------------------------------------------------- .jsonl


def _load_jsonl(path: Path, field: str | None, target_field: str | None) -> np.ndarray:
    """Lengths from JSON records; the keys are chosen on the first record and required on all."""
    records = _read_records(path)
    first_line, first = records[0]
    input_key = field or _first_key(first, INPUT_KEYS)
    if input_key is None:
        raise PlanningError(
            f"{path} line {first_line}: none of the fields {', '.join(INPUT_KEYS)} found "
            f"(fields: {', '.join(first)}); pass field= to choose one"
        )
    target_key = target_field or _first_key(first, TARGET_KEYS)
    keys = (input_key,) if target_key is None else (input_key, target_key)
    lengths = np.array(
        [
            [_record_length(record, key, f"{path} line {line}") for key in keys]
            for line, record in records
        ],
        dtype=np.int64,
    )
    lengths = lengths[:, 0] if target_key is None else lengths
    check_positive(lengths, lambda row: f"{path} line {records[row][0]}")
    return lengths


def _read_records(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line."""
    records = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json_loads(line)
        except ValueError as error:  # malformed, nested too deeply, or a number out of range
            raise PlanningError(
                f"{path} line {number}: invalid JSON ({json_reason(error)}): {_excerpt(line)}"
            ) from None
        if not isinstance(record, dict):
            raise PlanningError(
                f"{path} line {number}: expected a JSON object, got {_excerpt(line)}"
            )
        records.append((number, record))
    if not records:
        raise PlanningError(f"{path}: no samples")
    return records


def _first_key(record: dict, keys: tuple[str, ...]) -> str | None:
    return next((key for key in keys if key in record), None)


# What the well-known keys hold ("targets" and "target" hold text or a length, as datasets
# use them); any other key, as field= picks it, may hold any of the three.
_KEY_KINDS = {"input_ids": "ids", "target_ids": "ids", "text": "text", "length": "length"}
_KIND_NAMES = {"ids": "a flat list of integer token ids", "text": "a string",
               "length": "an integer length"}  # fmt: skip


def _record_length(record: dict, key: str, where: str) -> int:
    """Token-id list -> its length, string -> UTF-8 bytes (byte-level tokens), integer -> itself;
    a well-known key must hold its own kind ("text" a string, "input_ids" a flat list of
    integer ids, "length" an integer), so a number under "text" is not read as a length."""
    if key not in record:
        raise PlanningError(f"{where}: missing field {key!r} (fields: {', '.join(record)})")
    value = record[key]
    kind = _value_kind(value)
    wanted = _KEY_KINDS.get(key)
    if kind is not None and wanted in (None, kind):
        if kind == "ids":
            return len(value)
        return len(value.encode("utf-8")) if kind == "text" else value
    expected = _KIND_NAMES[wanted] if wanted else ", ".join(_KIND_NAMES.values())
    raise PlanningError(
        f"{where}: field {key!r} is {_excerpt(json.dumps(value))}; expected {expected}"
    )


def _value_kind(value: object) -> str | None:
    """ "ids", "text" or "length" for what a length can be read from, else None."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return "length" if -(2**63) <= value < 2**63 else None
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return "ids"
    return None


def _excerpt(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---------------------------------------------------------------- Megatron .idx


def _load_megatron_index(path: Path) -> np.ndarray:
    """Sequence lengths of a Megatron MMIDIDX index, after checking that its layout is intact.

    Layout: header, int32[sequences] lengths, int64[sequences] byte pointers, int64[documents]
    document boundaries (0 first, sequence count last); multimodal indexes append int8 modes.
    """
    size = path.stat().st_size
    with path.open("rb") as file:
        header = file.read(_IDX_HEADER.size)
    if len(header) < _IDX_HEADER.size:
        raise PlanningError(
            f"{path}: truncated Megatron index: header needs {_IDX_HEADER.size} bytes, "
            f"file has {size}"
        )
    magic, version, dtype_code, sequences, documents = _IDX_HEADER.unpack(header)
    _check_idx_header(path, magic, version, dtype_code)
    expected = _IDX_HEADER.size + 12 * sequences + 8 * documents
    if size < expected:
        raise PlanningError(
            f"{path}: truncated Megatron index: {sequences} sequences and {documents} document "
            f"boundaries need {expected} bytes, file has {size}"
        )
    if size not in (expected, expected + sequences):
        raise PlanningError(
            f"{path}: corrupt Megatron index: {size - expected} unexpected bytes after the "
            f"{expected} that {sequences} sequences and {documents} document boundaries need"
        )
    if sequences == 0:
        raise PlanningError(f"{path}: no samples")
    boundaries = np.fromfile(path, "<i8", count=documents, offset=_IDX_HEADER.size + 12 * sequences)
    _check_document_boundaries(path, boundaries, sequences)
    lengths = np.fromfile(path, "<i4", count=sequences, offset=_IDX_HEADER.size).astype(np.int64)
    check_positive(lengths, lambda _row: str(path))
    return lengths


def _check_idx_header(path: Path, magic: bytes, version: int, dtype_code: int) -> None:
    if magic != _IDX_MAGIC:
        raise PlanningError(
            f"{path}: not a Megatron index: magic {magic!r}, expected {_IDX_MAGIC!r}"
        )
    if version != 1:
        raise PlanningError(f"{path}: unsupported Megatron index version {version}, expected 1")
    if dtype_code not in _IDX_DTYPE_CODES:
        raise PlanningError(
            f"{path}: corrupt Megatron index: unknown token dtype code {dtype_code}"
        )


def _check_document_boundaries(path: Path, boundaries: np.ndarray, sequences: int) -> None:
    """Document boundaries index into the sequences: non-decreasing from 0 to the count."""
    problem = None
    if boundaries.size == 0 or boundaries[0] != 0 or boundaries[-1] != sequences:
        ends = boundaries[[0, -1]].tolist() if boundaries.size else "none"
        problem = f"must run from 0 to {sequences}, got first and last {ends}"
    elif (drops := np.flatnonzero(np.diff(boundaries) < 0)).size:
        problem = f"must not decrease, but entry {int(drops[0]) + 1} does"
    if problem:
        raise PlanningError(f"{path}: corrupt Megatron index: document boundaries {problem}")
