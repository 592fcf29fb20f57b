"""Train, validation and test datasets from Megatron's data flags, kept variable-length.

`build_datasets(args, tokenizer)` reads the namespace of Megatron's parser (`datasets(args)`
builds the tokenizer the flags name first) and honours:

- no `--data-path`: the built-in stdlib corpus (`stdlib_corpus`), tokenized by `tokenizer`;
- `--data-path ENTRY` or a blend `--data-path W1 ENTRY1 W2 ENTRY2 ...`, or several entries
  without weights (weighted by their sizes, as Megatron does); an entry is `stdlib`,
  `synthetic:<preset>`, a `.jsonl` file or a Megatron `.bin/.idx` prefix (`build_dataset`);
  `--data-args-path FILE` holds the same list;
- `--split a,b,c`: Megatron's meaning, document ranges in those proportions taken from *each*
  dataset of the blend (megatron-core parses and normalises the string; the range of a share
  [lo, hi) of n documents is [round(lo n), round(hi n)), as in megatron-core's builder). Without
  `--split` (Megatron's `validate_args` fills one in whenever `--data-path` is given) all data
  is for training;
- `--train-data-path` / `--valid-data-path` / `--test-data-path` (or
  `--per-split-data-args-path`): one blend per split, each used whole;
- `--mock-data`: megatron-core's mock GPT documents (`synthetic.mock_dataset`), in thirds as
  Megatron divides mock data, or by an explicit `--split` (which Megatron ignores for mock data).

Documents are chunked at `--seq-length` as `variable_length.VariableLengthDataset` does, and a blend
(`BlendedSamples`) offers what a single dataset offers, so the planner and executor see no
difference. `--data-cache-path` has nothing to cache here: the blend and split indices are
built in memory, in well under a second per million samples.

Bad flags raise `base.DataError` with one line naming the flag and the offending item.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dynapipe_planner.input_files import check_input_file, load_json_file

from .base import BYTE_TOKENIZER, DataError, SampleDataset, Tokenizer, TrainingSample
from .indexed import indexed_dataset
from .jsonl import jsonl_dataset
from .stdlib_corpus import stdlib_corpus
from .synthetic import mock_dataset, synthetic_dataset
from .tokenizer import build_tokenizer
from .variable_length import VariableLengthDataset

SPLIT_NAMES = ("train", "valid", "test")
_PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
# Megatron divides mock data in equal thirds when no split applies.
_MOCK_SPLIT = "1,1,1"
# One share of --split: a plain non-negative decimal (megatron-core's parser would read "1e2"
# as the two numbers 1 and 2, so anything else is refused rather than misread).
_SPLIT_SHARE = re.compile(r"\d+(\.\d*)?|\.\d+")


@dataclass(frozen=True)
class DataSplits:
    """The datasets of a job; `valid` and `test` are None when the flags give them nothing."""

    train: SampleDataset
    valid: SampleDataset | None
    test: SampleDataset | None

    def __iter__(self) -> Iterator[SampleDataset | None]:
        return iter((self.train, self.valid, self.test))


class BlendedSamples:
    """Several datasets as one, mixed in Megatron's blend proportions.

    One epoch of a blend of datasets with n_1 .. n_k samples has N = n_1 + ... + n_k samples:

    - with weights (normalised to w_d), megatron-core's `build_blending_indices` deals out the
      N places one by one, each to the dataset furthest below its share w_d of the places dealt
      so far, so dataset d fills floor(w_d N) or ceil(w_d N) of them. Its j-th place holds its
      sample p_d[j mod n_d], p_d a permutation of its samples seeded by (seed, d): a dataset
      weighted above its size repeats samples, one weighted below gives a seeded subset of them
      (the same every epoch);
    - without weights (Megatron then weights by size), `build_exhaustive_blending_indices` gives
      every sample of every dataset exactly once.

    The global-batch sampler shuffles these N samples every epoch, as it does any dataset's.
    The datasets must agree on the vocabulary, the special ids and the sequence length.
    """

    def __init__(
        self,
        name: str,
        datasets: Sequence[SampleDataset],
        weights: Sequence[float] | None,
        seed: int,
    ) -> None:
        from megatron.core.datasets import helpers
        from megatron.core.datasets.utils import normalize

        _check_agree(datasets)
        first = datasets[0]
        self.name = name
        self.max_seqlen = first.max_seqlen
        self.vocab_size, self.eod_id, self.pad_id = first.vocab_size, first.eod_id, first.pad_id
        self._datasets = list(datasets)
        sizes = np.array([len(d) for d in datasets], dtype=np.int64)
        total = int(sizes.sum())
        which = np.zeros(total, dtype=np.int16)
        nth = np.zeros(total, dtype=np.int64)
        if weights is None:
            helpers.build_exhaustive_blending_indices(which, nth, sizes, len(datasets))
        else:
            shares = np.array(normalize(list(weights)), dtype=np.float64)
            helpers.build_blending_indices(which, nth, shares, len(datasets), total, False)
        self._which = which
        self._sample = np.zeros(total, dtype=np.int64)
        self._lengths = np.zeros(total, dtype=np.int64)
        for d, dataset in enumerate(datasets):
            places = which == d
            order = np.random.default_rng([seed, d]).permutation(sizes[d])
            self._sample[places] = order[nth[places] % sizes[d]]
            self._lengths[places] = dataset.lengths()[self._sample[places]]
        self._lengths.flags.writeable = False

    def __len__(self) -> int:
        return self._lengths.size

    def __repr__(self) -> str:
        return f"BlendedSamples({self.name}, {len(self)} samples)"

    def lengths(self) -> np.ndarray:
        """Training length of every sample (int64, read-only)."""
        return self._lengths

    def tokens(self, index: int) -> np.ndarray:
        """The n_i + 1 tokens (int64) of sample `index`."""
        if not 0 <= index < len(self):
            raise DataError(f"{self.name}: no sample {index} (the blend has {len(self)})")
        return self._datasets[self._which[index]].tokens(int(self._sample[index]))

    def training_sample(self, index: int) -> TrainingSample:
        """Sample `index` as a micro-batch takes it: each token predicts the next."""
        return TrainingSample.next_token(self.tokens(index))

    def source(self, index: int) -> tuple[int, int]:
        """(dataset, sample of that dataset) that blend sample `index` is."""
        return int(self._which[index]), int(self._sample[index])


def _check_agree(datasets: Sequence[SampleDataset]) -> None:
    if not datasets:
        raise DataError("a blend needs at least one dataset")
    first = datasets[0]
    for other in datasets[1:]:
        for attribute in ("vocab_size", "eod_id", "pad_id", "max_seqlen"):
            if getattr(other, attribute) != getattr(first, attribute):
                raise DataError(
                    f"cannot blend {first.name} ({attribute} {getattr(first, attribute)}) with "
                    f"{other.name} ({attribute} {getattr(other, attribute)}): their tokenizers "
                    "or sequence lengths disagree"
                )


# ---------------------------------------------------------------- flags -> datasets


def datasets(args: argparse.Namespace) -> DataSplits:
    """The train, validation and test data the flags name, tokenized by their tokenizer."""
    return build_datasets(args, build_tokenizer(args))


_job_data: list[tuple[argparse.Namespace, DataSplits]] = []


def job_datasets(args: argparse.Namespace) -> DataSplits:
    """`datasets(args)` read once per job (per `args` object): in Megatron's loop the flags
    are checked against the data before any process group exists, and the program's dataset
    provider and DynaPipe's planner then read the same splits."""
    for held, splits in _job_data:
        if held is args:
            return splits
    splits = datasets(args)
    _job_data[:] = [(args, splits)]
    return splits


