"""The tensors of each micro-batch a plan asks for, built from its samples when the executor
reads it.

Each planned micro-batch is padded only to its own `seqlen` and reaches megatron-core as
Megatron-LM runs packed sequences: its rows (one sample each, or the samples a packed
micro-batch's `row_sizes` put in them) laid end to end as one sequence of rows x seqlen tokens,
with the cumulative boundaries of its samples and of each row's padding (`cu_seqlens`,
megatron-core's THD format, `PackedSeqParams`). Attention is computed within each sample
(TransformerEngine on GPU, `packed_attention` on CPU), never over a [tokens x tokens] mask: a
padded micro-batch costs its samples' own attention, as a packed one does. Under sequence
parallelism each row is padded further to a multiple of the tensor-parallel degree
(`row_length`), as Megatron-LM needs `--seq-length` to be: the sequence is split evenly over the
TP ranks. Everything stays on CPU; the executor moves tensors to its device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from itertools import pairwise

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dynapipe_planner.plan import ExecutionPlan, MicroBatch

from .base import DataError, SampleDataset


@dataclass
class MicroBatchTensors:
    """The inputs of one planned micro-batch of b rows of s tokens: shape [1, b * s], whose
    `cu_seqlens` (int32) bound its segments.

    `position_ids` are the samples' own (from 0 for each of DynaPipe's samples); the padding at
    a row's end counts as one more segment (positions 0, 1, ... and causal attention among
    padding positions only). `loss_mask` is the samples' own, 0.0 on padding, and `num_tokens`
    sums it.
    """

    tokens: torch.Tensor  # int64
    labels: torch.Tensor  # int64; pad_id on padding
    loss_mask: torch.Tensor  # float32
    position_ids: torch.Tensor  # int64
    num_tokens: int
    cu_seqlens: torch.Tensor  # int32 [segments + 1]
    row_length: int  # tokens per row (s)

    def to(self, device: torch.device | str) -> MicroBatchTensors:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def packed_seq_params(self, device: torch.device | str) -> PackedSeqParams:
        """megatron-core's THD parameters of the micro-batch."""
        return thd_params(self.cu_seqlens.to(device), self._longest_segment())

    def megatron_batch(self, device: torch.device | str) -> dict[str, torch.Tensor | None]:
        """The dict a Megatron-LM data iterator yields (and its `get_batch` returns), on
        `device`, as megatron-core's GPTDataset yields samples under
        `--dataloader-inter-document-masking` (which DynaPipe turns on): [rows, s] tensors,
        each row's segment boundaries `cu_seqlens` [rows, s + 1] (int32, padded with s) and
        longest segment `max_seqlen` [rows] (int32), no attention mask. So Megatron-LM's own
        `get_batch` (`get_batch_on_this_tp_rank`, `flatten_batch_for_packed_sequences`) and the
        `PackedSeqParams` its `forward_step` builds take DynaPipe's micro-batches unchanged."""
        bounds = self._row_bounds()
        rows, s = len(bounds), self.row_length
        batch: dict[str, torch.Tensor | None] = {
            key: getattr(self, key).to(device).reshape(rows, s)
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
        batch["attention_mask"] = None
        per_row = torch.full((rows, s + 1), s, dtype=torch.int32)
        for row, local in enumerate(bounds):
            per_row[row, : len(local)] = torch.tensor(local, dtype=torch.int32)
        longest = [max(b - a for a, b in pairwise(local)) for local in bounds]
        batch["cu_seqlens"] = per_row.to(device)
        batch["max_seqlen"] = torch.tensor(longest, dtype=torch.int32, device=device)
        return batch

    def core_batch(self, device: torch.device | str) -> dict[str, object]:
        """The micro-batch as a megatron-core-only loop's `forward_step` reads it
        (`core_schedule`): [1, tokens] tensors on `device` forming one THD sequence, no
        attention mask, and the `packed_seq_params` its model call passes on."""
        moved = self.to(device)
        batch: dict[str, object] = {
            key: getattr(moved, key) for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
        batch["attention_mask"] = None
        batch["packed_seq_params"] = moved.packed_seq_params(device)
        return batch

    def _row_bounds(self) -> list[list[int]]:
        """Each row's segment boundaries, from 0 to the row's length: its samples, then its
        padding."""
        s, bounds = self.row_length, self.cu_seqlens.tolist()
        rows = self.tokens.numel() // s
        return [[b - r * s for b in bounds if r * s <= b <= (r + 1) * s] for r in range(rows)]

    def _longest_segment(self) -> int:
        """Tokens in the longest segment (sample or padding)."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def thd_params(bounds: torch.Tensor, longest: int) -> PackedSeqParams:
    """megatron-core's parameters of one THD sequence whose segments, bounded by `bounds`
    (int32 cumulative lengths) and at most `longest` tokens long, attend within themselves."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def _checked_rows(mb: MicroBatch, dataset: SampleDataset) -> list[list[int]]:
    """The sample ids of each row of `mb`, after checking that they exist and fit."""
    if mb.tgt_seqlen:
        raise DataError(f"micro-batch {mb.id}: encoder-decoder micro-batches are not supported")
    rows = _rows(mb)
    _check_fits(mb, rows, dataset.lengths())
    return rows


def row_length(seqlen: int, multiple: int = 1) -> int:
    """Tokens per row of a micro-batch planned at `seqlen`: `seqlen` rounded up to `multiple`
    (the sequence-parallel degree; 1 without sequence parallelism)."""
    return -(-seqlen // multiple) * multiple


def microbatch_tensors(
    mb: MicroBatch, dataset: SampleDataset, row_multiple: int = 1
) -> MicroBatchTensors:
    """Tensors of plan micro-batch `mb`: one sample per row, or packed rows per `mb.row_sizes`,
    as one THD sequence whose segments are the samples' own (`TrainingSample.starts`) and each
    row's padding; rows of `row_length(mb.seqlen, row_multiple)` tokens."""
    rows = _checked_rows(mb, dataset)
    lengths = dataset.lengths()
    width = row_length(mb.seqlen, row_multiple)
    shape = (len(rows), width)
    tokens = np.full(shape, dataset.pad_id, dtype=np.int64)
    labels = np.full(shape, dataset.pad_id, dtype=np.int64)
    loss_mask = np.zeros(shape, dtype=np.float32)
    position_ids = np.zeros(shape, dtype=np.int64)
    segments = np.zeros(shape, dtype=np.int64)
    for row, samples in enumerate(rows):
        cursor = segment = 0
        for sample in samples:
            read = dataset.training_sample(sample)
            if read.tokens.size != lengths[sample]:
                raise DataError(
                    f"{dataset.name}: sample {sample} has {read.tokens.size} positions, its "
                    f"length says {int(lengths[sample])}"
                )
            span = slice(cursor, cursor + read.tokens.size)
            tokens[row, span] = read.tokens
            labels[row, span] = read.labels
            loss_mask[row, span] = read.loss_mask
            position_ids[row, span] = read.position_ids
            opens = np.zeros(read.tokens.size, dtype=np.int64)
            opens[list(read.starts[1:])] = 1
            segments[row, span] = segment + np.cumsum(opens)
            segment += len(read.starts)
            cursor = span.stop
        position_ids[row, cursor:] = np.arange(width - cursor)
        segments[row, cursor:] = segment
    return _thd(tokens, labels, loss_mask, position_ids, segments)


def _thd(
    tokens: np.ndarray,
    labels: np.ndarray,
    loss_mask: np.ndarray,
    position_ids: np.ndarray,
    segments: np.ndarray,
) -> MicroBatchTensors:
    """[b, s] rows (with per-row segment ids) as one THD sequence of b * s tokens."""
    flat = segments.reshape(-1)
    starts = np.ones(flat.size, dtype=bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: segments.shape[1]] = True  # every row starts a segment, even after padding
    bounds = [*np.flatnonzero(starts).tolist(), flat.size]
    return MicroBatchTensors(
        tokens=torch.from_numpy(tokens.reshape(1, -1)),
        labels=torch.from_numpy(labels.reshape(1, -1)),
        loss_mask=torch.from_numpy(loss_mask.reshape(1, -1)),
        position_ids=torch.from_numpy(position_ids.reshape(1, -1)),
        num_tokens=int(loss_mask.sum()),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        row_length=segments.shape[1],
    )


def with_empty_rows(
    batch: MicroBatchTensors, num_rows: int, seqlen: int, pad_id: int
) -> MicroBatchTensors:
    """`batch` topped up to `num_rows` rows of `seqlen` tokens with rows of padding only (no
    label, no loss), as more segments of its one sequence.

    Fixed-shape schedules (megatron-core's) need every micro-batch to have the same number of
    rows; the last packed micro-batch of a global batch may have fewer. A filler row follows the
    padding convention above (positions 0, 1, ..., causal attention among its own positions).
    """
    rows = batch.tokens.numel() // seqlen
    missing = num_rows - rows
    if missing < 0:
        raise DataError(f"micro-batch has {rows} rows, more than {num_rows}")
    if missing == 0:
        return batch
    shape = (missing, seqlen)
    padding = np.full(shape, pad_id, dtype=np.int64)
    positions = np.broadcast_to(np.arange(seqlen), shape).copy()
    filler = _thd(
        padding, padding, np.zeros(shape, np.float32), positions, np.zeros(shape, np.int64)
    )
    names = ("tokens", "labels", "loss_mask", "position_ids")
    joined = {n: torch.cat([getattr(batch, n), getattr(filler, n)], dim=1) for n in names}
    bounds = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1] + filler.cu_seqlens[1:]])
    return replace(batch, **joined, cu_seqlens=bounds)


