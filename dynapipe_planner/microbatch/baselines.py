"""The micro-batching baselines DynaPipe is measured against (seed dynapipe.txt §2.2, §8.4).

- padding: a fixed number of samples per micro-batch, in data order, padded to the longest.
- token budget ("TB"): sorted samples, each micro-batch filled up to a padded-token budget.
- packing: first-fit-decreasing into rows of a fixed length; rows grouped into micro-batches of
  a fixed size. Attention is priced block-diagonally (flash-attention varlen style), so packing
  pays only for attention inside each sample. `packed_group` packs one micro-batch's samples
  into rows of its own length (DynaPipe's planner may run a DP micro-batch that way).

Each returns `Group`s; the planner prices and schedules them like DP micro-batches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .. import _core


@dataclass
class Group:
    """One micro-batch: its samples, tensor rows and padded lengths.

    `rows` lists the samples of each packed row (None: one sample per row). `attention_saved`
    is the tokens^2 of self-attention block-diagonal masking skips, summed over rows.
    """

    samples: np.ndarray
    seqlen: int
    tgt_seqlen: int = 0
    rows: list[list[int]] | None = None
    attention_saved: float = 0.0

    @property
    def num_rows(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.samples)


def groups_from_indices(lengths: np.ndarray, index_lists: list[np.ndarray]) -> list[Group]:
    """Padded groups (one sample per row) from lists of sample indices."""
    out = []
    for idx in index_lists:
        sub = lengths[idx]
        if lengths.ndim == 2:
            out.append(Group(np.asarray(idx), int(sub[:, 0].max()), int(sub[:, 1].max())))
        else:
            out.append(Group(np.asarray(idx), int(sub.max())))
    return out


def padding_groups(lengths: np.ndarray, micro_batch_size: int) -> list[Group]:
    """Fixed micro-batch size in data order (no sorting), each padded to its longest sample."""
    n = len(lengths)
    chunks = [np.arange(i, min(n, i + micro_batch_size)) for i in range(0, n, micro_batch_size)]
    return groups_from_indices(lengths, chunks)


def token_budget_groups(lengths: np.ndarray, budget: int, order: np.ndarray) -> list[Group]:
    """Greedy over ordered samples: grow a micro-batch while rows x padded length <= budget."""
    chunks, current, longest = [], [], 0
    total = lengths.sum(axis=1) if lengths.ndim == 2 else lengths
    for i in order:
        new_longest = max(longest, int(total[i]))
        if current and new_longest * (len(current) + 1) > budget:
            chunks.append(np.array(current))
            current, new_longest = [], int(total[i])
        current.append(int(i))
        longest = new_longest
    if current:
        chunks.append(np.array(current))
    return groups_from_indices(lengths, chunks)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of sample indices, each summing to <= capacity (samples longer than it must have
    been truncated by the caller); the C++ core, same bins as the reference."""
    return _core.first_fit_decreasing(np.asarray(lengths, dtype=np.int64), int(capacity))


def packed_group(group: Group, lengths: np.ndarray) -> Group:
    """`group`'s samples packed first-fit-decreasing into rows of its own padded length: no more
    rows than one sample per row, and attention only within each sample (varlen)."""
    clipped = lengths[group.samples].astype(np.int64)
    shortest = np.partition(clipped, 1)[:2] if len(clipped) > 1 else clipped
    if len(clipped) < 2 or int(shortest.sum()) > group.seqlen:  # no two samples share a row
        bins = [[i] for i in range(len(clipped))]
    else:
        bins = first_fit_decreasing(clipped, group.seqlen)
    samples = group.samples.tolist()
    rows = [[samples[i] for i in b] for b in bins]
    return Group(
        np.array([i for r in rows for i in r]),
        group.seqlen,
        rows=rows,
        attention_saved=_attention_saved(clipped, len(bins), group.seqlen),
    )


def _attention_saved(lengths: np.ndarray, num_rows: int, seqlen: int) -> float:
    """tokens^2 of attention that per-sample attention skips when `lengths` fill `num_rows`
    rows of `seqlen`."""
    return num_rows * float(seqlen) ** 2 - float((lengths.astype(np.float64) ** 2).sum())


def packing_groups(lengths: np.ndarray, max_seqlen: int, micro_batch_size: int) -> list[Group]:
    """Rows packed by first-fit-decreasing to `max_seqlen`, `micro_batch_size` rows per group."""
    if lengths.ndim != 1:
        raise ValueError("packing is implemented for decoder-only lengths")
    return packed_rows_groups(
        packing_bins(lengths, max_seqlen), lengths, max_seqlen, micro_batch_size
    )


