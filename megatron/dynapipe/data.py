"""Training data for the runtime: variable-length samples, token-budget global batches, and the
tensors of each micro-batch a plan asks for.

DynaPipe plans every iteration over the real lengths of its samples (dynapipe.txt §3, §8.1), so
nothing here pads to a global maximum: a dataset tells the planner each sample's training length,
global batches close on a token budget (`dynapipe_planner.data.global_batches`), and each planned
micro-batch is padded only to its own `seqlen`. Packed rows (several samples in one row) are kept
apart by block-diagonal causal attention masks and per-sample position ids, because megatron-core's
local attention, the one that runs on CPU, cannot take packed THD sequences.

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
- The built-in tokenizer is byte-level: token = UTF-8 byte value 0..255, EOD = 256 (appended to
  every document), pad = 257, vocabulary 258. It needs no vocabulary file and no download.
  Megatron's tokenizers come from `megatron.dynapipe.tokenizer.build_tokenizer`.
- `attention_mask` follows megatron-core: True means masked out.

Which datasets Megatron's data flags (`--data-path` blends, `--split`, `--mock-data`) select is
`megatron.dynapipe.datasets`'s job; this module builds each one. Everything stays on CPU; the
executor moves tensors to its device.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from dynapipe_planner.data import global_batches, load_lengths, sample_batches, sample_lengths
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.plan import ExecutionPlan, MicroBatch

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

BYTE_VOCAB_SIZE = 258
BYTE_EOD = 256
BYTE_PAD = 257

# Standard-library directories that are not the library's own source (installed packages, test
# suites and their data), skipped so the corpus is ordinary code whatever is installed.
_STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_JSONL_FIELDS = ("text", "input_ids")
# Megatron's .idx header: 9-byte magic, 8-byte version, then the token dtype code.
_IDX_DTYPE_CODE_OFFSET = 17
# The vocabulary check scans token arrays in pieces of this many ids (128 MiB of uint16), and
# reports its progress on files of at least _ID_CHECK_PROGRESS_BYTES.
_ID_CHECK_CHUNK = 1 << 26
_ID_CHECK_PROGRESS_BYTES = 1 << 30


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file (and line or sample)."""


class Tokenizer(Protocol):
    """What the datasets need of a tokenizer: text to ids, the special ids, and a name for
    messages. `megatron.dynapipe.tokenizer.build_tokenizer` makes one from Megatron's flags."""

    name: str
    vocab_size: int
    eod_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """One token per UTF-8 byte (0..255), with EOD and pad ids above the byte range."""

    name: str = "byte-level"
    vocab_size: int = BYTE_VOCAB_SIZE
    eod_id: int = BYTE_EOD
    pad_id: int = BYTE_PAD

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


BYTE_TOKENIZER = ByteTokenizer()


class SampleDataset(Protocol):
    """What the planner and the executor read of a dataset: each sample's training length, and
    its tokens when a micro-batch is built. `VariableLengthDataset` offers it, and so does a
    blend of several (`megatron.dynapipe.datasets.BlendedSamples`)."""

    name: str
    max_seqlen: int
    vocab_size: int
    eod_id: int
    pad_id: int

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray: ...

    def tokens(self, index: int) -> np.ndarray: ...


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


class _MegatronDocuments:
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


def _tokenized_dataset(
    name: str, documents: Sequence[np.ndarray], max_seqlen: int, tokenizer: Tokenizer
) -> VariableLengthDataset:
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


def _with_eod(tokens: np.ndarray, eod_id: int) -> np.ndarray:
    return np.append(np.asarray(tokens, dtype=np.int64), eod_id)


# ---------------------------------------------------------------- built-in corpus


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
        yield _with_eod(tokenizer.encode(text), tokenizer.eod_id)


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
    return _tokenized_dataset(name, documents, max_seqlen, tokenizer)


# ---------------------------------------------------------------- jsonl


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
        yield _with_eod(record_tokens(record, field, tokenizer, where), tokenizer.eod_id)


