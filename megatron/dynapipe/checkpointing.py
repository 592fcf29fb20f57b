"""Save and resume training: weights, optimiser, LR schedule, data position and RNG, per rank.

Layout (Megatron-like): `<dir>/iter_<NNNNNNN>/rank_<RRRRR>.pt` and `<dir>/latest_iteration.txt`.
Each rank writes its own shard to a temporary name and renames it, and rank 0 moves the
`latest` marker only after every rank has finished, so a crash mid-save leaves the previous
checkpoint in force. The data sampler's position is saved too: a resumed run sees exactly the
global batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .log import log_rank0

LATEST = "latest_iteration.txt"


@dataclass
class TrainState:
    """Where training stands, besides the weights and the optimiser."""

    iteration: int = 0
    consumed_tokens: int = 0


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or from a different job layout; names the path."""


def _shard_path(directory: Path, iteration: int, rank: int) -> Path:
    return directory / f"iter_{iteration:07d}" / f"rank_{rank:05d}.pt"


def save(
    directory: str | os.PathLike, state: TrainState, model, optimizer, scheduler, sampler
) -> Path:
    """Write this rank's shard of iteration `state.iteration`; returns its path."""
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = _shard_path(directory, state.iteration, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "iteration": state.iteration,
        "consumed_tokens": state.consumed_tokens,
        "world_size": world,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": rng_state(),
    }
    save_atomically(payload, path)
    dist.barrier()
    if rank == 0:
        mark_latest(directory, state.iteration)
    dist.barrier()
    return path


def rng_state() -> dict:
    """This rank's random streams: the default generator (dropout outside TP regions), the
    device generator on a GPU, and megatron's TP RNG tracker (dropout inside TP regions)."""
    from megatron.core import tensor_parallel

    state = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Resume the streams `rng_state` saved (after the model drew its initialisation)."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_atomically(payload: dict, path: Path) -> None:
    """torch.save next to `path`, then rename: a crash never leaves half a checkpoint."""
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def mark_latest(directory: Path, iteration: int) -> None:
    """Point `LATEST` at `iteration` (atomically), once its files are all written."""
    marker = directory / LATEST
    tmp_marker = marker.with_suffix(".tmp")
    tmp_marker.write_text(f"{iteration}\n")
    os.replace(tmp_marker, marker)


@dataclass
class ReadCheckpoint:
    """A checkpoint file read but not yet applied: the data position is needed before the
    model exists, so that planning can start while the model is built."""

    path: Path
    payload: dict

    @property
    def state(self) -> TrainState:
        return TrainState(self.payload["iteration"], self.payload["consumed_tokens"])

    @property
    def sampler_state(self) -> dict:
        return self.payload["sampler"]


class Checkpoint(ReadCheckpoint):
    """One rank's shard of a homogeneous job."""

    def restore(self, model, optimizer, scheduler) -> None:
        """Load weights, optimiser, LR schedule and the RNG (after the model drew its init)."""
        model.load_state_dict(self.payload["model"])
        optimizer.load_state_dict(self.payload["optimizer"])
        scheduler.load_state_dict(self.payload["scheduler"])
        set_rng_state(self.payload["rng"])


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a checkpoint (its `LATEST` marker)."""
    return (Path(directory) / LATEST).is_file()


def latest_iteration(directory: Path) -> int:
    """The iteration `LATEST` names in `directory`."""
    marker = directory / LATEST
    try:
        return int(marker.read_text().strip())
    except FileNotFoundError as err:
        raise CheckpointError(f"no checkpoint in {directory}: {marker} is missing") from err
    except ValueError as err:
        raise CheckpointError(f"{marker} does not hold an iteration number") from err


def load_payload(path: Path, what: str) -> dict:
    """torch.load a checkpoint file; a missing or damaged one is a CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError as err:
        raise CheckpointError(f"{what} {path} is missing") from err
    except Exception as err:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(f"{what} {path} is corrupt: {err}") from err


def read(directory: str | os.PathLike) -> Checkpoint:
    """This rank's shard of the latest checkpoint in `directory`."""
    directory = Path(directory)
    iteration = latest_iteration(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = _shard_path(directory, iteration, rank)
    if not path.exists() and (path.parent / "full_state.pt").exists():
        raise CheckpointError(
            f"{path.parent} holds a heterogeneous job's full_state.pt; resume it with "
            "--dynamic-strategies or --hetero-plan"
        )
    payload = load_payload(path, "checkpoint shard")
    if payload.get("world_size") != world:
        raise CheckpointError(
            f"checkpoint {path} was written by {payload.get('world_size')} ranks, this job has "
            f"{world}"
        )
    return Checkpoint(path, payload)


def read_checkpoint(args: argparse.Namespace, read: Callable):
    """The checkpoint `--load` names, or None to start from scratch: no --load, or (as
    Megatron does) a --load directory without a checkpoint yet."""
    if not args.load:
        return None
    if not has_checkpoint(args.load):
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {args.load}: no checkpoint there")
        log_rank0(dist.get_rank(), f"no checkpoint in {args.load}: starting from scratch")
        return None
    return read(args.load)
