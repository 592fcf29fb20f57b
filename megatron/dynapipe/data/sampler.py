"""Global batches: endless, resumable, seeded, either a token budget (DynaPipe's) or a sample
count (Megatron's `--global-batch-size`).
"""

from __future__ import annotations

import copy

import numpy as np

from dynapipe_planner.data import global_batches, sample_batches

from .base import DataError


class GlobalBatchSampler:
    """Endless global batches: yields (iteration, sample indices), epoch after epoch.

    A batch is a budget of `tokens_per_batch` tokens (DynaPipe's) or exactly
    `samples_per_batch` samples (Megatron's `--global-batch-size`); each epoch is
    `dynapipe_planner.data.global_batches` or `sample_batches` over (seed, epoch), so the order
    depends only on the seed (or, without `shuffle`, every epoch reads the samples in their
    order, as Megatron's pretraining sampler reads a Megatron dataset); `state_dict()` records
    the place, and a sampler that loads it continues with exactly the batches the original
    would have produced.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        tokens_per_batch: int | None = None,
        seed: int = 0,
        *,
        samples_per_batch: int | None = None,
        shuffle: bool = True,
    ) -> None:
        if (tokens_per_batch is None) == (samples_per_batch is None):
            raise DataError("a global batch is either tokens_per_batch or samples_per_batch")
        self._lengths = np.asarray(lengths)
        self._tokens_per_batch = tokens_per_batch or 0
        self._samples_per_batch = samples_per_batch or 0
        self._seed = seed
        self._shuffle = shuffle
        self._iteration = 0
        self._seek(epoch=0, position=0)

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def __next__(self) -> tuple[int, np.ndarray]:
        if self._position == len(self._batches):
            self._seek(self._epoch + 1, 0)
        batch = self._batches[self._position]
        self._position += 1
        self._iteration += 1
        return self._iteration - 1, batch

    def reader(self) -> GlobalBatchSampler:
        """Another sampler at this place, advancing on its own. The two share the lengths and
        the epoch's batch arrays, which no sampler writes (a deep copy took 0.5 s and as much
        memory again for a 1.6 million sample epoch)."""
        return copy.copy(self)

    def state_dict(self) -> dict[str, int]:
        """The place in the data order, plus what the order depends on (checked on load)."""
        return {
            "iteration": self._iteration,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "tokens_per_batch": self._tokens_per_batch,
            "samples_per_batch": self._samples_per_batch,
            "num_samples": int(self._lengths.shape[0]),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`; refuse one taken over other data or settings."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise DataError(f"sampler state lacks {', '.join(missing)}")
        for key in ("seed", "tokens_per_batch", "samples_per_batch", "num_samples"):
            if state[key] != expected[key]:
                raise DataError(
                    f"sampler state was saved with {key}={state[key]}, this run has "
                    f"{expected[key]}; resuming would change the data order"
                )
        self._seek(int(state["epoch"]), int(state["position"]))
        if self._position > len(self._batches):
            raise DataError(
                f"sampler state position {self._position} is past the "
                f"{len(self._batches)} batches of epoch {self._epoch}"
            )
        self._iteration = int(state["iteration"])

    def _seek(self, epoch: int, position: int) -> None:
        self._epoch, self._position = epoch, position
        if self._samples_per_batch:
            batches = sample_batches(
                self._lengths,
                self._samples_per_batch,
                seed=self._seed,
                shuffle=self._shuffle,
                epoch=epoch,
            )
        else:
            batches = global_batches(
                self._lengths,
                self._tokens_per_batch,
                seed=self._seed,
                shuffle=self._shuffle,
                epoch=epoch,
            )
        self._batches = list(batches)
