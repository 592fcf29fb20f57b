"""Datasets from Megatron's data flags (megatron.dynapipe.data.datasets), parsed by Megatron's own
parser: a blend of two prefixes divided by --split holds exactly the documents Megatron's split
rule gives each share; weighted blends follow megatron-core's blending order; per-split paths,
--mock-data and the default stdlib corpus; data written directly by megatron-core's
IndexedDatasetBuilder with BPE ids trains, and fails at load under a tokenizer it does not fit;
bad flags give one line naming the item.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from dynapipe_planner.plan import MicroBatch
from megatron.dynapipe.data.base import BYTE_EOD, BYTE_TOKENIZER, DataError
from megatron.dynapipe.data.datasets import BlendedSamples, build_datasets
from megatron.dynapipe.data.microbatches import microbatch_tensors
from megatron.dynapipe.data.stdlib_corpus import stdlib_files, stdlib_texts
from megatron.dynapipe.data.tokenizer import build_tokenizer
from megatron.dynapipe.data.variable_length import VariableLengthDataset, in_memory_dataset

pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning")

DOCUMENTS = 10
FIRST_ID = {"a": 10, "b": 30}  # document j of dataset x repeats id FIRST_ID[x] + j


def _write_prefix(path: Path, documents: list[list[int]], dtype=np.uint16) -> str:
    """A Megatron dataset written by megatron-core's own IndexedDatasetBuilder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{path}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(np.array(document), [len(document)])
    builder.finalize(f"{path}.idx")
    return str(path)


@pytest.fixture
def prefixes(tmp_path: Path) -> dict[str, str]:
    """Two byte-level datasets of DOCUMENTS documents, each naming itself by its ids."""
    return {
        name: _write_prefix(
            tmp_path / name,
            [[first + j] * (2 + j % 3) + [BYTE_EOD] for j in range(DOCUMENTS)],
        )
        for name, first in FIRST_ID.items()
    }


def _documents(dataset) -> list[tuple[str, int]]:
    """(dataset, document) of every sample, from its tokens."""
    found = []
    for i in range(len(dataset)):
        tokens = dataset.tokens(i)
        assert dataset.lengths()[i] == tokens.size - 1
        name = "a" if tokens[0] < FIRST_ID["b"] else "b"
        found.append((name, int(tokens[0]) - FIRST_ID[name]))
    return found


def _expected(documents: range) -> list[tuple[str, int]]:
    return sorted((name, j) for name in FIRST_ID for j in documents)


@pytest.mark.parametrize("through", ["--data-path", "--data-args-path"])
def test_blend_of_two_prefixes_with_split(through, prefixes, megatron_args, tmp_path) -> None:
    if through == "--data-path":
        flags = ["--data-path", prefixes["a"], prefixes["b"]]
    else:
        listing = tmp_path / "blend.txt"
        listing.write_text(f"{prefixes['a']}\n{prefixes['b']}\n")
        flags = ["--data-args-path", str(listing)]
    args = megatron_args(*flags, "--split", "6,2,2", "--seq-length", "64")
    splits = build_datasets(args, BYTE_TOKENIZER)
    # Megatron's rule: share [lo, hi) of 10 documents is [round(10 lo), round(10 hi)).
    for dataset, documents in zip(splits, (range(0, 6), range(6, 8), range(8, 10)), strict=True):
        assert isinstance(dataset, BlendedSamples)
        assert sorted(_documents(dataset)) == _expected(documents)  # each sample exactly once
        assert (dataset.vocab_size, dataset.eod_id, dataset.pad_id) == (258, 256, 257)
        assert dataset.max_seqlen == 64
    # The executor's micro-batch tensors read a blend as they read one dataset.
    train = splits.train
    batch = microbatch_tensors(MicroBatch(id=0, replica=0, samples=[0, 1], seqlen=8), train)
    rows, labels = batch.tokens.reshape(2, 8), batch.labels.reshape(2, 8)  # one THD sequence
    for row, sample in enumerate((0, 1)):
        tokens = train.tokens(sample)
        assert rows[row, : tokens.size - 1].tolist() == tokens[:-1].tolist()
        assert labels[row, : tokens.size - 1].tolist() == tokens[1:].tolist()


