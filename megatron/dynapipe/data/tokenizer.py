"""The runtime's tokenizer from Megatron's tokenizer flags: the built-in byte tokenizer when no
`--tokenizer-type` is given, otherwise megatron-core's own tokenizer
(`megatron.core.tokenizers.utils.build_tokenizer.build_tokenizer`), seen through the small
`megatron.dynapipe.data.base.Tokenizer` protocol the datasets use.

Nothing is ever downloaded. megatron-core fetches what a flag leaves out (GPT-2's vocabulary
and merges from S3) or names a Hub repository instead of a path (its GPT2BPETokenizer loads the
Hub's "gpt2" configuration even when both files are given, a minute-long hang without a
network), so:

- every file a tokenizer type needs is checked first, and a missing or unreadable one is
  reported as one line naming the flag and the path;
- GPT2BPETokenizer is built by megatron-core's HuggingFace route from a local tokenizer
  directory that names the GPT-2 tokenizer class and takes `--vocab-file`/`--merge-file`,
  which is the tokenizer megatron-core's GPT2BPETokenizer constructs, minus the Hub lookup;
- HuggingFaceTokenizer takes a local directory only (a Hub name would be a download).

megatron-core's `build_tokenizer` also sets `args.padded_vocab_size` (the vocabulary rounded up
to `--make-vocab-size-divisible-by` x TP) when it is unset. The runtime pads the vocabulary
itself (`model.padded_vocab_size`, for every TP layout a job may switch to), so the tokenizer
is built from a copy of the flags and `args` is left unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .base import BYTE_TOKENIZER, DataError, Tokenizer

# The Megatron tokenizer types the runtime builds, and the flag naming each one's files.
_FILE_FLAGS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "NullTokenizer": (),
}
SUPPORTED_TOKENIZER_TYPES = tuple(_FILE_FLAGS)
_DIRECTORY_FLAGS = {"HuggingFaceTokenizer": "tokenizer_model"}
_PATH_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")
# Flags that only mean something with a --tokenizer-type; given alone they would be ignored.
_TYPED_FLAGS = ("vocab_file", "merge_file", "tokenizer_model", "vocab_size")
# megatron-core's GPT2BPETokenizer is HuggingFace's GPT-2 tokenizer over the given files.
_GPT2_TOKENIZER_CONFIG = {"tokenizer_class": "GPT2Tokenizer"}
_HF_WRAPPER_PREFIX = "Unable to instantiate HuggingFace AutoTokenizer"


class TokenizerError(DataError):
    """Tokenizer flags that cannot be honoured; the message names the flag (and path)."""


@dataclass(frozen=True)
class MegatronTokenizer:
    """A megatron-core text tokenizer as the datasets see it.

    `pad_id` is the tokenizer's own pad id when it has one inside the vocabulary, else its EOD:
    GPT-2 BPE, SentencePiece models trained without a pad piece and NullTokenizer have none
    (megatron-core answers None or -1). Any in-vocabulary id would do, because padding
    positions carry no loss and attend only to each other (`microbatches.microbatch_tensors`);
    EOD is the one special id every usable tokenizer has.
    """

    name: str
    vocab_size: int
    eod_id: int
    pad_id: int
    megatron: Any  # megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.asarray(self.megatron.tokenize(text), dtype=np.int64)
        except (ValueError, TypeError) as error:  # e.g. NullTokenizer given words, not ids
            raise TokenizerError(f"the {self.name} tokenizer cannot encode it: {error}") from None


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer Megatron's flags select (`args` from Megatron's parser, or any namespace
    with the attributes of its tokenizer group); raises `TokenizerError` naming the flag."""
    kind = args.tokenizer_type
    if kind is None:
        given = [_flag(name) for name in _TYPED_FLAGS if getattr(args, name, None) is not None]
        if given:
            raise TokenizerError(
                f"{', '.join(given)} given without --tokenizer-type (the built-in byte-level "
                "tokenizer takes none of them); add --tokenizer-type"
            )
        return BYTE_TOKENIZER
    if kind not in _FILE_FLAGS:
        raise TokenizerError(
            f"--tokenizer-type {kind}: not supported by this runtime "
            f"(supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}; none gives the byte tokenizer)"
        )
    if getattr(args, "metadata_path", None) is not None:
        raise TokenizerError(
            f"--tokenizer-metadata {args.metadata_path}: not supported (it can select a "
            "tokenizer library that downloads); --tokenizer-type selects the library"
        )
    _check_files(args, kind)
    if kind == "NullTokenizer" and (args.vocab_size is None or args.vocab_size < 2):
        raise TokenizerError(
            f"--tokenizer-type NullTokenizer needs --vocab-size of at least 2 (EOD is its last "
            f"id), got {args.vocab_size}"
        )
    return _adapt(_build_megatron(args, kind), _describe(args, kind))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_files(args: argparse.Namespace, kind: str) -> None:
    """Every file the tokenizer type needs is given, and every file flag given is readable,
    before megatron-core would fall back to a download."""
    for name in _FILE_FLAGS[kind]:
        if getattr(args, name, None) is None:
            raise TokenizerError(
                f"--tokenizer-type {kind} needs {_flag(name)} (a local file; nothing is downloaded)"
            )
    for name in _PATH_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        path = Path(value)
        wants_directory = _DIRECTORY_FLAGS.get(kind) == name
        exists = path.is_dir() if wants_directory else path.is_file()
        if not exists:
            what = "directory" if wants_directory else "file"
            raise TokenizerError(f"{_flag(name)} {value}: no such {what} (nothing is downloaded)")
        if not os.access(path, os.R_OK | (os.X_OK if wants_directory else 0)):
            raise TokenizerError(f"{_flag(name)} {value}: not readable")


