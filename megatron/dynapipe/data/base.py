"""What the runtime's data modules share: the `DataError` they raise, the `Tokenizer` and
`SampleDataset` protocols, the `TrainingSample` a micro-batch is built from, and the built-in
byte tokenizer.

The built-in tokenizer is byte-level: token = UTF-8 byte value 0..255, EOD = 256 (appended to
every document), pad = 257, vocabulary 258. It needs no vocabulary file and no download.
Megatron's tokenizers come from `megatron.dynapipe.data.tokenizer.build_tokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

BYTE_VOCAB_SIZE = 258
BYTE_EOD = 256
BYTE_PAD = 257


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file (and line or sample)."""


class Tokenizer(Protocol):
    """What the datasets need of a tokenizer: text to ids, the special ids, and a name for
    messages. `megatron.dynapipe.data.tokenizer.build_tokenizer` makes one from Megatron's flags."""

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


@dataclass(frozen=True)
class TrainingSample:
    """What one sample of n positions puts into a micro-batch: its input `tokens`, `labels`,
    `loss_mask` and `position_ids` (each [n]), and where its segments start (`starts`, 0 first):
    attention stays within a segment, as Megatron's `cu_seqlens` keep it within a document."""

    tokens: np.ndarray  # int64
    labels: np.ndarray  # int64
    loss_mask: np.ndarray  # float32
    position_ids: np.ndarray  # int64
    starts: tuple[int, ...] = (0,)

    @classmethod
    def next_token(cls, tokens: np.ndarray) -> TrainingSample:
        """A document's n + 1 tokens trained as one sequence: each predicts the next."""
        n = tokens.size - 1
        return cls(tokens[:-1], tokens[1:], np.ones(n, np.float32), np.arange(n, dtype=np.int64))


class SampleDataset(Protocol):
    """What the planner and the executor read of a dataset: each sample's training length, and
    the sample when a micro-batch is built. `VariableLengthDataset` offers it, a blend of
    several (`megatron.dynapipe.data.datasets.BlendedSamples`), and the training dataset of a
    Megatron-LM program (`megatron.dynapipe.data.program_samples`)."""

    name: str
    max_seqlen: int
    vocab_size: int
    eod_id: int
    pad_id: int

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray: ...

    def training_sample(self, index: int) -> TrainingSample: ...