def packing_bins(lengths: np.ndarray, max_seqlen: int) -> list[list[int]]:
    """Rows of at most `max_seqlen` tokens, first-fit-decreasing (samples clipped to it)."""
    return first_fit_decreasing(np.minimum(lengths, max_seqlen), max_seqlen)


def rows_up_to(lengths: np.ndarray, row_length: int) -> list[list[int]]:
    """DynaPipe's packed rows (issue 32): each sample longer than `row_length` alone in a row
    of its own, the others first-fit-decreasing into rows of at most `row_length` tokens;
    rows longest first."""
    long = np.flatnonzero(lengths > row_length)
    rest = np.flatnonzero(lengths <= row_length)
    rows = [[int(i)] for i in long]
    rows += [rest[b].tolist() for b in first_fit_decreasing(lengths[rest], row_length)]
    flat, starts = _flattened(rows)
    tokens = np.add.reduceat(lengths[flat], starts[:-1]) if len(flat) else np.zeros(0)
    return [rows[k] for k in np.argsort(-tokens, kind="stable")]


def trimmed_rows_shapes(
    rows: list[list[int]], lengths: np.ndarray, micro_batch_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each micro-batch of `trimmed_rows_groups`: its rows, padded length and attention saved
    (tokens^2), without building the groups (the planner prices many such candidates)."""
    _, _, counts, seqlen, saved = _trimmed_layout(rows, lengths, micro_batch_size)
    return counts, seqlen, saved


def trimmed_rows_groups(
    rows: list[list[int]], lengths: np.ndarray, micro_batch_size: int
) -> list[Group]:
    """`micro_batch_size` consecutive `rows` per micro-batch, each padded only to its longest
    row's tokens (the packing baseline pads every row to --seq-length)."""
    flat, bounds, _, seqlen, saved = _trimmed_layout(rows, lengths, micro_batch_size)
    return [
        Group(
            flat[bounds[g] : bounds[g + 1]],
            int(seqlen[g]),
            rows=rows[first : first + micro_batch_size],
            attention_saved=float(saved[g]),
        )
        for g, first in enumerate(range(0, len(rows), micro_batch_size))
    ]


def _trimmed_layout(
    rows: list[list[int]], lengths: np.ndarray, micro_batch_size: int
) -> tuple[np.ndarray, ...]:
    """The samples of `rows` in one array, where each micro-batch's samples start (plus the
    end), and each micro-batch's rows, padded length and attention saved."""
    flat, starts = _flattened(rows)
    if not len(flat):
        empty = np.zeros(0, np.int64)
        return flat, np.zeros(1, np.int64), empty, empty, np.zeros(0)
    own = lengths[flat].astype(np.float64)
    tokens = np.add.reduceat(own, starts[:-1])
    squares = np.add.reduceat(own**2, starts[:-1])
    firsts = np.arange(0, len(rows), micro_batch_size)
    seqlen = np.maximum.reduceat(tokens, firsts)
    counts = np.diff(np.append(firsts, len(rows)))
    saved = counts * seqlen**2 - np.add.reduceat(squares, firsts)
    bounds = np.append(starts[firsts], len(flat))
    return flat, bounds, counts, seqlen.astype(np.int64), saved


def _flattened(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The samples of `rows` in one array, and where each row starts (plus the end)."""
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64)
    return flat, np.cumsum([0, *map(len, rows)])


def packed_rows_groups(
    bins: list[list[int]], lengths: np.ndarray, max_seqlen: int, micro_batch_size: int
) -> list[Group]:
    """`micro_batch_size` rows of `bins` per micro-batch."""
    flat, row_starts = _flattened(bins)
    squares = np.minimum(lengths[flat], max_seqlen).astype(np.float64) ** 2
    # Attention saved per micro-batch: its rows' full squares less its samples' own squares.
    firsts = range(0, len(bins), micro_batch_size)
    own = np.add.reduceat(squares, row_starts[list(firsts)]) if len(flat) else np.zeros(0)
    groups = []
    for g, first in enumerate(firsts):
        rows = bins[first : first + micro_batch_size]
        samples = flat[row_starts[first] : row_starts[first + len(rows)]]
        saved = len(rows) * float(max_seqlen) ** 2 - float(own[g])
        groups.append(Group(samples, max_seqlen, rows=rows, attention_saved=saved))
    return groups
