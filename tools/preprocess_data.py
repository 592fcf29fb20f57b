"""Turn a `.jsonl` file or the built-in standard-library corpus into a Megatron indexed dataset.

The output is the `<prefix>.bin` + `<prefix>.idx` pair that megatron-core's `IndexedDataset`
reads (written with its `IndexedDatasetBuilder`), so the same files serve megatron's own GPT
datasets and `megatron.dynapipe.data.indexed_dataset`. Documents are tokenized with the runtime's
byte-level tokenizer (one token per UTF-8 byte, EOD after each document, ids stored as uint16), so
no vocabulary file or download is needed; a record may also carry ready-made token ids. Whole
documents are stored: splitting to a maximum sequence length happens when the dataset is loaded.

Both files are written under temporary names and renamed only once complete, so an interrupted
or failed run leaves no half-written dataset behind.

    python tools/preprocess_data.py --input data.jsonl --output-prefix out/data [--json-key text]
    python tools/preprocess_data.py --input stdlib --output-prefix out/stdlib
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron.dynapipe.data import (
    BYTE_TOKENIZER,
    DataError,
    read_jsonl_documents,
    stdlib_documents,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", required=True, help='a .jsonl file, or "stdlib" for the built-in corpus'
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx"
    )
    parser.add_argument(
        "--json-key",
        default=None,
        help='.jsonl field with the text or token ids (default: "text", else "input_ids")',
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="accepted for Megatron command-line compatibility; byte tokenization is I/O-bound "
        "and runs in this process",
    )
    parser.add_argument(
        "--log-interval", type=int, default=1000, help="report progress every N documents"
    )
    parser.add_argument(
        "--max-documents", type=int, default=None, help="stop after N documents (default: all)"
    )
    args = parser.parse_args(argv)
    for name in ("workers", "log_interval", "max_documents"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def input_documents(source: str, json_key: str | None) -> Iterator[np.ndarray]:
    """Token documents (each ending in EOD) of the `--input`."""
    if source == "stdlib":
        return stdlib_documents()
    return read_jsonl_documents(source, BYTE_TOKENIZER, json_key)


def write_indexed_dataset(
    documents: Iterable[np.ndarray],
    output_prefix: str,
    *,
    max_documents: int | None = None,
    log_interval: int = 1000,
) -> tuple[int, int]:
    """Write `documents` as `<output_prefix>.bin/.idx`; returns (documents, tokens) written."""
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    temporary = {suffix: Path(f"{prefix}.{suffix}.tmp-{os.getpid()}") for suffix in ("bin", "idx")}
    builder = IndexedDatasetBuilder(
        str(temporary["bin"]), dtype=DType.optimal_dtype(BYTE_TOKENIZER.vocab_size)
    )
    try:
        counts = _add_documents(builder, documents, max_documents, log_interval)
        if counts[0] == 0:
            raise DataError(f"{output_prefix}: the input has no documents")
        builder.finalize(str(temporary["idx"]))
        os.replace(temporary["bin"], f"{prefix}.bin")
        os.replace(temporary["idx"], f"{prefix}.idx")  # last: the pair is complete from here on
    finally:
        builder.data_file.close()
        for path in temporary.values():
            path.unlink(missing_ok=True)
    return counts


def _add_documents(
    builder: IndexedDatasetBuilder,
    documents: Iterable[np.ndarray],
    max_documents: int | None,
    log_interval: int,
) -> tuple[int, int]:
    count = tokens = 0
    started = time.perf_counter()
    for document in documents:
        if count == max_documents:
            break
        # A numpy array, not the tensor the annotation names: the builder converts with
        # numpy.array(), which NumPy 2 warns about for tensors, once per document.
        builder.add_document(document, [document.size])
        count += 1
        tokens += document.size
        if count % log_interval == 0:
            rate = tokens / max(time.perf_counter() - started, 1e-9) / 1e6
            print(f"{count} documents, {tokens} tokens ({rate:.1f} M tokens/s)", file=sys.stderr)
    return count, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        count, tokens = write_indexed_dataset(
            input_documents(args.input, args.json_key),
            args.output_prefix,
            max_documents=args.max_documents,
            log_interval=args.log_interval,
        )
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_prefix}.bin/.idx: {count} documents, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
