"""Megatron indexed datasets (`<prefix>.bin` + `<prefix>.idx`) as variable-length samples,
memory-mapped through megatron-core's `IndexedDataset`, checked (index, size, token ids) before
training starts.

megatron.core is imported inside the functions that use it: importing it pulls in its
schedules and triton (seconds), and only indexed and mock datasets need it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dynapipe_planner.data import load_lengths
from dynapipe_planner.errors import PlanningError

from .base import DataError, Tokenizer
from .variable_length import MegatronDocuments, VariableLengthDataset, check_token_ids

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

# Megatron's .idx header: 9-byte magic, 8-byte version, then the token dtype code.
_IDX_DTYPE_CODE_OFFSET = 17
# Files of at least this many bytes report the vocabulary check's progress.
_ID_CHECK_PROGRESS_BYTES = 1 << 30


def indexed_dataset(
    path_prefix: str | os.PathLike[str], max_seqlen: int, *, tokenizer: Tokenizer
) -> VariableLengthDataset:
    """A Megatron indexed dataset (`<prefix>.bin` + `<prefix>.idx`; either file name works too),
    memory-mapped through megatron-core's `IndexedDataset`, its ids from `tokenizer`.

    megatron-core validates an index only with asserts and reads the `.bin` lazily, so the index
    layout is checked first (by the planner's reader, which names the problem), the `.bin` size
    against it, and every token id against the tokenizer's vocabulary: a damaged file, or one
    written with another tokenizer, fails here, with its path, not mid-training.
    """
    prefix = _strip_suffix(str(path_prefix))
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise DataError(f"{path}: no such file (Megatron indexed dataset {prefix})")
    try:
        lengths = load_lengths(idx_path)
    except PlanningError as error:
        raise DataError(str(error)) from None
    dtype = _check_bin_size(idx_path, bin_path, lengths)
    if lengths.sum() > 0:
        check_token_ids(
            np.memmap(bin_path, dtype=dtype, mode="r"),
            np.cumsum(lengths) - lengths,
            tokenizer.vocab_size,
            str(bin_path),
            progress=bin_path.stat().st_size >= _ID_CHECK_PROGRESS_BYTES,
        )
    return VariableLengthDataset(
        f"{prefix}.bin/.idx ({lengths.size} sequences)",
        MegatronDocuments(_open_megatron(prefix), lengths),
        max_seqlen,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod_id,
        pad_id=tokenizer.pad_id,
    )


def _strip_suffix(path: str) -> str:
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def _check_bin_size(idx_path: Path, bin_path: Path, lengths: np.ndarray) -> type[np.number]:
    """The `.bin` holds exactly the tokens its (already validated) index describes; returns
    the token dtype."""
    from megatron.core.datasets.indexed_dataset import DType

    dtype_code = int(np.fromfile(idx_path, np.uint8, count=1, offset=_IDX_DTYPE_CODE_OFFSET)[0])
    expected = int(lengths.sum()) * DType.size(dtype_code)
    size = bin_path.stat().st_size
    if size != expected:
        raise DataError(
            f"{bin_path}: corrupt Megatron data file: {size} bytes, but its index describes "
            f"{lengths.size} sequences of {expected} bytes"
        )
    return DType.dtype_from_code(dtype_code)


def _open_megatron(prefix: str) -> IndexedDataset:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        return IndexedDataset(prefix, mmap=True)
    except (AssertionError, ValueError, OSError, IndexError) as error:
        raise DataError(
            f"{prefix}.idx/.bin: unreadable Megatron indexed dataset: {error}"
        ) from None