def test_weighted_blend_follows_megatron_blending_order(prefixes, megatron_args) -> None:
    flags = ["--data-path", "3", prefixes["a"], "1", prefixes["b"], "--split", "100,0,0"]
    flags += ["--seq-length", "64"]
    splits = build_datasets(megatron_args(*flags), BYTE_TOKENIZER)
    assert splits.valid is None and splits.test is None
    train = splits.train
    assert len(train) == 2 * DOCUMENTS  # an epoch: as many samples as the datasets hold
    sources = [train.source(i)[0] for i in range(len(train))]
    # megatron-core deals each place to the dataset furthest below its share (3/4, 1/4).
    for m in range(1, len(train) + 1):
        assert abs(sources[:m].count(0) - 0.75 * m) <= 1
    documents = Counter(_documents(train))
    a = [documents[("a", j)] for j in range(DOCUMENTS)]
    b = [documents[("b", j)] for j in range(DOCUMENTS)]
    assert sum(a) == 15 and set(a) == {1, 2}  # every sample of a once, five of them twice
    assert sum(b) == 5 and set(b) == {0, 1}  # a seeded subset of b
    reseeded = build_datasets(megatron_args(*flags, "--seed", "7"), BYTE_TOKENIZER)
    assert Counter(_documents(reseeded.train)) != documents


@pytest.mark.filterwarnings("ignore:Please specify --split:UserWarning")
def test_validate_args_default_split_gives_small_shares_none(prefixes, megatron_args) -> None:
    """Megatron's validate_args fills in --split 969,30,1; a share that rounds to no document
    of 10 gives no dataset rather than an empty one."""
    from megatron.training.arguments import validate_args

    args = megatron_args(
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--train-iters", "1", "--data-path", prefixes["a"],
    )  # fmt: skip
    validate_args(args)
    splits = build_datasets(args, BYTE_TOKENIZER)
    assert args.split == "969, 30, 1"
    assert isinstance(splits.train, VariableLengthDataset) and splits.train.num_documents == 10
    assert splits.valid is None and splits.test is None


def test_per_split_paths_use_each_blend_whole(prefixes, megatron_args) -> None:
    args = megatron_args(
        "--train-data-path", prefixes["a"], "--valid-data-path", "1", prefixes["a"], "1",
        prefixes["b"], "--seq-length", "64",
    )  # fmt: skip
    splits = build_datasets(args, BYTE_TOKENIZER)
    assert sorted(_documents(splits.train)) == [("a", j) for j in range(DOCUMENTS)]
    assert sorted(_documents(splits.valid)) == _expected(range(DOCUMENTS))
    assert splits.test is None


def test_per_split_paths_from_a_json_file(prefixes, megatron_args, tmp_path) -> None:
    """`--per-split-data-args-path`: the same blends from a JSON object of lists (or strings);
    a file that is not one such object is one line naming the flag and the file."""
    table = tmp_path / "splits.json"
    table.write_text(
        json.dumps({"train": [prefixes["a"]], "valid": f"1 {prefixes['a']} 1 {prefixes['b']}"})
    )
    args = megatron_args("--per-split-data-args-path", str(table), "--seq-length", "64")
    splits = build_datasets(args, BYTE_TOKENIZER)
    assert sorted(_documents(splits.train)) == [("a", j) for j in range(DOCUMENTS)]
    assert sorted(_documents(splits.valid)) == _expected(range(DOCUMENTS))
    assert splits.test is None
    flag = f"--per-split-data-args-path {table}"
    for text, why in [("[1]", "its top level is an array"), ("{", "not valid JSON (Expecting")]:
        table.write_text(text)
        with pytest.raises(DataError, match=re.escape(f"{flag}: {why}")):
            build_datasets(args, BYTE_TOKENIZER)


def test_megatron_builder_data_with_bpe_ids_loads(gpt2_bpe, megatron_args, tmp_path) -> None:
    """The issue's case: ids written by megatron-core's builder train under the tokenizer that
    wrote them, and fail when opened (not mid-training) under one they do not fit."""
    bpe, eod = gpt2_bpe.reference(), gpt2_bpe.eod_id()
    documents = [[*bpe.encode(text).ids, eod] for _, text in stdlib_texts(max_documents=4)]
    prefix = _write_prefix(tmp_path / "bpe", documents)
    flags = ["--data-path", prefix, "--split", "1,0,0", "--seq-length", "1000000"]
    args = megatron_args(*flags, *gpt2_bpe.flags())
    train = build_datasets(args, build_tokenizer(args)).train
    assert [train.tokens(i).tolist() for i in range(len(train))] == documents
    first_bad = next(j for j, d in enumerate(documents) if max(d) >= 258)
    with pytest.raises(DataError, match=rf"{prefix}.bin: document {first_bad} has token id"):
        build_datasets(megatron_args(*flags), BYTE_TOKENIZER)


def test_mock_data_is_megatrons_mock_documents_variable_length(megatron_args) -> None:
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    args = megatron_args("--mock-data", "--seq-length", "256", "--tokenizer-type",
                         "NullTokenizer", "--vocab-size", "1000")  # fmt: skip
    splits = build_datasets(args, build_tokenizer(args))
    mock = MockGPTLowLevelDataset(SimpleNamespace(vocab_size=1000, eod=999))
    total = len(mock)
    bounds = [0, round(total / 3), round(2 * total / 3), total]  # Megatron's mock thirds
    for dataset, begin, end in zip(splits, bounds, bounds[1:], strict=False):
        assert dataset.num_documents == end - begin
        first = next(d for d in range(begin, end) if mock.sequence_lengths[d] >= 2)
        expected = mock[first][:257]
        assert dataset.tokens(0).tolist() == expected.tolist()
        assert dataset.lengths().max() == 256
    assert (splits.train.vocab_size, splits.train.eod_id) == (1000, 999)


