"""SYNTHETIC datasets for benchmarks and `--mock-data`: lengths from a planner preset with
seeded random tokens, or megatron-core's mock GPT documents.

megatron.core is imported inside the function that uses it: importing it pulls in its
schedules and triton (seconds), and only mock datasets need it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dynapipe_planner.data import sample_lengths
from dynapipe_planner.errors import PlanningError

from .base import BYTE_TOKENIZER, DataError, Tokenizer
from .variable_length import MegatronDocuments, VariableLengthDataset, tokenized_dataset


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
    return tokenized_dataset(
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
        MegatronDocuments(mock, lengths),
        max_seqlen,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod_id,
        pad_id=tokenizer.pad_id,
    )