def _parse_record(raw: bytes, where: str) -> dict | None:
    """The JSON object on one line, or None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: not UTF-8 ({error})") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: invalid JSON ({error.msg}): {_excerpt(line)}") from None
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
    return _tokenized_dataset(
        f"{path} ({len(documents)} records)", documents, max_seqlen, tokenizer
    )


# ---------------------------------------------------------------- Megatron .bin/.idx
# megatron.core is imported inside the functions that use it: importing it pulls in its
# schedules and triton (seconds), and only indexed and mock datasets need it.


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
        _MegatronDocuments(_open_megatron(prefix), lengths),
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


# ---------------------------------------------------------------- synthetic and mock


def synthetic_dataset(
    preset: str,
    num_samples: int,
    max_seqlen: int,
    *,
    seed: int = 0,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
) -> VariableLengthDataset:
    """SYNTHETIC samples for benchmarks: lengths from a `dynapipe_planner.data` preset ("flan",
    "webcode", "lognormal") truncated to `max_seqlen`, seeded random tokens.

    Token ids are drawn uniformly from the tokenizer's vocabulary without its EOD and pad ids,
    and EOD ends every sample (with the byte tokenizer: ids 0..255, EOD 256).
    """
    specials = sorted({tokenizer.eod_id, tokenizer.pad_id})
    ordinary = tokenizer.vocab_size - len(specials)
    if ordinary < 1:
        raise DataError(f"synthetic dataset: the {tokenizer.name} vocabulary has no ordinary ids")
    try:
        lengths = sample_lengths(preset, num_samples, seed=seed, max_seqlen=max_seqlen)
    except PlanningError as error:
        raise DataError(f"synthetic dataset: {error}") from None
    ends = np.cumsum(lengths + 1)
    rng = np.random.default_rng([seed, 1])
    flat = rng.integers(0, ordinary, size=int(ends[-1]), dtype=np.int64)
    for special in specials:  # ascending, so each shift steps over exactly one special id
        flat += flat >= special
    flat[ends - 1] = tokenizer.eod_id
    return _tokenized_dataset(
        f"synthetic:{preset} ({num_samples} samples, seed {seed}, SYNTHETIC)",
        np.split(flat, ends[:-1]),
        max_seqlen,
        tokenizer,
    )


def mock_dataset(
    max_seqlen: int, *, tokenizer: Tokenizer = BYTE_TOKENIZER
) -> VariableLengthDataset:
    """Megatron's `--mock-data` documents as variable-length samples: megatron-core's
    `MockGPTLowLevelDataset` (a fixed 100,000 documents of 1 to 4,095 tokens drawn with its own
    seed, ids counting up from 1 modulo the vocabulary, EOD last), generated when read."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    # It asks its tokenizer for `vocab_size` and `eod` only.
    mock = MockGPTLowLevelDataset(
        SimpleNamespace(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod_id)
    )
    lengths = np.asarray(mock.sequence_lengths, dtype=np.int64)
    return VariableLengthDataset(
        f"mock GPT documents ({lengths.size}, megatron-core MockGPTLowLevelDataset, SYNTHETIC)",
        _MegatronDocuments(mock, lengths),
        max_seqlen,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod_id,
        pad_id=tokenizer.pad_id,
    )


# ---------------------------------------------------------------- factory


def build_dataset(
    data_path: str | None,
    max_seqlen: int,
    *,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
    seed: int = 0,
    num_samples: int = 4096,
) -> VariableLengthDataset:
    """The dataset one `--data-path` entry names, its ids from `tokenizer`.

    None or "stdlib": the built-in corpus; "synthetic:<preset>": `num_samples` SYNTHETIC samples
    drawn with `seed`; a path ending in `.jsonl`: that file ("text" or "input_ids" records);
    anything else: a Megatron `.bin/.idx` prefix.
    """
    if data_path is None or data_path == "stdlib":
        return stdlib_corpus(max_seqlen, tokenizer=tokenizer)
    if data_path.startswith("synthetic:"):
        preset = data_path.removeprefix("synthetic:")
        return synthetic_dataset(preset, num_samples, max_seqlen, seed=seed, tokenizer=tokenizer)
    if data_path.endswith(".jsonl"):
        return jsonl_dataset(data_path, max_seqlen, tokenizer=tokenizer)
    return indexed_dataset(data_path, max_seqlen, tokenizer=tokenizer)


# ---------------------------------------------------------------- global batches


