"""Variable-length samples cut from token documents: `VariableLengthDataset`, the document
stores it reads, and the check of every token id against the vocabulary.

DynaPipe plans every iteration over the real lengths of its samples (dynapipe.txt §3, §8.1), so
nothing here pads to a global maximum: a dataset tells the planner each sample's training length,
global batches close on a token budget (`sampler`), and each planned micro-batch is padded only
to its own `seqlen` (`microbatches`).

Conventions the executor relies on:

- Sample i holds n_i + 1 tokens and its *training length* is n_i: inputs are `tokens[:-1]`,
  labels `tokens[1:]` (next-token prediction; megatron's GPTDataset likewise reads seq_length + 1
  tokens). A document longer than `max_seqlen + 1` tokens is cut into chunks of at most
  `max_seqlen + 1` tokens that overlap by one token, so every label of the document is trained
  exactly once; chunks of fewer than 2 tokens (no label) are dropped.
- A Megatron indexed dataset's *sequences* are its documents, as in megatron's GPTDataset.
- Every token id is checked against the tokenizer's vocabulary when a dataset is opened (a
  `.bin` is scanned in chunks), so a dataset written with another tokenizer fails at start-up,
  naming the file and document, never mid-training.

Where the documents come from is `stdlib_corpus`, `jsonl`, `indexed` and `synthetic`; which
datasets Megatron's data flags (`--data-path` blends, `--split`, `--mock-data`) select is
`datasets`'s job. Everything stays on CPU; the executor moves tensors to its device.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .base import DataError, Tokenizer, TrainingSample

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

# The vocabulary check scans token arrays in pieces of this many ids (128 MiB of uint16); big
# `.bin` files have it report its progress (`indexed`).
_ID_CHECK_CHUNK = 1 << 26


# ---------------------------------------------------------------- vocabulary check


def check_token_ids(
    tokens: np.ndarray, starts: np.ndarray, vocab_size: int, name: str, *, progress: bool = False
) -> None:
    """Fail, naming `name` and the document, unless every id of `tokens` is in [0, vocab_size).

    `tokens` is a flat token array (a memory map works: it is scanned in chunks of
    `_ID_CHECK_CHUNK` ids, each compared in one vectorised pass) and `starts` the offset of each
    document in it. An unsigned dtype too narrow to hold an id >= vocab_size needs no scan.
    `progress` prints how far the scan has got to stderr, for files that take seconds.
    """
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{name}: holds {tokens.dtype} values, not integer token ids")
    limits = np.iinfo(tokens.dtype)
    if limits.min >= 0 and limits.max < vocab_size:
        return
    for begin in range(0, tokens.size, _ID_CHECK_CHUNK):
        chunk = tokens[begin : begin + _ID_CHECK_CHUNK]
        outside = chunk >= vocab_size
        if limits.min < 0:
            outside |= chunk < 0
        if outside.any():
            position = begin + int(np.argmax(outside))
            document = int(np.searchsorted(starts, position, side="right")) - 1
            raise DataError(
                f"{name}: document {document} has token id {int(tokens[position])} outside the "
                f"tokenizer's vocabulary [0, {vocab_size}) (written with another tokenizer?)"
            )
        if progress:
            done = min(begin + _ID_CHECK_CHUNK, tokens.size) / tokens.size
            print(f"{name}: token ids checked, {done:.0%}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- document stores


class _Documents(Protocol):
    """Token documents (each including its EOD) that samples are cut from."""

    def lengths(self) -> np.ndarray: ...

    def read(self, document: int, start: int, count: int) -> np.ndarray: ...


class _ArrayDocuments:
    """Documents held in memory as one flat array, in the smallest dtype the vocabulary fits;
    their ids are checked against the vocabulary first."""

    def __init__(self, documents: Sequence[np.ndarray], vocab_size: int, name: str) -> None:
        sizes = np.array([d.size for d in documents], dtype=np.int64)
        self._offsets = np.concatenate(([0], np.cumsum(sizes)))
        flat = np.concatenate(documents) if documents else np.zeros(0, np.int64)
        check_token_ids(flat, self._offsets[:-1], vocab_size, name)
        self._flat = flat.astype(np.uint16 if vocab_size <= 2**16 else np.int32)

    def lengths(self) -> np.ndarray:
        return np.diff(self._offsets)

    def read(self, document: int, start: int, count: int) -> np.ndarray:
        begin = self._offsets[document] + start
        return self._flat[begin : begin + count]


class MegatronDocuments:
    """The sequences of a megatron-core low-level dataset (an `IndexedDataset`, or the mock
    documents of `MockGPTLowLevelDataset`), read through its own `get`."""

    def __init__(self, dataset: IndexedDataset, lengths: np.ndarray) -> None:
        self._dataset = dataset
        self._lengths = lengths

    def lengths(self) -> np.ndarray:
        return self._lengths

    def read(self, document: int, start: int, count: int) -> np.ndarray:
        return self._dataset.get(document, offset=start, length=count)


class _DocumentRange:
    """Documents [begin, end) of another store, renumbered from 0."""

    def __init__(self, documents: _Documents, begin: int, end: int) -> None:
        self._documents = documents
        self._begin = begin
        self._lengths = documents.lengths()[begin:end]

    def lengths(self) -> np.ndarray:
        return self._lengths

    def read(self, document: int, start: int, count: int) -> np.ndarray:
        return self._documents.read(self._begin + document, start, count)


# ---------------------------------------------------------------- the dataset


class VariableLengthDataset:
    """Samples cut from token documents; see the module docstring for the conventions.

    Build one with `stdlib_corpus`, `jsonl_dataset`, `indexed_dataset`, `synthetic_dataset`,
    `mock_dataset` or `build_dataset`; `document_range` takes part of one (a `--split` share).
    """

    def __init__(
        self,
        name: str,
        documents: _Documents,
        max_seqlen: int,
        *,
        vocab_size: int,
        eod_id: int,
        pad_id: int,
    ) -> None:
        self.name = name
        self.max_seqlen = _positive_int(max_seqlen, "max_seqlen")
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self.pad_id = pad_id
        self._documents = documents
        self._document, self._start, self._count = _chunk(documents.lengths(), self.max_seqlen)
        if self._count.size == 0:
            raise DataError(f"{name}: no samples (no document has 2 or more tokens)")
        self._lengths = self._count - 1
        self._lengths.flags.writeable = False

    def __len__(self) -> int:
        return self._lengths.size

    def __repr__(self) -> str:
        return f"VariableLengthDataset({self.name}, {len(self)} samples)"

    @property
    def num_documents(self) -> int:
        return int(self._documents.lengths().size)

    def lengths(self) -> np.ndarray:
        """Training length of every sample (int64, read-only): what the planner gets."""
        return self._lengths

    def tokens(self, index: int) -> np.ndarray:
        """The n_i + 1 tokens (int64) of sample `index` (ids checked when the dataset opened)."""
        if not 0 <= index < len(self):
            raise DataError(f"{self.name}: no sample {index} (the dataset has {len(self)})")
        return self._documents.read(
            int(self._document[index]), int(self._start[index]), int(self._count[index])
        ).astype(np.int64)

    def training_sample(self, index: int) -> TrainingSample:
        """Sample `index` as a micro-batch takes it: each token predicts the next."""
        return TrainingSample.next_token(self.tokens(index))

    def document_range(self, begin: int, end: int) -> VariableLengthDataset:
        """The samples of documents [begin, end) only, documents renumbered from 0."""
        if not 0 <= begin <= end <= self.num_documents:
            raise DataError(
                f"{self.name}: no documents [{begin}, {end}) (it has {self.num_documents})"
            )
        return VariableLengthDataset(
            f"{self.name} documents [{begin}, {end})",
            _DocumentRange(self._documents, begin, end),
            self.max_seqlen,
            vocab_size=self.vocab_size,
            eod_id=self.eod_id,
            pad_id=self.pad_id,
        )


def in_memory_dataset(
    name: str,
    documents: Sequence[np.ndarray],
    max_seqlen: int,
    *,
    vocab_size: int,
    eod_id: int,
    pad_id: int,
) -> VariableLengthDataset:
    """A dataset over token documents already in memory (each ends with its EOD)."""
    return VariableLengthDataset(
        name,
        _ArrayDocuments(documents, vocab_size, name),
        max_seqlen,
        vocab_size=vocab_size,
        eod_id=eod_id,
        pad_id=pad_id,
    )


def tokenized_dataset(
    name: str, documents: Sequence[np.ndarray], max_seqlen: int, tokenizer: Tokenizer
) -> VariableLengthDataset:
    """`in_memory_dataset` with the vocabulary and special ids of `tokenizer`."""
    return in_memory_dataset(
        name,
        documents,
        max_seqlen,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod_id,
        pad_id=tokenizer.pad_id,
    )


def _chunk(lengths: np.ndarray, max_seqlen: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document, start, token count) of every sample: chunks of at most max_seqlen + 1 tokens
    that overlap by one, so chunk j starts at j * max_seqlen and has at least 2 tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    chunks = np.maximum((lengths + max_seqlen - 2) // max_seqlen, 0)
    document = np.repeat(np.arange(lengths.size), chunks)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    start = (np.arange(document.size) - first) * max_seqlen
    count = np.minimum(max_seqlen + 1, lengths[document] - start)
    return document, start, count


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise DataError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def with_eod(tokens: np.ndarray, eod_id: int) -> np.ndarray:
    """`tokens` (as int64) with the EOD id appended: one document."""
    return np.append(np.asarray(tokens, dtype=np.int64), eod_id)