def _build_megatron(args: argparse.Namespace, kind: str) -> Any:
    """megatron-core's tokenizer for a copy of `args` (see the module docstring)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

    flags = argparse.Namespace(**vars(args))
    flags.pad_vocab_size = False
    try:
        if kind != "GPT2BPETokenizer":
            return megatron_build(flags)
        with tempfile.TemporaryDirectory(prefix="gpt2-bpe-") as directory:
            Path(directory, "tokenizer_config.json").write_text(json.dumps(_GPT2_TOKENIZER_CONFIG))
            flags.tokenizer_type, flags.tokenizer_model = "HuggingFaceTokenizer", directory
            return megatron_build(flags)
    except Exception as error:  # megatron-core and its libraries raise many kinds
        files = ", ".join(f"{_flag(n)} {getattr(args, n)}" for n in _FILE_FLAGS[kind])
        raise TokenizerError(
            f"--tokenizer-type {kind} ({files or f'--vocab-size {args.vocab_size}'}): cannot be "
            f"loaded: {_one_line(error)}"
        ) from None


def _one_line(error: Exception, limit: int = 300) -> str:
    """The cause on one line; megatron-core's HuggingFace wrapper prefixes the library's own
    message with the (here temporary) directory it loaded."""
    text = str(error) or type(error).__name__
    if text.startswith(_HF_WRAPPER_PREFIX):
        text = text.split("Exception: ", 1)[-1]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(args: argparse.Namespace, kind: str) -> str:
    files = [Path(getattr(args, name)).name for name in _FILE_FLAGS[kind]]
    return f"{kind} ({', '.join(files)})" if files else f"{kind} ({args.vocab_size} ids)"


def _adapt(megatron: Any, name: str) -> MegatronTokenizer:
    vocab_size = int(megatron.vocab_size)
    eod = _special_id(megatron, "eod", vocab_size)
    if eod is None:
        raise TokenizerError(f"{name}: the tokenizer has no end-of-document (EOS) token")
    pad = _special_id(megatron, "pad", vocab_size)
    return MegatronTokenizer(
        name=name,
        vocab_size=vocab_size,
        eod_id=eod,
        pad_id=eod if pad is None else pad,
        megatron=megatron,
    )


def _special_id(megatron: Any, attribute: str, vocab_size: int) -> int | None:
    """The tokenizer's `eod`/`pad` id, or None where it has none (None, -1, or no such id)."""
    try:
        value = getattr(megatron, attribute)
    except (AttributeError, NameError, KeyError):
        return None
    if isinstance(value, int | np.integer) and 0 <= value < vocab_size:
        return int(value)
    return None