def build_datasets(args: argparse.Namespace, tokenizer: Tokenizer) -> DataSplits:
    """The train/valid/test datasets Megatron's data flags in `args` select (see the module
    docstring), every token id from `tokenizer`."""
    if args.seq_length is None:
        raise DataError("--seq-length is required: samples are documents cut at that length")
    seq_length, seed = args.seq_length, args.seed
    blend = _raw_blend(args)
    per_split = _raw_per_split_blends(args)
    if args.mock_data:
        if blend or per_split:
            flag = blend[0] if blend else "--train/valid/test-data-path"
            raise DataError(f"--mock-data makes its own documents; drop {flag} or --mock-data")
        mock = mock_dataset(seq_length, tokenizer=tokenizer)
        return _split_datasets("--mock-data", [mock], None, args.split or _MOCK_SPLIT, seed)
    if blend and per_split:
        raise DataError(
            f"{blend[0]} and --train/valid/test-data-path are exclusive (Megatron's rule): "
            "give one blend to divide by --split, or one per split"
        )
    if per_split:
        if args.split is not None:
            raise DataError(
                f"--split {args.split} divides --data-path; --train/valid/test-data-path give "
                "each split its own data"
            )
        return _per_split_datasets(per_split, seq_length, tokenizer, seed)
    if blend is None:
        corpus = stdlib_corpus(seq_length, tokenizer=tokenizer)
        return _split_datasets("the stdlib corpus", [corpus], None, args.split, seed)
    flag, values = blend
    entries, weights = parse_blend(values, flag)
    datasets = [
        build_dataset(entry, seq_length, tokenizer=tokenizer, seed=seed) for entry in entries
    ]
    return _split_datasets(flag, datasets, weights, args.split, seed)