def test_no_data_path_gives_the_stdlib_corpus_divided_by_split(megatron_args) -> None:
    splits = build_datasets(
        megatron_args("--seq-length", "4096", "--split", "98,2,0"), BYTE_TOKENIZER
    )
    files = len(stdlib_files())
    assert splits.train.num_documents == round(0.98 * files)
    assert splits.valid.num_documents == files - round(0.98 * files)
    assert splits.test is None
    assert splits.train.name.startswith("stdlib corpus")


def test_blend_entries_may_be_jsonl_and_synthetic(tmp_path, megatron_args) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "abc"}\n{"text": "de"}\n')
    args = megatron_args("--data-path", str(path), "synthetic:flan", "--seq-length", "128")
    train = build_datasets(args, BYTE_TOKENIZER).train
    assert len(train) == 2 + 4096  # sizes weight the blend: every sample once
    from_jsonl = [i for i in range(len(train)) if train.source(i)[0] == 0]
    assert sorted(bytes(train.tokens(i)[:-1].tolist()) for i in from_jsonl) == [b"abc", b"de"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-path", "{a}", "{tmp}/missing"], r"{tmp}/missing.idx: no such file"),
        (["--data-path", "0.5", "{a}", "x", "{b}"], r"--data-path: blend weight 'x' is not a"),
        (["--data-path", "0.5", "{a}", "{b}"], r"--data-path: '0.5' looks like a blend weight"),
        (["--data-path", "nan", "{a}", "1", "{b}"], r"blend weight nan of {a} must be >= 0"),
        (["--data-path", "0", "{a}", "0", "{b}"], r"--data-path: the blend weights are all zero"),
        (["--data-path", "{a}", "--split", "90,x,5"], r"--split '90,x,5': expected up to three"),
        (["--data-path", "{a}", "--split", "1,2,3,4"], r"--split '1,2,3,4': expected up to three"),
        (["--data-path", "{a}", "--split", "1e2,1"], r"--split '1e2,1': expected up to three"),
        (["--data-path", "{a}", "--split", "0,0,0"], r"--split '0,0,0': the shares are all zero"),
        (["--data-path", "{a}", "--split", "0,1,0"], r"gives the train split no documents"),
        (["--mock-data", "--data-path", "{a}"], r"--mock-data makes its own documents"),
        (["--data-path", "{a}", "--train-data-path", "{b}"], r"are exclusive"),
        (["--train-data-path", "{a}", "--split", "1,1,1"], r"--split 1,1,1 divides --data-path"),
        (["--valid-data-path", "{a}"], r"without --train-data-path"),
        (["--data-args-path", "{tmp}/none.txt"], r"--data-args-path {tmp}/none.txt: cannot be"),
    ],
)  # fmt: skip
def test_bad_data_flags_give_one_line(flags, message, prefixes, megatron_args, tmp_path) -> None:
    def fill(text: str) -> str:
        return text.format(a=prefixes["a"], b=prefixes["b"], tmp=tmp_path)

    args = megatron_args(*map(fill, flags), "--seq-length", "64")
    with pytest.raises(DataError, match=fill(message)) as raised:
        build_datasets(args, BYTE_TOKENIZER)
    assert "\n" not in str(raised.value)


def test_a_quoted_split_reads_as_megatron_core_reads_it() -> None:
    """Upstream's Llama-3 script hands the program `'99,1,0'`, quotes included."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megatron.dynapipe.data.datasets import split_bookends

    core = convert_split_vector_to_split_matrix(parse_and_normalize_split("'99,1,0'"))
    assert split_bookends("'99,1,0'") == split_bookends('"99,1,0"') == core
    with pytest.raises(DataError, match="expected up to three"):
        split_bookends("'99,1,0")  # unmatched: not a quoted split


def test_datasets_of_different_tokenizers_do_not_blend() -> None:
    documents = [np.array([1, 2, 3])]
    byte = in_memory_dataset("bytes", documents, 16, vocab_size=258, eod_id=256, pad_id=257)
    other = in_memory_dataset("bpe", documents, 16, vocab_size=500, eod_id=0, pad_id=0)
    message = r"cannot blend bytes \(vocab_size 258\) with bpe \(vocab_size 500\)"
    with pytest.raises(DataError, match=message):
        BlendedSamples("x", [byte, other], None, seed=0)
