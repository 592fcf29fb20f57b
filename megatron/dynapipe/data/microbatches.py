"""The tensors of each micro-batch a plan asks for, built from its samples when the executor
reads it.

Each planned micro-batch is padded only to its own `seqlen`. A micro-batch of one sample per row
is a [rows, seqlen] batch with causal attention masks. A packed micro-batch (the plan gives its
`row_sizes`) reaches megatron-core as Megatron-LM runs packed sequences: its rows laid end to
end as one sequence of rows x seqlen tokens, with the cumulative boundaries of its samples
(`cu_seqlens`, megatron-core's THD format, `PackedSeqParams`), so attention is computed per
sample (TransformerEngine on GPU, `packed_attention` on CPU) and no [tokens x tokens] mask is
ever built. `attention_mask` follows megatron-core: True means masked out. Everything stays on
CPU; the executor moves tensors to its device.
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
    """The inputs of one planned micro-batch: shape [b, s] with b = rows and s = its seqlen, or
    [1, b * s] for a packed micro-batch, whose `cu_seqlens` (int32) bound its segments.

    `position_ids` restart at 0 for every sample; the padding at a row's end counts as one more
    sample (positions 0, 1, ... and causal attention among padding positions only), so no query
    row of the attention mask is fully masked. `loss_mask` is 1.0 exactly on real labels, and
    `num_tokens` counts them.
    """

    tokens: torch.Tensor  # int64
    labels: torch.Tensor  # int64; pad_id on padding
    loss_mask: torch.Tensor  # float32
    position_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor | None  # bool [b, 1, s, s], True = masked out; None if packed
    num_tokens: int
    cu_seqlens: torch.Tensor | None = None  # int32 [segments + 1], packed micro-batches only
    row_length: int | None = None  # tokens per packed row (s), packed micro-batches only

    def to(self, device: torch.device | str) -> MicroBatchTensors:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def packed_seq_params(self, device: torch.device | str) -> PackedSeqParams | None:
        """megatron-core's THD parameters of a packed micro-batch (None otherwise)."""
        if self.cu_seqlens is None:
            return None
        bounds = self.cu_seqlens.to(device)
        longest = self._longest_segment()
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )

    def megatron_batch(
        self, device: torch.device | str, documents: bool = False
    ) -> dict[str, torch.Tensor | None]:
        """The dict a Megatron-LM data iterator yields (and its `get_batch` returns), on
        `device`. A packed micro-batch (and, when `documents`, every micro-batch) comes as
        megatron-core's GPTDataset yields samples under `--dataloader-inter-document-masking`:
        [rows, s] tensors, each row's segment boundaries `cu_seqlens` [rows, s + 1] (int32,
        padded with s) and longest segment `max_seqlen` [rows] (int32), no attention mask; a
        padded row is its sample and its padding. So Megatron-LM's own `get_batch`
        (`get_batch_on_this_tp_rank`, `flatten_batch_for_packed_sequences`) and the
        `PackedSeqParams` its `forward_step` builds take DynaPipe's micro-batches unchanged."""
        moved = self.to(device)
        batch: dict[str, torch.Tensor | None] = {
            "tokens": moved.tokens,
            "labels": moved.labels,
            "loss_mask": moved.loss_mask,
            "attention_mask": moved.attention_mask,
            "position_ids": moved.position_ids,
        }
        if self.cu_seqlens is None and not documents:
            return batch
        bounds = self._row_bounds()
        rows, s = len(bounds), self.tokens.numel() // len(bounds)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            batch[key] = batch[key].reshape(rows, s)
        batch["attention_mask"] = None
        per_row = torch.full((rows, s + 1), s, dtype=torch.int32)
        for row, local in enumerate(bounds):
            per_row[row, : len(local)] = torch.tensor(local, dtype=torch.int32)
        longest = [max(b - a for a, b in pairwise(local)) for local in bounds]
        batch["cu_seqlens"] = per_row.to(device)
        batch["max_seqlen"] = torch.tensor(longest, dtype=torch.int32, device=device)
        return batch

    def _row_bounds(self) -> list[list[int]]:
        """Each row's segment boundaries, from 0 to the row's length: a packed row's samples
        and padding; a padded row's sample and its padding (the real tokens come first)."""
        if self.cu_seqlens is not None:
            s, bounds = self.row_length, self.cu_seqlens.tolist()
            rows = self.tokens.numel() // s
            return [[b - r * s for b in bounds if r * s <= b <= (r + 1) * s] for r in range(rows)]
        s = self.tokens.shape[1]
        real = self.loss_mask.sum(dim=1).long().tolist()
        return [[0, n, s] if 0 < n < s else [0, s] for n in real]

    def _longest_segment(self) -> int:
        """Tokens in the longest segment (sample or padding) of a packed micro-batch."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


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
    batch = MicroBatchTensors(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(real.astype(np.float32)),
        position_ids=torch.from_numpy(position_ids),
        attention_mask=None,
        num_tokens=int(real.sum()),
    )
    if mb.row_sizes:
        return _packed(batch, torch.from_numpy(segments))
    return replace(batch, attention_mask=_causal_mask(torch.from_numpy(segments)))


def _packed(batch: MicroBatchTensors, segments: torch.Tensor) -> MicroBatchTensors:
    """`batch` ([b, s], per-row segment ids) as one THD sequence of b * s tokens."""
    flat = segments.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: segments.shape[1]] = True  # every row starts a segment, even after padding
    bounds = [*starts.nonzero().flatten().tolist(), flat.numel()]
    return MicroBatchTensors(
        tokens=batch.tokens.reshape(1, -1),
        labels=batch.labels.reshape(1, -1),
        loss_mask=batch.loss_mask.reshape(1, -1),
        position_ids=batch.position_ids.reshape(1, -1),
        attention_mask=None,
        num_tokens=batch.num_tokens,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        row_length=segments.shape[1],
    )


def with_empty_rows(
    batch: MicroBatchTensors, num_rows: int, seqlen: int, pad_id: int
) -> MicroBatchTensors:
    """`batch` topped up to `num_rows` rows of `seqlen` tokens with rows of padding only (no
    label, no loss); a packed batch gets them as more segments of its one sequence.

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
    padding = torch.full((missing, seqlen), pad_id, dtype=torch.int64)
    filler_segments = torch.zeros(missing, seqlen, dtype=torch.int64)
    filler = MicroBatchTensors(
        tokens=padding,
        labels=padding,
        loss_mask=torch.zeros(missing, seqlen, dtype=torch.float32),
        position_ids=torch.arange(seqlen).expand(missing, seqlen),
        attention_mask=None,
        num_tokens=0,
    )
    if batch.cu_seqlens is None:
        filler = replace(filler, attention_mask=_causal_mask(filler_segments))
        return replace(batch, **_joined(batch, filler, dim=0))
    filler = _packed(filler, filler_segments)
    bounds = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1] + filler.cu_seqlens[1:]])
    return replace(batch, **_joined(batch, filler, dim=1), cu_seqlens=bounds)


def _joined(batch: MicroBatchTensors, more: MicroBatchTensors, dim: int) -> dict:
    """The tensors of `batch` followed by those of `more` along `dim`."""
    names = ["tokens", "labels", "loss_mask", "position_ids"]
    if batch.attention_mask is not None:
        names.append("attention_mask")
    return {name: torch.cat([getattr(batch, name), getattr(more, name)], dim=dim) for name in names}


class RankMicroBatches(Mapping[int, MicroBatchTensors]):
    """The micro-batches of one pipeline by id, checked at once but built when read and not kept.

    The executor reads a micro-batch at its forward pass; autograd then keeps what the backward
    needs (a [b, 1, s, s] attention mask among it) until that backward. Building every
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


def _causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s], True = masked: position i sees j <= i of its own segment only (a row's
    sample, or its padding)."""
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
