"""The shapes a cost table is profiled at (no torch here: `tools/profile_costs.py` sizes torch's
thread pool before torch loads)."""

from __future__ import annotations

SMALLEST_SEQLEN = 32
MOST_SAMPLES = 64  # the largest micro-batch size the local profile measures


def default_seqlens(max_seqlen: int, smallest: int = SMALLEST_SEQLEN) -> list[int]:
    """Powers of two and the points halfway between them in log scale (x1.5), up to and
    including `max_seqlen`: attention grows with s^2, so linear interpolation needs points
    closer than an octave."""
    points, p = [], smallest
    while p < max_seqlen:
        points += [p, p * 3 // 2]
        p *= 2
    return sorted({x for x in points if x < max_seqlen} | {max_seqlen})


def local_grid(seq_length: int, tokens_per_microbatch: int) -> tuple[list[int], list[int], int]:
    """Micro-batch sizes, sequence lengths and token cap of a job's local profile: the lengths
    of `default_seqlens`, sizes in powers of two while a micro-batch of the shortest length
    stays within `tokens_per_microbatch` (at most `MOST_SAMPLES`: packed rows hold more
    samples), and that cap on b x s (points above it are not run; the planner finds them
    infeasible)."""
    cap = max(tokens_per_microbatch, seq_length)
    sizes, b = [], 1
    while b <= MOST_SAMPLES and b * SMALLEST_SEQLEN <= cap:
        sizes.append(b)
        b *= 2
    return sizes, default_seqlens(seq_length), cap
