"""The training dataset a Megatron-LM program's provider returns, as the samples DynaPipe plans.

Under a DynaPipe planning flag the program's own training data is what trains: megatron.training
calls the program's dataset provider as always, and DynaPipe plans each global batch over the
training dataset it returned (`ProgramSamples`). Planning needs every sample's length before
the first batch; the dataset says it in one of these ways (`sample_lengths`):

- **the lengths protocol**: a dataset whose `__getitem__(i)` returns Megatron's sample dict
  (`tokens`, `labels`, `loss_mask`, `position_ids`, optionally `cu_seqlens`) defines
  `sample_lengths() -> Sequence[int]`: how many leading positions of each sample's tensors are
  the sample (the rest is padding), one int in [1, --seq-length] per sample, in index order;
- megatron-core's `GPTDataset` (and `MockGPTDataset`): windows of exactly `--seq-length`
  tokens, every position trained (so DynaPipe's plans only choose how many go in a micro-batch
  and what is recomputed);
- megatron.training's `SFTDataset`: the tokens of the conversations it packs into a sample, at
  most `--seq-length` (its packing rule), counted with the dataset's own tokenizer;
- megatron-core's `BlendedDataset` of those.

Any other dataset stops the job with one line naming it (DynaPipe would otherwise have to guess
or read every sample). Samples are read in the dataset's own order, as Megatron's pretraining
sampler reads them (`--global-batch-size` consecutive samples, or consecutive samples up to the
token budget), so a DynaPipe run and a Megatron run with the same global batch train the same
samples. A sample enters a micro-batch as the first n positions of each of its tensors
(`TrainingSample`), its `cu_seqlens` inside them keeping attention within each document.

Lengths are read on the planning rank, which holds the dataset in Megatron-LM's programs
(tensor-parallel rank 0 of the first stage), and sent to the others. The ranks that read
micro-batches (each stage's tensor-parallel rank 0) need the dataset too; the others may have
none, as Megatron-LM's providers build none there.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_planner.data.validation import check_positive, check_shape
from dynapipe_planner.errors import PlanningError

from .base import DataError, TrainingSample

# The rank that reads the lengths: DynaPipe's planner runs there (`plan_source`).
_SOURCE_RANK = 0
_SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class ProgramSamples:
    """A Megatron-LM program's training dataset as a `SampleDataset` (see the module
    docstring); `dataset` is None on a rank whose provider built none."""

    def __init__(self, dataset: Any, lengths: np.ndarray, max_seqlen: int) -> None:
        self.name = f"the program's {type(dataset).__name__}"
        self.max_seqlen = max_seqlen
        # Padding positions have no loss and attend only among themselves, so the id they
        # hold changes nothing; 0 is in every vocabulary.
        self.pad_id = 0
        self.eod_id = 0
        self.vocab_size = 0
        self._dataset = dataset
        self._lengths = lengths
        self._lengths.flags.writeable = False

    def __len__(self) -> int:
        return self._lengths.size

    def lengths(self) -> np.ndarray:
        """Every sample's length (int64, read-only)."""
        return self._lengths

    def training_sample(self, index: int) -> TrainingSample:
        """The first n positions of the program's sample `index`, its documents' boundaries
        (`cu_seqlens`) inside them."""
        if self._dataset is None:  # `program_samples` let this rank plan without reading
            raise DataError(f"rank {dist.get_rank()} holds no training dataset to read")
        n = int(self._lengths[index])
        item = self._dataset[int(index)]
        missing = [key for key in _SAMPLE_KEYS if key not in item]
        if missing:
            raise DataError(f"{self.name}: sample {index} has no {', '.join(missing)}")
        first = {key: _array(item[key])[:n] for key in _SAMPLE_KEYS}
        starts: tuple[int, ...] = (0,)
        if item.get("cu_seqlens") is not None:
            bounds = np.unique(_array(item["cu_seqlens"]))
            starts = (0, *(int(b) for b in bounds if 0 < b < n))
        return TrainingSample(
            tokens=first["tokens"].astype(np.int64),
            labels=first["labels"].astype(np.int64),
            loss_mask=first["loss_mask"].astype(np.float32),
            position_ids=first["position_ids"].astype(np.int64),
            starts=starts,
        )