def build_dataset(
    data_path: str | None,
    max_seqlen: int,
    *,
    tokenizer: Tokenizer = BYTE_TOKENIZER,
    seed: int = 0,
    num_samples: int = 4096,
) -> VariableLengthDataset:
    """The dataset one `--data-path` entry names, its ids from `tokenizer`.

    None or "stdlib": the built-in corpus; "synthetic:<preset>": `num_samples` SYNTHETIC samples
    drawn with `seed`; a path ending in `.jsonl`: that file ("text" or "input_ids" records);
    anything else: a Megatron `.bin/.idx` prefix.
    """
    if data_path is None or data_path == "stdlib":
        return stdlib_corpus(max_seqlen, tokenizer=tokenizer)
    if data_path.startswith("synthetic:"):
        preset = data_path.removeprefix("synthetic:")
        return synthetic_dataset(preset, num_samples, max_seqlen, seed=seed, tokenizer=tokenizer)
    if data_path.endswith(".jsonl"):
        return jsonl_dataset(data_path, max_seqlen, tokenizer=tokenizer)
    return indexed_dataset(data_path, max_seqlen, tokenizer=tokenizer)


def parse_blend(values: Sequence[str], flag: str) -> tuple[list[str], list[float] | None]:
    """(entries, weights or None) of a Megatron blend list, through megatron-core's
    `get_blend_from_list`, after the checks it leaves to asserts or misreads: every weight a
    finite non-negative number, not all zero, weights and entries in pairs."""
    from megatron.core.datasets.utils import get_blend_from_list

    values = [str(v) for v in values]
    if not values:
        raise DataError(f"{flag}: no dataset given")
    numeric = [_is_number(v) for v in values]
    if len(values) % 2 == 0 and any(numeric[0::2]) and not all(numeric[0::2]):
        bad = values[0::2][numeric[0::2].index(False)]
        raise DataError(
            f"{flag}: blend weight {bad!r} is not a number (a blend is W1 PREFIX1 W2 PREFIX2 ...)"
        )
    if len(values) % 2 == 1 and any(numeric):
        raise DataError(
            f"{flag}: {values[numeric.index(True)]!r} looks like a blend weight, but "
            f"{len(values)} entries cannot be WEIGHT PREFIX pairs"
        )
    entries, weights = get_blend_from_list(values)
    if weights is not None:
        for weight, entry in zip(weights, entries, strict=True):
            if not (math.isfinite(weight) and weight >= 0):
                raise DataError(f"{flag}: blend weight {weight} of {entry} must be >= 0 and finite")
        if sum(weights) == 0:
            raise DataError(f"{flag}: the blend weights are all zero")
    return list(entries), weights


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def split_bookends(split: str | None) -> list[tuple[float, float] | None]:
    """The [lo, hi) share of documents of each of train, valid and test (None: no share), by
    megatron-core's `parse_and_normalize_split` and `convert_split_vector_to_split_matrix`;
    None means everything is for training."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    if split is None:
        return [(0.0, 1.0), None, None]
    # Upstream's Llama-3 script passes `--split '99,1,0'` with the quotes inside its flags
    # string, so they reach the program; megatron-core reads the numbers around them.
    shares = [share.strip() for share in re.split(r"[,/]", _unquoted(split.strip()))]
    if not 1 <= len(shares) <= len(SPLIT_NAMES) or not all(
        _SPLIT_SHARE.fullmatch(share) for share in shares
    ):
        raise DataError(
            f"--split {split!r}: expected up to three non-negative numbers for train, valid "
            "and test, such as 969,30,1"
        )
    if sum(float(share) for share in shares) == 0:
        raise DataError(f"--split {split!r}: the shares are all zero")
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def _unquoted(text: str) -> str:
    """`text` without one pair of matching quotes around it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _split_datasets(
    source: str,
    datasets: Sequence[VariableLengthDataset],
    weights: Sequence[float] | None,
    split: str | None,
    seed: int,
) -> DataSplits:
    """Each split blends the same document range of every dataset (Megatron's --split); a
    validation or test share too small to hold a document of any dataset gives None."""
    splits: list[SampleDataset | None] = []
    for split_name, bookends in zip(SPLIT_NAMES, split_bookends(split), strict=True):
        if bookends is None:
            splits.append(None)
            continue
        parts, part_weights = [], []
        for index, dataset in enumerate(datasets):
            begin, end = (round(share * dataset.num_documents) for share in bookends)
            if begin < end:
                whole = (begin, end) == (0, dataset.num_documents)
                parts.append(dataset if whole else dataset.document_range(begin, end))
                part_weights.append(None if weights is None else weights[index])
        if not parts:
            splits.append(None)
            continue
        splits.append(_blend(split_name, parts, None if weights is None else part_weights, seed))
    if splits[0] is None:
        raise DataError(f"--split {split}: gives the train split no documents of {source}")
    return DataSplits(*splits)


