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

Layout: `<dir>/iter_<NNNNNNN>/` and `<dir>/latest_iteration.txt`, with one file
`full_state.pt` written by rank 0 under a temporary name and renamed, the `latest` marker moved
only after that, so a crash mid-save leaves the previous checkpoint in force; the next run
removes what the crash left (`remove_interrupted_saves`). Every rank reads the same file on
resume. The same directory holds the state as a Megatron-LM checkpoint
too (`megatron_export`: `iter_<NNNNNNN>/` in `--ckpt-format`, `latest_checkpointed_iteration.txt`),
written before `full_state.pt` moves in, so a homogeneous job or Megatron-LM resumes from it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpointing import (
    FULL_STATE,
    LATEST,
    CheckpointError,
    TrainState,
    remove_partial_iterations,
    rng_state,
    say_removed,
    set_rng_state,
)
from .switch import DisaggregatedOptimizer

FORMAT = "dynapipe-full-fp32-v1"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # a homogeneous job's checkpoint


def _path(directory: Path, iteration: int) -> Path:
    return directory / f"iter_{iteration:07d}" / FULL_STATE


def save(
    directory: str | os.PathLike,
    state: TrainState,
    optimizer: DisaggregatedOptimizer,
    sampler,
    export: Callable[[Path], None] | None = None,
) -> Path:
    """Gather the full master weights and optimiser states on rank 0 and write them with the
    data position (a collective: every rank calls it).

    `export(staged)` runs on rank 0 with the written file before it moves into its iteration
    directory: Megatron's checkpoint writer (`megatron_export`) fills that directory first, as
    it wants it empty."""
    directory = Path(directory)
    path = _path(directory, state.iteration)
    full = optimizer.full_state_dict(dst=0)
    streams = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_state(), streams, dst=0)
    if dist.get_rank() == 0:
        payload = {
            "format": FORMAT,
            "iteration": state.iteration,
            "consumed_tokens": state.consumed_tokens,
            "saved_by_world_size": dist.get_world_size(),
            "optimizer": full,
            "sampler": sampler.state_dict(),
            "rng_by_rank": streams,
        }
        staged = _staged(path)
        directory.mkdir(parents=True, exist_ok=True)
        save_atomically(payload, staged)
        if export is not None:
            export(staged)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(_checksum_path(staged), _checksum_path(path))
        os.replace(staged, path)
        mark_latest(directory, state.iteration)
    dist.barrier()
    return path


def _staged(path: Path) -> Path:
    """Where `save` writes `path` before moving it in: beside its iteration directory, which
    Megatron's writer wants empty (`remove_interrupted_saves` knows the name)."""
    return path.parent.parent / f".{path.parent.name}.{path.name}"


def save_atomically(payload: dict, path: Path) -> None:
    """torch.save next to `path`, then rename: a crash never leaves half a checkpoint. The
    file's SHA-256 goes beside it (`<file>.sha256`) before the rename, so a resume can tell
    a damaged file from a good one. A temporary file a crashed save left is replaced."""
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    _checksum_path(path).write_text(_sha256(tmp) + "\n")
    os.replace(tmp, path)


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checksum(path: Path) -> None:
    """A file whose bytes differ from the SHA-256 saved with it is named, not loaded."""
    recorded = _checksum_path(path)
    if not recorded.is_file():
        raise CheckpointError(f"checkpoint {path} has no checksum file {recorded.name}")
    if recorded.read_text().strip() != _sha256(path):
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 differs from {recorded}")


def mark_latest(directory: Path, iteration: int) -> None:
    """Point `LATEST` at `iteration` (atomically), once its files are all written."""
    pending = _pending_marker(directory)
    pending.write_text(f"{iteration}\n")
    os.replace(pending, directory / LATEST)


def _pending_marker(directory: Path) -> Path:
    return (directory / LATEST).with_suffix(".tmp")


def remove_interrupted_saves(directory: str | os.PathLike) -> None:
    """Remove what a killed save left in `directory` (the --save directory; rank 0, at start,
    when no save runs): staged `full_state.pt` files never moved into their iteration (and
    their temporary files and checksums), the iterations later than `LATEST` that no save
    completed (`remove_partial_iterations`: a Megatron export cut short), and a `LATEST` update
    never renamed into place (the previous checkpoint stays in force). Each removal is one
    warning line. A damaged `LATEST` leaves everything."""
    directory = Path(directory)
    try:
        tracked = latest_iteration(directory) if has_checkpoint(directory) else None
    except CheckpointError:  # a --load of it names the damage; nothing is judged by it
        return
    _pending_marker(directory).unlink(missing_ok=True)
    for leftover in sorted(directory.glob(f".iter_*.{FULL_STATE}*")):
        leftover.unlink()
        say_removed(leftover)
    remove_partial_iterations(directory, tracked)


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a layout-independent checkpoint (its `LATEST` marker)."""
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
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"{what} {path} is missing") from err
    except Exception as err:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(f"{what} {path} is corrupt: {err}") from err


@dataclass
class FullCheckpoint:
    """A layout-independent checkpoint read but not yet applied: full master weights and
    optimiser states, and the data position (needed before the model exists)."""

    path: Path
    payload: dict

    @property
    def state(self) -> TrainState:
        payload = self.payload
        return TrainState(payload["iteration"], consumed_tokens=payload["consumed_tokens"])

    @property
    def sampler_state(self) -> dict:
        return self.payload["sampler"]

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


def read_latest(args) -> FullCheckpoint | None:
    """The checkpoint `--load` names, or None to start from scratch: no --load, or (as
    Megatron does) a --load directory without a checkpoint yet."""
    if not args.load:
        return None
    directory = Path(args.load)
    if not has_checkpoint(directory) and not (directory / MEGATRON_TRACKER).exists():
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {directory}: no checkpoint there")
        return None
    return read(directory)


def read(directory: str | os.PathLike) -> FullCheckpoint:
    """The latest layout-independent checkpoint in `directory`."""
    directory = Path(directory)
    if (directory / MEGATRON_TRACKER).exists() and not has_checkpoint(directory):
        raise CheckpointError(
            f"{directory} holds a homogeneous job's Megatron checkpoint; a heterogeneous job "
            f"resumes from {FULL_STATE} (layout-independent) checkpoints only"
        )
    path = _path(directory, latest_iteration(directory))
    if path.is_file():
        verify_checksum(path)
    payload = load_payload(path, "checkpoint")
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} checkpoint")
    return FullCheckpoint(path, payload)
