"""The tensors of each micro-batch a plan asks for, built from its samples when the executor
reads it.

Each planned micro-batch is padded only to its own `seqlen`. Packed rows (several samples in one
row) are kept apart by block-diagonal causal attention masks and per-sample position ids,
because megatron-core's local attention, the one that runs on CPU, cannot take packed THD
sequences. `attention_mask` follows megatron-core: True means masked out. Everything stays on
CPU; the executor moves tensors to its device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import pairwise

import numpy as np
import torch

from dynapipe_planner.plan import ExecutionPlan, MicroBatch

from .base import DataError, SampleDataset


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
