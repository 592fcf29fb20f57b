"""The job's log: the lines every Megatron user reads, printed by rank 0 only."""

from __future__ import annotations

import sys


def log_rank0(rank: int, message: str) -> None:
    """Print `message` on rank 0 only (the log every Megatron user reads)."""
    if rank == 0:
        print(message, file=sys.stdout, flush=True)