def program_samples(
    dataset: Any, args: argparse.Namespace, device: torch.device, reads_samples: bool
) -> ProgramSamples:
    """The program's training `dataset` (None where its provider built none) as DynaPipe's
    samples, its lengths read on the planning rank and sent to every rank (`device`: where
    the job's collectives run). A collective: every rank calls it, saying whether it
    `reads_samples` (Megatron-LM's `get_batch` reads on each stage's tensor-parallel rank 0).
    A dataset that cannot say its lengths, or a reading rank without one, raises `DataError`
    on every rank, rank 0's naming why."""
    lacking = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    lacking[dist.get_rank()] = int(reads_samples and dataset is None)
    dist.all_reduce(lacking)
    ranks = torch.nonzero(lacking).flatten().tolist()
    if ranks:
        raise DataError(
            f"the program's dataset provider built no training dataset on rank(s) {ranks}, "
            "whose pipeline stages read DynaPipe's micro-batches: build it on every stage's "
            "tensor-parallel rank 0"
        )
    problem, lengths = "", np.zeros(0, dtype=np.int64)
    if dist.get_rank() == _SOURCE_RANK:
        try:
            lengths = _checked(sample_lengths(dataset), dataset, args.seq_length)
        except (DataError, PlanningError) as error:
            problem = str(error)
    count = torch.tensor([-1 if problem else lengths.size], dtype=torch.int64, device=device)
    dist.broadcast(count, _SOURCE_RANK)
    if int(count) < 0:
        raise DataError(problem or "the program's training dataset cannot be planned")
    shared = torch.zeros(int(count), dtype=torch.int64, device=device)
    if dist.get_rank() == _SOURCE_RANK:
        shared.copy_(torch.from_numpy(lengths))
    dist.broadcast(shared, _SOURCE_RANK)
    return ProgramSamples(dataset, shared.cpu().numpy(), args.seq_length)


def sample_lengths(dataset: Any) -> np.ndarray:
    """Every sample's length, in the ways the module docstring lists."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training.datasets.sft_dataset import SFTDataset

    if dataset is None:
        raise DataError(
            "the program's dataset provider built no training dataset on rank 0, where "
            "DynaPipe plans"
        )
    if callable(getattr(dataset, "sample_lengths", None)):
        return np.asarray(dataset.sample_lengths())
    if isinstance(dataset, BlendedDataset):
        return _blend_lengths(dataset, [sample_lengths(d) for d in dataset.datasets])
    if isinstance(dataset, SFTDataset):
        return _conversation_lengths(dataset)
    if isinstance(dataset, GPTDataset):
        return np.full(len(dataset), dataset.config.sequence_length, dtype=np.int64)
    raise DataError(
        f"the program's training dataset ({type(dataset).__name__}) does not say its samples' "
        "lengths, which DynaPipe plans over: give it a sample_lengths() method "
        "(docs/datasets.md) or train without DynaPipe's planning flags"
    )


def _blend_lengths(blend: Any, member_lengths: Sequence[np.ndarray]) -> np.ndarray:
    """A megatron-core BlendedDataset's sample i is sample `dataset_sample_index[i]` of its
    dataset `dataset_index[i]`."""
    if blend.dataset_index is None:  # deferred: megatron-core loads them on the first read
        blend[0]
    which = np.asarray(blend.dataset_index)
    nth = np.asarray(blend.dataset_sample_index)
    lengths = np.zeros(which.size, dtype=np.int64)
    for d, member in enumerate(member_lengths):
        places = which == d
        lengths[places] = np.asarray(member)[nth[places]]
    return lengths


def _conversation_lengths(dataset: Any) -> np.ndarray:
    """megatron.training's SFTDataset packs the conversations of one stored line into a sample
    and cuts at `sequence_length`: a sample's length is their token count, at most that. Its
    sample i is line `indices[i mod len(indices)]`, so each line is counted once."""
    tokenizer, cap = dataset.config.tokenizer, dataset.config.sequence_length
    lines = np.asarray(dataset.indices)[: len(dataset)]
    per_line = np.zeros(lines.size, dtype=np.int64)
    for k, line in enumerate(lines):
        # SFTDataset's own split of a stored line into conversations (a private helper of
        # megatron.training 0.19: the rule its __getitem__ packs by).
        conversations = dataset._split_conversations(dataset.dataset[int(line)])
        total = sum(
            len(tokenizer.tokenize_conversation(c, False, add_generation_prompt=False))
            for c in conversations
        )
        per_line[k] = min(total, cap)
    return per_line[np.arange(len(dataset)) % lines.size]


def _checked(lengths: np.ndarray, dataset: Any, seq_length: int) -> np.ndarray:
    """Lengths as int64, one per sample, each positive (the checks every length source shares,
    `dynapipe_planner.data.validation`) and at most seq_length; a bad one named."""
    name = f"the program's {type(dataset).__name__}"
    values = np.asarray(lengths)
    check_shape(values, name)
    if values.ndim != 1 or values.size != len(dataset):
        raise DataError(f"{name} gives {values.shape} lengths for its {len(dataset)} samples")
    if not np.issubdtype(values.dtype, np.integer):
        raise DataError(f"{name} gives sample lengths of type {values.dtype}")
    check_positive(values, lambda _: name)
    longer = np.flatnonzero(values > seq_length)
    if longer.size:
        i = int(longer[0])
        raise DataError(f"{name}: sample {i} has length {values[i]} > --seq-length {seq_length}")
    return values.astype(np.int64)


def _array(value: Any) -> np.ndarray:
    """A sample's tensor (or array) as a flat numpy array."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(-1).numpy()
    return np.asarray(value).reshape(-1)
