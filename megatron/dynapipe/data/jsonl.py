"""`.jsonl` datasets: one document per record, its "text" tokenized or its "input_ids" taken
as they are, streamed line by line; every bad line is reported with its file and line number.
`tools/preprocess_data.py` reads its records with the same functions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dynapipe_planner.input_files import json_loads, json_reason

from .base import BYTE_TOKENIZER, DataError, Tokenizer
from .variable_length import VariableLengthDataset, tokenized_dataset, with_eod

_JSONL_FIELDS = ("text", "input_ids")


def jsonl_records(path: str | os.PathLike[str]) -> Iterator[tuple[str, dict]]:
    """(where, record) of each non-blank line of a `.jsonl` file, streamed; `where` is
    "<path> line <n>", for messages."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            where = f"{path} line {number}"
            record = _parse_record(raw, where)
            if record is not None:
                yield where, record


def read_jsonl_documents(
    path: str | os.PathLike[str], tokenizer: Tokenizer = BYTE_TOKENIZER, field: str | None = None
) -> Iterator[np.ndarray]:
    """Tokens + EOD of each record of a `.jsonl` file, streamed line by line.

    `field` holds text (tokenized) or a list of token ids (taken as they are); by default the first
    record decides between "text" and "input_ids" and every record must have that field.
    """
    for where, record in jsonl_records(path):
        field = field or _default_field(record, where)
        yield with_eod(record_tokens(record, field, tokenizer, where), tokenizer.eod_id)


def _parse_record(raw: bytes, where: str) -> dict | None:
    """The JSON object on one line, or None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: not UTF-8 ({error})") from None
    if not line.strip():
        return None
    try:
        record = json_loads(line)
    except ValueError as error:  # malformed, nested too deeply, or a number out of range
        raise DataError(f"{where}: invalid JSON ({json_reason(error)}): {_excerpt(line)}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {_excerpt(line)}")
    return record


def _default_field(record: dict, where: str) -> str:
    field = next((key for key in _JSONL_FIELDS if key in record), None)
    if field is None:
        raise DataError(
            f"{where}: none of the fields {', '.join(_JSONL_FIELDS)} found "
            f"(fields: {', '.join(record)}); choose one with field="
        )
    return field


def record_tokens(record: dict, field: str, tokenizer: Tokenizer, where: str) -> np.ndarray:
    """The token ids of `record[field]`: text is tokenized, a list of ids taken as it is; every
    id must lie in the tokenizer's vocabulary. No EOD is added."""
    if field not in record:
        raise DataError(f"{where}: missing field {field!r} (fields: {', '.join(record)})")
    value = record[field]
    wanted = {"text": str, "input_ids": list}.get(field)
    if wanted is not None and not isinstance(value, wanted):
        kind = "a string" if wanted is str else "a flat list of integer token ids"
        raise DataError(
            f"{where}: field {field!r} must be {kind}, got {_excerpt(json.dumps(value))}"
        )
    if isinstance(value, str):
        try:
            ids = tokenizer.encode(value)
        except DataError as error:
            raise DataError(f"{where}: field {field!r}: {error}") from None
    elif isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        ids = value
    else:
        raise DataError(
            f"{where}: field {field!r} must be text or a list of token ids, "
            f"got {_excerpt(json.dumps(value))}"
        )
    outside = next((int(v) for v in ids if not 0 <= v < tokenizer.vocab_size), None)
    if outside is not None:
        raise DataError(
            f"{where}: field {field!r} has token id {outside} outside the vocabulary "
            f"[0, {tokenizer.vocab_size}) of the {tokenizer.name} tokenizer"
        )
    return np.asarray(ids, dtype=np.int64)


def _excerpt(text: str, limit: int = 80) -> str:
    text = text.rstrip("\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def jsonl_dataset(
    path: str | os.PathLike[str],
    max_seqlen: int,
    *,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
    field: str | None = None,
) -> VariableLengthDataset:
    """One document per `.jsonl` record (see `read_jsonl_documents`), held in memory."""
    documents = list(read_jsonl_documents(path, tokenizer, field))
    return tokenized_dataset(f"{path} ({len(documents)} records)", documents, max_seqlen, tokenizer)
