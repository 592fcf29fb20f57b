"""Turn a `.jsonl` file, or the built-in standard-library corpus, into Megatron indexed datasets,
with upstream Megatron-LM's flags and output naming.

    python tools/preprocess_data.py --input data.jsonl --output-prefix out/data \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
    # writes out/data_text_document.bin + .idx; train with --data-path out/data_text_document

Every `--json-keys` key gets its own `<prefix>_<key>_document.bin/.idx` pair, written with
megatron-core's `IndexedDatasetBuilder`, so Megatron's own GPT datasets and
`megatron.dynapipe.data.indexed.indexed_dataset` read the same files. Each record is one
document (one sequence); cutting to the sequence length happens when a dataset is loaded. A
key may hold text or ready-made token ids. Without `--tokenizer-type` the runtime's byte-level
tokenizer is used (ids = UTF-8 bytes, EOD 256, vocabulary 258; no vocabulary file); the
tokenizer flags are Megatron's own.
`--input stdlib` takes the standard library's source files as documents with the one key "text".

Every token id is checked against the tokenizer's vocabulary, and an error names the input file
and line. Outputs are written under temporary names and renamed only once all are complete, so a
failed or interrupted run leaves none behind.

Upstream flags this tool cannot honour stop with one line saying why: `--split-sentences` (needs
NLTK's punkt model, a download) and `--partitions` above 1 (upstream cuts the input into files
processed apart; here one input is streamed in order and `--workers` tokenize it in parallel).
`--keep-newlines` and `--keep-sequential-samples` are honoured by construction: documents are
never split, and their order is always kept.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Importing megatron-core/megatron.training warns about optional GPU libraries, and torch about
# CUDA; none of that matters to tokenizing text.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.(core|training)")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.arguments import _add_tokenizer_args  # noqa: E402

from megatron.dynapipe.data.base import DataError, Tokenizer  # noqa: E402
from megatron.dynapipe.data.jsonl import jsonl_records, record_tokens  # noqa: E402
from megatron.dynapipe.data.stdlib_corpus import stdlib_texts  # noqa: E402
from megatron.dynapipe.data.tokenizer import build_tokenizer  # noqa: E402

_STDLIB_KEY = "text"
_WORKER_CHUNK = 16  # records per task sent to a worker


MAX_WORKERS = 1024


class _OneLineParser(argparse.ArgumentParser):
    """argparse reporting a bad flag on one line, without the (long) usage block."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _OneLineParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input", required=True, help='a .jsonl file (a JSON object per line), or "stdlib"'
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=[_STDLIB_KEY],
        help="record keys to extract, each written to its own output (default: text)",
    )
    group.add_argument(
        "--split-sentences", action="store_true", help="refused: needs NLTK's punkt (a download)"
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="accepted: documents are never split, so they always keep their newlines",
    )
    _add_tokenizer_args(parser)
    tokenizer_type = next(a for a in parser._actions if a.dest == "tokenizer_type")
    tokenizer_type.help = (
        "Megatron tokenizer type; without it, the byte-level tokenizer (UTF-8 bytes, EOD 256, "
        "vocabulary 258, no files)"
    )
    group = parser.add_argument_group("tokenization process")
    group.add_argument(
        "--append-eod", action="store_true", help="end every document with the EOD id"
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx per key"
    )
    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (default 1: this process)"
    )
    group.add_argument(
        "--partitions", type=int, default=1, help="must be 1: the input is streamed in order"
    )
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="accepted: the order of records is always kept",
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="report progress every N documents"
    )
    group.add_argument(
        "--max-documents", type=int, default=None, help="stop after N documents (default: all)"
    )
    args = parser.parse_args(argv)
    for name in ("workers", "partitions", "log_interval", "max_documents"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.workers > MAX_WORKERS:  # each is a process holding the tokenizer
        parser.error(f"--workers must be at most {MAX_WORKERS}, got {args.workers}")
    return args


def check_supported(args: argparse.Namespace) -> None:
    """Refuse, in one line, the upstream options this tool does not implement."""
    if args.split_sentences:
        raise DataError(
            "--split-sentences is not supported: it needs NLTK's punkt sentence model, a "
            "download; documents are stored whole"
        )
    if args.partitions != 1:
        raise DataError(
            f"--partitions {args.partitions} is not supported: the input is streamed in order in "
            "one pass; use --workers to tokenize in parallel"
        )
    if len(set(args.json_keys)) != len(args.json_keys):
        raise DataError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated")
    if args.input == "stdlib" and args.json_keys != [_STDLIB_KEY]:
        raise DataError(
            f"--json-keys {' '.join(args.json_keys)}: --input stdlib has one key, {_STDLIB_KEY}"
        )


def output_prefixes(output_prefix: str, keys: list[str]) -> list[str]:
    """Upstream's naming: one `<prefix>_<key>_document` dataset per key."""
    return [f"{output_prefix}_{key}_document" for key in keys]


def input_records(source: str) -> Iterator[tuple[str, dict]]:
    """(where, record) of each document of `--input`, `where` naming its file and line."""
    if source == "stdlib":
        return ((str(path), {_STDLIB_KEY: text}) for path, text in stdlib_texts())
    return jsonl_records(source)


@dataclass(frozen=True)
class RecordEncoder:
    """One record -> the token ids of each key (+ EOD when asked), ids checked."""

    tokenizer: Tokenizer
    keys: tuple[str, ...]
    append_eod: bool

    def __call__(self, item: tuple[str, dict]) -> list[np.ndarray]:
        where, record = item
        documents = [record_tokens(record, key, self.tokenizer, where) for key in self.keys]
        if self.append_eod:
            documents = [np.append(d, self.tokenizer.eod_id) for d in documents]
        return documents


# The encoder of a worker process: forked workers inherit it, so the tokenizer is never pickled.
_worker_encoder: RecordEncoder | None = None


def _install_encoder(encoder: RecordEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(item: tuple[str, dict]) -> list[np.ndarray]:
    assert _worker_encoder is not None, "worker started without an encoder"
    return _worker_encoder(item)


def encode_records(
    records: Iterable[tuple[str, dict]], encoder: RecordEncoder, workers: int
) -> Iterator[list[np.ndarray]]:
    """The encoded records in input order, by `workers` forked processes (or this one). The
    first failing record, in input order, raises its error here."""
    if workers == 1:
        yield from map(encoder, records)
        return
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=_install_encoder, initargs=(encoder,)) as pool:
        yield from pool.imap(_encode_in_worker, records, chunksize=_WORKER_CHUNK)


def write_indexed_datasets(
    documents: Iterable[list[np.ndarray]],
    prefixes: list[str],
    vocab_size: int,
    *,
    source: str,
    max_documents: int | None = None,
    log_interval: int = 1000,
) -> tuple[int, list[int]]:
    """Write the i-th array of every item of `documents` (read from `source`) to
    `prefixes[i]`.bin/.idx; returns (documents, tokens per output). Nothing is left behind
    unless every output is complete."""
    created = _make_parents(prefixes)
    temporary = [
        {suffix: Path(f"{prefix}.{suffix}.tmp-{os.getpid()}") for suffix in ("bin", "idx")}
        for prefix in prefixes
    ]
    dtype = DType.optimal_dtype(vocab_size)
    builders = [IndexedDatasetBuilder(str(paths["bin"]), dtype=dtype) for paths in temporary]
    complete = False
    try:
        count, tokens = _add_documents(builders, documents, max_documents, log_interval)
        if count == 0:
            raise DataError(f"{source}: no documents")
        for builder, paths in zip(builders, temporary, strict=True):
            builder.finalize(str(paths["idx"]))
        for prefix, paths in zip(prefixes, temporary, strict=True):
            os.replace(paths["bin"], f"{prefix}.bin")
            os.replace(paths["idx"], f"{prefix}.idx")  # last: the pair is complete from here on
        complete = True
    finally:
        for builder, paths in zip(builders, temporary, strict=True):
            builder.data_file.close()
            for path in paths.values():
                path.unlink(missing_ok=True)
        if not complete:
            for directory in reversed(created):
                with suppress(OSError):  # not empty: someone else writes there too
                    directory.rmdir()
    return count, tokens


def _make_parents(prefixes: list[str]) -> list[Path]:
    """Create the output directories; returns those created, outermost first. An output that
    exists and is not a regular file (a device, FIFO or directory) is refused first: the
    finished file is moved over it."""
    for prefix in prefixes:
        for path in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx")):
            if (path.exists() or path.is_symlink()) and not path.is_file():
                raise DataError(f"{path} exists and is not a regular file; not replacing it")
    created: list[Path] = []
    for prefix in prefixes:
        missing = [d for d in reversed(Path(prefix).parents) if not d.exists()]
        for directory in missing:
            directory.mkdir()
            created.append(directory)
    return created


def _add_documents(
    builders: list[IndexedDatasetBuilder],
    documents: Iterable[list[np.ndarray]],
    max_documents: int | None,
    log_interval: int,
) -> tuple[int, list[int]]:
    count, tokens = 0, [0] * len(builders)
    started = time.perf_counter()
    with closing(iter(documents)) as stream:
        for encoded in stream:
            for index, (builder, document) in enumerate(zip(builders, encoded, strict=True)):
                # A numpy array, not the tensor the annotation names: the builder converts with
                # numpy.array(), which NumPy 2 warns about for tensors, once per document.
                builder.add_document(document, [document.size])
                tokens[index] += document.size
            count += 1
            if count % log_interval == 0:
                rate = sum(tokens) / max(time.perf_counter() - started, 1e-9) / 1e6
                print(
                    f"{count} documents, {sum(tokens)} tokens ({rate:.2f} M tokens/s)",
                    file=sys.stderr,
                )
            if count == max_documents:
                break
    return count, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prefixes = output_prefixes(args.output_prefix, args.json_keys)
    try:
        check_supported(args)
        tokenizer = build_tokenizer(args)
        encoder = RecordEncoder(tokenizer, tuple(args.json_keys), args.append_eod)
        count, tokens = write_indexed_datasets(
            encode_records(input_records(args.input), encoder, args.workers),
            prefixes,
            tokenizer.vocab_size,
            source=args.input,
            max_documents=args.max_documents,
            log_interval=args.log_interval,
        )
    except DataError as error:  # the input's fault: one line, as a bad flag
        print(f"preprocess_data.py: error: {error}", file=sys.stderr)
        return 2
    for prefix, written in zip(prefixes, tokens, strict=True):
        print(f"wrote {prefix}.bin/.idx: {count} documents, {written} tokens ({tokenizer.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