def _per_split_datasets(
    blends: list[tuple[str, list[str]] | None],
    seq_length: int,
    tokenizer: Tokenizer,
    seed: int,
) -> DataSplits:
    if blends[0] is None:
        raise DataError("--valid/test-data-path given without --train-data-path")
    splits: list[SampleDataset | None] = []
    for split_name, blend in zip(SPLIT_NAMES, blends, strict=True):
        if blend is None:
            splits.append(None)
            continue
        entries, weights = parse_blend(blend[1], blend[0])
        datasets = [build_dataset(e, seq_length, tokenizer=tokenizer, seed=seed) for e in entries]
        splits.append(_blend(split_name, datasets, weights, seed))
    return DataSplits(*splits)


def _blend(
    split_name: str,
    datasets: Sequence[SampleDataset],
    weights: Sequence[float] | None,
    seed: int,
) -> SampleDataset:
    if len(datasets) == 1:
        return datasets[0]
    if weights is None:
        described = [d.name for d in datasets]
    else:
        described = [f"{d.name} x{w:g}" for d, w in zip(datasets, weights, strict=True)]
    return BlendedSamples(f"{split_name} blend of {'; '.join(described)}", datasets, weights, seed)


# ---------------------------------------------------------------- reading the flags


def _raw_blend(args: argparse.Namespace) -> tuple[str, list[str]] | None:
    """(flag, list) of --data-path or --data-args-path, or None."""
    data_path = getattr(args, "data_path", None)
    args_path = getattr(args, "data_args_path", None)
    if data_path is not None and args_path is not None:
        raise DataError("--data-path and --data-args-path are exclusive")
    if data_path is not None:
        return "--data-path", list(data_path)
    if args_path is not None:
        return f"--data-args-path {args_path}", _read_text(args_path, "--data-args-path").split()
    return None


def _raw_per_split_blends(args: argparse.Namespace) -> list[tuple[str, list[str]] | None] | None:
    """[(flag, list) or None] for train, valid, test from --train/valid/test-data-path or
    --per-split-data-args-path; None when neither is given."""
    lists = [getattr(args, flag[2:].replace("-", "_"), None) for flag in _PER_SPLIT_FLAGS]
    path = getattr(args, "per_split_data_args_path", None)
    if path is not None:
        if any(values is not None for values in lists):
            raise DataError(
                "--per-split-data-args-path and --train/valid/test-data-path are exclusive"
            )
        flag = f"--per-split-data-args-path {path}"
        table = load_json_file(path, "--per-split-data-args-path", DataError)
        lists = [table.get(name) for name in SPLIT_NAMES]
        lists = [values.split() if isinstance(values, str) else values for values in lists]
        return [
            None if v is None else (f"{flag} [{n}]", list(v))
            for n, v in zip(SPLIT_NAMES, lists, strict=True)
        ]
    if all(values is None for values in lists):
        return None
    return [
        None if values is None else (flag, list(values))
        for flag, values in zip(_PER_SPLIT_FLAGS, lists, strict=True)
    ]


def _read_text(path: str, flag: str) -> str:
    check_input_file(path, flag, DataError)
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{flag} {path}: cannot be read ({error})") from None
