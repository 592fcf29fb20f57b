"""The built-in default corpus: the running interpreter's standard-library source files,
tokenized (byte-level unless another tokenizer is given); no download, on every machine.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .base import BYTE_TOKENIZER, DataError, Tokenizer
from .variable_length import VariableLengthDataset, tokenized_dataset, with_eod

# Standard-library directories that are not the library's own source (installed packages, test
# suites and their data), skipped so the corpus is ordinary code whatever is installed.
_STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library `.py` files, sorted, without installed
    packages and test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _STDLIB_SKIPPED_DIRS]
        found.extend(Path(directory, f) for f in files if f.endswith(".py"))
    return sorted(found)


def stdlib_texts(
    max_documents: int | None = None, max_bytes: int | None = None
) -> Iterator[tuple[Path, str]]:
    """(path, source text) of each standard-library file, in sorted path order.

    Files are taken until `max_documents` files or at least `max_bytes` bytes have been read.
    """
    taken_bytes = 0
    for number, path in enumerate(stdlib_files()):
        if number == max_documents or (max_bytes is not None and taken_bytes >= max_bytes):
            return
        data = path.read_bytes()
        taken_bytes += len(data)
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 ({error})") from None


def stdlib_documents(
    max_documents: int | None = None,
    max_bytes: int | None = None,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
) -> Iterator[np.ndarray]:
    """Tokens + EOD of each standard-library source file (see `stdlib_texts`)."""
    for _, text in stdlib_texts(max_documents, max_bytes):
        yield with_eod(tokenizer.encode(text), tokenizer.eod_id)


def stdlib_corpus(
    max_seqlen: int,
    *,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
    max_documents: int | None = None,
    max_bytes: int | None = None,
) -> VariableLengthDataset:
    """The built-in default corpus: the Python standard library's own source, tokenized
    (byte-level unless another tokenizer is given).

    Real, long-tailed documents (a few hundred bytes to several hundred kilobytes) that every
    machine already has. The corpus depends on the interpreter's version, and is deterministic
    for a given one. `max_documents`/`max_bytes` cap it (see `stdlib_texts`).
    """
    documents = list(stdlib_documents(max_documents, max_bytes, tokenizer))
    root = sysconfig.get_paths()["stdlib"]
    name = f"stdlib corpus {root} ({len(documents)} files, {tokenizer.name})"
    return tokenized_dataset(name, documents, max_seqlen, tokenizer)