class GlobalBatchSampler:
    """Endless global batches: yields (iteration, sample indices), epoch after epoch.

    A batch is a budget of `tokens_per_batch` tokens (DynaPipe's) or exactly
    `samples_per_batch` samples (Megatron's `--global-batch-size`); each epoch is
    `dynapipe_planner.data.global_batches` or `sample_batches` over (seed, epoch), so the order
    depends only on the seed; `state_dict()` records the place, and a sampler that loads it
    continues with exactly the batches the original would have produced.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        tokens_per_batch: int | None = None,
        seed: int = 0,
        *,
        samples_per_batch: int | None = None,
    ) -> None:
        if (tokens_per_batch is None) == (samples_per_batch is None):
            raise DataError("a global batch is either tokens_per_batch or samples_per_batch")
        self._lengths = np.asarray(lengths)
        self._tokens_per_batch = tokens_per_batch or 0
        self._samples_per_batch = samples_per_batch or 0
        self._seed = seed
        self._iteration = 0
        self._seek(epoch=0, position=0)

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def __next__(self) -> tuple[int, np.ndarray]:
        if self._position == len(self._batches):
            self._seek(self._epoch + 1, 0)
        batch = self._batches[self._position]
        self._position += 1
        self._iteration += 1
        return self._iteration - 1, batch

    def state_dict(self) -> dict[str, int]:
        """The place in the data order, plus what the order depends on (checked on load)."""
        return {
            "iteration": self._iteration,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "tokens_per_batch": self._tokens_per_batch,
            "samples_per_batch": self._samples_per_batch,
            "num_samples": int(self._lengths.shape[0]),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`; refuse one taken over other data or settings."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise DataError(f"sampler state lacks {', '.join(missing)}")
        for key in ("seed", "tokens_per_batch", "samples_per_batch", "num_samples"):
            if state[key] != expected[key]:
                raise DataError(
                    f"sampler state was saved with {key}={state[key]}, this run has "
                    f"{expected[key]}; resuming would change the data order"
                )
        self._seek(int(state["epoch"]), int(state["position"]))
        if self._position > len(self._batches):
            raise DataError(
                f"sampler state position {self._position} is past the "
                f"{len(self._batches)} batches of epoch {self._epoch}"
            )
        self._iteration = int(state["iteration"])

    def _seek(self, epoch: int, position: int) -> None:
        self._epoch, self._position = epoch, position
        if self._samples_per_batch:
            batches = sample_batches(
                self._lengths, self._samples_per_batch, seed=self._seed, epoch=epoch
            )
        else:
            batches = global_batches(
                self._lengths, self._tokens_per_batch, seed=self._seed, epoch=epoch
            )
        self._batches = list(batches)


# ---------------------------------------------------------------- micro-batch tensors


@dataclass
class MicroBatchTensors:
    """The inputs of one planned micro-batch, shape [b, s] with b = rows and s = its seqlen.

    `position_ids` restart at 0 for every sample; the padding at a row's end counts as one more
    sample (positions 0, 1, ... and causal attention among padding positions only), so no query
    row of the attention mask is fully masked. `loss_mask` is 1.0 exactly on real labels, and
    `num_tokens` counts them.
    """

    tokens: torch.Tensor  # int64 [b, s]
    labels: torch.Tensor  # int64 [b, s]; pad_id on padding
    loss_mask: torch.Tensor  # float32 [b, s]
    position_ids: torch.Tensor  # int64 [b, s]
    attention_mask: torch.Tensor  # bool [b, 1, s, s], True = masked out
    num_tokens: int

    def to(self, device: torch.device | str) -> MicroBatchTensors:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "num_tokens"
        }
        return MicroBatchTensors(**moved, num_tokens=self.num_tokens)

    def megatron_batch(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The dict a Megatron-LM `get_batch` returns (and its `forward_step` indexes), on
        `device`."""
        return {
            "tokens": self.tokens.to(device),
            "labels": self.labels.to(device),
            "loss_mask": self.loss_mask.to(device),
            "attention_mask": self.attention_mask.to(device),
            "position_ids": self.position_ids.to(device),
        }


def _checked_rows(mb: MicroBatch, dataset: SampleDataset) -> list[list[int]]:
    """The sample ids of each row of `mb`, after checking that they exist and fit."""
    if mb.tgt_seqlen:
        raise DataError(f"micro-batch {mb.id}: encoder-decoder micro-batches are not supported")
    rows = _rows(mb)
    _check_fits(mb, rows, dataset.lengths())
    return rows


