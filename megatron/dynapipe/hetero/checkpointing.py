"""Checkpoints of heterogeneous and strategy-switching jobs, independent of the layout.

Hydraulis (seed `hydraulis.txt` §5.2) keeps the fp32 master weights and optimiser states apart
from whatever strategy propagates, so a checkpoint need not know the strategy either: it holds
every parameter whole (by its name in the unpipelined model), with its AdamW states, gathered
from the `DisaggregatedOptimizer`'s shards, plus the data sampler's position. A job resumes
from it under any strategy set, static layout or rank count: each rank takes its own rows.
Every rank's random streams (dropout) are saved too; a job of the same rank count resumes them
(exactly the uninterrupted run when it also trains the same strategies), another rank count
starts them from the seed, and says so. A job whose TP degrees pad the vocabulary differently
gets the padding rows fitted (`switch.fit_vocab_rows`), and says so too.

Layout: the homogeneous checkpoints' directory (`<dir>/iter_<NNNNNNN>/`, `<dir>/latest_
iteration.txt`, see `megatron.dynapipe.checkpointing`), with one file `full_state.pt` written
by rank 0 under a temporary name and renamed, the `latest` marker moved only after that, so a
crash mid-save leaves the previous checkpoint in force. Every rank reads the same file on resume.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from ..checkpointing import (
    CheckpointError,
    ReadCheckpoint,
    TrainState,
    latest_iteration,
    load_payload,
    mark_latest,
    rng_state,
    save_atomically,
    set_rng_state,
)
from .switch import DisaggregatedOptimizer

FULL_STATE = "full_state.pt"
FORMAT = "dynapipe-full-fp32-v1"


def _path(directory: Path, iteration: int) -> Path:
    return directory / f"iter_{iteration:07d}" / FULL_STATE


def save(
    directory: str | os.PathLike,
    state: TrainState,
    optimizer: DisaggregatedOptimizer,
    sampler,
) -> Path:
    """Gather the full master weights and optimiser states on rank 0 and write them with the
    data position (a collective: every rank calls it)."""
    directory = Path(directory)
    path = _path(directory, state.iteration)
    full = optimizer.full_state_dict(dst=0)
    streams = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_state(), streams, dst=0)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": FORMAT,
            "iteration": state.iteration,
            "consumed_tokens": state.consumed_tokens,
            "saved_by_world_size": dist.get_world_size(),
            "optimizer": full,
            "sampler": sampler.state_dict(),
            "rng_by_rank": streams,
        }
        save_atomically(payload, path)
        mark_latest(directory, state.iteration)
    dist.barrier()
    return path


class FullCheckpoint(ReadCheckpoint):
    """A layout-independent checkpoint: full master weights and optimiser states."""

    def restore(self, optimizer: DisaggregatedOptimizer) -> list[str]:
        """This rank's rows of the master weights and AdamW states (the vocabulary's padding
        fitted to this job's), and its random streams when the checkpoint was saved by as many
        ranks; returns a line for each way the resume differs from an uninterrupted run."""
        try:
            notes = optimizer.load_full_state_dict(self.payload["optimizer"])
        except (KeyError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"checkpoint {self.path} does not fit this model: {err}") from err
        streams = self.payload.get("rng_by_rank")
        if streams is None or len(streams) != dist.get_world_size():
            saved = "no" if streams is None else len(streams)
            notes.append(
                f"dropout random streams restart from --seed: {self.path} holds {saved} ranks' "
                f"streams, this job has {dist.get_world_size()} ranks"
            )
        else:
            set_rng_state(streams[dist.get_rank()])
        return notes


def read(directory: str | os.PathLike) -> FullCheckpoint:
    """The latest layout-independent checkpoint in `directory`."""
    directory = Path(directory)
    path = _path(directory, latest_iteration(directory))
    if not path.exists() and (path.parent / "rank_00000.pt").exists():
        raise CheckpointError(
            f"{path.parent} holds a homogeneous job's per-rank shards; a heterogeneous job "
            f"resumes from {FULL_STATE} (layout-independent) checkpoints only"
        )
    payload = load_payload(path, "checkpoint")
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} checkpoint")
    return FullCheckpoint(path, payload)
