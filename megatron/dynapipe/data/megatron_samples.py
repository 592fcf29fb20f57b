"""DynaPipe's datasets as the datasets `pretrain_gpt.py`'s provider hands megatron.training:
Megatron's fixed-length windows where DynaPipe does not plan (`--baseline megatron-1f1b`, and
evaluation), and the variable-length samples themselves where it does (`DocumentSamples`).

Megatron-LM pretrains on megatron-core's `GPTDataset`: the documents of a split are shuffled
(per epoch, seeded), concatenated, and cut into windows of `--seq-length` + 1 tokens that
ignore document boundaries (unless `--reset-attention-mask` / `--reset-position-ids` say
otherwise, and `--eod-mask-loss` drops the loss on end-of-document tokens). The baseline builds
those windows with that class, over the same split (and blend) DynaPipe trains on: each of the
split's samples (a document, or a `--seq-length` chunk of a longer one, `variable_length`) is one of
the GPTDataset's documents, read through the low-level interface megatron-core's own mock
data offers (`sequence_lengths`, `get`). The indices are built in memory on every rank from the
seed, as megatron-core does for mock data, so no rank waits for another's cache files.
`pretrain_gpt.py`'s dataset provider hands these to Megatron's loop, whose pretraining sampler
deals them out as it deals any GPTDataset's samples.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split

from .base import SampleDataset


@dataclass(frozen=True)
class DocumentSamples:
    """DynaPipe's own variable-length training samples as `pretrain_gpt.py`'s provider returns
    them when DynaPipe plans: the schedule plans over `samples` in DynaPipe's seeded order, and
    Megatron's loop holds a data loader for them that nobody reads (`megatron_startup`)."""

    samples: SampleDataset

    def __len__(self) -> int:
        return len(self.samples.lengths())


class _SamplesAsDocuments:
    """A split's samples as the documents of a GPTDataset (each with its n_i + 1 tokens)."""

    def __init__(self, dataset: SampleDataset) -> None:
        self._dataset = dataset
        self.sequence_lengths = (np.asarray(dataset.lengths()) + 1).astype(np.int32)

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        end = None if length is None else offset + length
        return self._dataset.tokens(int(idx))[offset:end]


@dataclass(frozen=True)
class _TokenIds:
    """What GPTDatasetConfig reads of a tokenizer. There is no padding in the windows (every
    token is real), so no token id stands for it."""

    eod: int
    vocab_size: int
    pad: int = -1

    @property
    def unique_identifiers(self) -> dict[str, int]:
        """Part of the dataset's description, as megatron-core's tokenizers give it."""
        return {"eod": self.eod, "vocab_size": self.vocab_size}


def fixed_length_samples(
    dataset: SampleDataset, args: argparse.Namespace, num_samples: int, split: str
) -> GPTDataset:
    """megatron-core's GPTDataset of `num_samples` windows over `dataset` (split "train",
    "valid" or "test"), with Megatron's flags for masks and positions."""
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=_TokenIds(eod=dataset.eod_id, vocab_size=dataset.vocab_size),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        inter_document_masking=args.dataloader_inter_document_masking,
    )  # no blend: megatron-core builds the indices in memory, caching nothing
    documents = _SamplesAsDocuments(dataset)
    indices = np.arange(len(documents), dtype=np.int32)
    return GPTDataset(documents, None, indices, num_samples, Split[split], config)