def microbatch_tensors(mb: MicroBatch, dataset: SampleDataset) -> MicroBatchTensors:
    """Tensors of plan micro-batch `mb`: one sample per row, or packed rows per `mb.row_sizes`."""
    rows = _checked_rows(mb, dataset)
    shape = (len(rows), mb.seqlen)
    tokens = np.full(shape, dataset.pad_id, dtype=np.int64)
    labels = np.full(shape, dataset.pad_id, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    segments = np.zeros(shape, dtype=np.int64)
    real = np.zeros(shape, dtype=bool)
    for row, samples in enumerate(rows):
        cursor = 0
        for segment, sample in enumerate(samples):
            sample_tokens = dataset.tokens(sample)
            span = slice(cursor, cursor + sample_tokens.size - 1)
            tokens[row, span] = sample_tokens[:-1]
            labels[row, span] = sample_tokens[1:]
            position_ids[row, span] = np.arange(span.stop - span.start)
            segments[row, span] = segment
            cursor = span.stop
        real[row, :cursor] = True
        position_ids[row, cursor:] = np.arange(mb.seqlen - cursor)
        segments[row, cursor:] = len(samples)
    return MicroBatchTensors(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(real.astype(np.float32)),
        position_ids=torch.from_numpy(position_ids),
        attention_mask=_block_causal_mask(torch.from_numpy(segments)),
        num_tokens=int(real.sum()),
    )


def with_empty_rows(batch: MicroBatchTensors, num_rows: int, pad_id: int) -> MicroBatchTensors:
    """`batch` topped up to `num_rows` rows with rows of padding only (no label, no loss).

    Fixed-shape schedules (megatron-core's) need every micro-batch to have the same number of
    rows; the last packed micro-batch of a global batch may have fewer. A filler row follows the
    padding convention above (positions 0, 1, ..., causal attention among its own positions).
    """
    missing = num_rows - batch.tokens.shape[0]
    if missing < 0:
        raise DataError(f"micro-batch has {batch.tokens.shape[0]} rows, more than {num_rows}")
    if missing == 0:
        return batch
    seqlen = batch.tokens.shape[1]
    padding = torch.full((missing, seqlen), pad_id, dtype=torch.int64)
    filler = MicroBatchTensors(
        tokens=padding,
        labels=padding,
        loss_mask=torch.zeros(missing, seqlen, dtype=torch.float32),
        position_ids=torch.arange(seqlen).expand(missing, seqlen),
        attention_mask=_block_causal_mask(torch.zeros(missing, seqlen, dtype=torch.int64)),
        num_tokens=0,
    )
    joined = {
        f.name: torch.cat([getattr(batch, f.name), getattr(filler, f.name)])
        for f in fields(batch)
        if f.name != "num_tokens"
    }
    return MicroBatchTensors(**joined, num_tokens=batch.num_tokens)


class RankMicroBatches(Mapping[int, MicroBatchTensors]):
    """The micro-batches of one pipeline by id, checked at once but built when read and not kept.

    The executor reads a micro-batch at its forward pass; autograd then keeps what the backward
    needs (the [b, 1, s, s] attention mask among it) until that backward. Building every
    micro-batch up front would hold all their masks for the whole iteration, memory the plan
    never priced (seed `dynapipe.txt` §3: the executor loads each micro-batch by instruction).
    """

    def __init__(self, microbatches: Sequence[MicroBatch], dataset: SampleDataset) -> None:
        for mb in microbatches:
            _checked_rows(mb, dataset)  # a bad plan fails before any rank starts running it
        self._microbatches = {mb.id: mb for mb in microbatches}
        self._dataset = dataset

    def __getitem__(self, mb_id: int) -> MicroBatchTensors:
        return microbatch_tensors(self._microbatches[mb_id], self._dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(self._microbatches)

    def __len__(self) -> int:
        return len(self._microbatches)


def rank_microbatches(
    plan: ExecutionPlan, replica: int, dataset: SampleDataset
) -> RankMicroBatches:
    """The micro-batches of pipeline `replica`, by micro-batch id (built when read)."""
    return RankMicroBatches([mb for mb in plan.microbatches if mb.replica == replica], dataset)


def _block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s], True = masked: position i sees j <= i of its own segment only."""
    seqlen = segments.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    same_segment = segments[:, :, None] == segments[:, None, :]
    return ~(same_segment & causal).unsqueeze(1)


def _rows(mb: MicroBatch) -> list[list[int]]:
    """The sample ids of each tensor row."""
    if not mb.samples:
        raise DataError(f"micro-batch {mb.id}: no samples")
    if mb.seqlen < 1:
        raise DataError(f"micro-batch {mb.id}: seqlen must be positive, got {mb.seqlen}")
    sizes = mb.row_sizes or [1] * len(mb.samples)
    if min(sizes) < 1 or sum(sizes) != len(mb.samples):
        raise DataError(
            f"micro-batch {mb.id}: row_sizes {mb.row_sizes} must be positive and sum to its "
            f"{len(mb.samples)} samples"
        )
    bounds = np.cumsum([0, *sizes]).tolist()
    return [list(mb.samples[a:b]) for a, b in pairwise(bounds)]


def _check_fits(mb: MicroBatch, rows: list[list[int]], lengths: np.ndarray) -> None:
    """Every sample exists and fits the micro-batch's seqlen, alone and with its row."""
    for row, samples in enumerate(rows):
        for sample in samples:
            if not 0 <= sample < lengths.size:
                raise DataError(
                    f"micro-batch {mb.id}: sample {sample} is not in the dataset "
                    f"({lengths.size} samples)"
                )
            if lengths[sample] > mb.seqlen:
                raise DataError(
                    f"micro-batch {mb.id}: sample {sample} has training length "
                    f"{int(lengths[sample])} > the micro-batch seqlen {mb.seqlen}"
                )
        total = int(lengths[samples].sum())
        if total > mb.seqlen:
            raise DataError(
                f"micro-batch {mb.id}: packed row {row} (samples {samples}) holds {total} "
                f"tokens > the micro-batch seqlen {mb.seqlen}"
            )