class RankMicroBatches(Mapping[int, MicroBatchTensors]):
    """The micro-batches of one pipeline by id, checked at once but built when read and not kept.

    The executor reads a micro-batch at its forward pass; autograd then keeps what the backward
    needs until that backward. Building every micro-batch up front would hold all their inputs
    for the whole iteration, memory the plan never priced (seed `dynapipe.txt` §3: the executor
    loads each micro-batch by instruction).
    """

    def __init__(
        self, microbatches: Sequence[MicroBatch], dataset: SampleDataset, row_multiple: int = 1
    ) -> None:
        for mb in microbatches:
            _checked_rows(mb, dataset)  # a bad plan fails before any rank starts running it
        self._microbatches = {mb.id: mb for mb in microbatches}
        self._dataset = dataset
        self._row_multiple = row_multiple

    def __getitem__(self, mb_id: int) -> MicroBatchTensors:
        return microbatch_tensors(self._microbatches[mb_id], self._dataset, self._row_multiple)

    def __iter__(self) -> Iterator[int]:
        return iter(self._microbatches)

    def __len__(self) -> int:
        return len(self._microbatches)


def rank_microbatches(
    plan: ExecutionPlan, replica: int, dataset: SampleDataset, row_multiple: int = 1
) -> RankMicroBatches:
    """The micro-batches of pipeline `replica`, by micro-batch id (built when read), rows
    padded to a multiple of `row_multiple` tokens."""
    mine = [mb for mb in plan.microbatches if mb.replica == replica]
    return RankMicroBatches(mine, dataset, row_multiple)


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
