"""Runtime data (megatron.dynapipe.data.*, tools/preprocess_data.py): exact micro-batch tensors for
padded and packed rows, the built-in stdlib corpus, chunking that keeps every label, the jsonl ->
Megatron .bin/.idx round trip with the byte tokenizer, errors that name the file, and resumable
global batches. Megatron's tokenizers and data flags: test_tokenizer.py, test_datasets.py,
test_preprocess_data.py.

Skipped when the `runtime` extra (torch, megatron-core) is not installed.
"""

from __future__ import annotations

import json
import re
import sysconfig
from itertools import chain, islice
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.utils import flatten_batch_for_packed_sequences  # noqa: E402

from dynapipe_planner.data import global_batches, load_lengths, sample_lengths  # noqa: E402
from dynapipe_planner.plan import ExecutionPlan, MicroBatch  # noqa: E402
from megatron.dynapipe.data.base import (  # noqa: E402
    BYTE_EOD,
    BYTE_PAD,
    BYTE_TOKENIZER,
    ByteTokenizer,
    DataError,
)
from megatron.dynapipe.data.datasets import build_dataset  # noqa: E402
from megatron.dynapipe.data.indexed import indexed_dataset  # noqa: E402
from megatron.dynapipe.data.jsonl import jsonl_dataset  # noqa: E402
from megatron.dynapipe.data.microbatches import (  # noqa: E402
    microbatch_tensors,
    rank_microbatches,
    with_empty_rows,
)
from megatron.dynapipe.data.sampler import GlobalBatchSampler  # noqa: E402
from megatron.dynapipe.data.stdlib_corpus import stdlib_corpus, stdlib_files  # noqa: E402
from megatron.dynapipe.data.synthetic import synthetic_dataset  # noqa: E402
from megatron.dynapipe.data.variable_length import in_memory_dataset  # noqa: E402

# megatron-core's index reader logs "on rank 0 only" and warns outside torch.distributed.
pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning")

PAD, EOD = BYTE_PAD, BYTE_EOD


@pytest.fixture
def preprocess(preprocess_tool):
    return preprocess_tool


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def abc(tmp_path: Path):
    """Samples 0, 1, 2 with tokens [10 11 12 EOD], [20 21 EOD], [30 .. 34 EOD]."""
    records = [
        {"input_ids": [10, 11, 12]},
        {"input_ids": [20, 21]},
        {"input_ids": list(range(30, 35))},
    ]
    return jsonl_dataset(_write_jsonl(tmp_path / "abc.jsonl", records), max_seqlen=64)


# ---------------------------------------------------------------- micro-batch tensors


def test_padded_microbatch_tensors_exact(abc) -> None:
    assert abc.lengths().tolist() == [3, 2, 5]
    t = microbatch_tensors(MicroBatch(id=7, replica=0, samples=[1, 0], seqlen=4), abc)
    # one THD sequence of its rows: each row's sample, then its padding, attend within themselves
    assert t.tokens.tolist() == [[20, 21, PAD, PAD, 10, 11, 12, PAD]]
    assert t.labels.tolist() == [[21, EOD, PAD, PAD, 11, 12, EOD, PAD]]
    assert t.loss_mask.dtype == torch.float32
    assert t.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1, 1, 0]]
    assert t.position_ids.tolist() == [[0, 1, 0, 1, 0, 1, 2, 0]]
    assert t.cu_seqlens.tolist() == [0, 2, 4, 7, 8] and t.row_length == 4
    assert t.num_tokens == 5
    assert t.tokens.dtype == t.labels.dtype == t.position_ids.dtype == torch.int64
    moved = t.to("cpu")
    assert torch.equal(moved.tokens, t.tokens) and moved.num_tokens == 5


def test_packed_microbatch_is_one_thd_sequence(abc) -> None:
    mb = MicroBatch(id=3, replica=0, samples=[0, 1, 2], seqlen=6, row_sizes=[2, 1])
    t = microbatch_tensors(mb, abc)
    assert t.tokens.tolist() == [[10, 11, 12, 20, 21, PAD, 30, 31, 32, 33, 34, PAD]]
    assert t.labels.tolist() == [[11, 12, EOD, 21, EOD, PAD, 31, 32, 33, 34, EOD, PAD]]
    assert t.loss_mask.tolist() == [[1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]]
    assert t.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 0]]
    # sample 0 | sample 1 | row 0's padding | sample 2 | row 1's padding
    assert t.cu_seqlens.dtype == torch.int32 and t.cu_seqlens.tolist() == [0, 3, 5, 6, 11, 12]
    params = t.packed_seq_params("cpu")
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 5
    assert torch.equal(params.cu_seqlens_q, t.cu_seqlens) and t.num_tokens == 10
    # Megatron's --dataloader-inter-document-masking form: rows, per-row bounds padded with s
    batch = t.megatron_batch("cpu")
    assert batch["attention_mask"] is None
    assert batch["tokens"].tolist() == [[10, 11, 12, 20, 21, PAD], [30, 31, 32, 33, 34, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]
    assert batch["cu_seqlens"].dtype == batch["max_seqlen"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [[0, 3, 5, 6, 6, 6, 6], [0, 5, 6, 6, 6, 6, 6]]
    assert batch["max_seqlen"].tolist() == [3, 5]
    flat = flatten_batch_for_packed_sequences(dict(batch))  # what Megatron-LM's get_batch does
    assert flat["cu_seqlens"].tolist() == [t.cu_seqlens.tolist()]
    assert torch.equal(flat["tokens"], t.tokens) and flat["max_seqlen"].tolist() == [5]
    # the same samples padded one per row, in the same form: each row its sample and padding
    padded = microbatch_tensors(MicroBatch(id=4, replica=0, samples=[0, 1, 2], seqlen=6), abc)
    rows = padded.megatron_batch("cpu")
    assert rows["attention_mask"] is None and rows["max_seqlen"].tolist() == [3, 4, 5]
    assert rows["cu_seqlens"][:, :4].tolist() == [[0, 3, 6, 6], [0, 2, 6, 6], [0, 5, 6, 6]]


def test_a_row_filled_to_the_end_still_starts_a_segment(abc) -> None:
    mb = MicroBatch(id=1, replica=0, samples=[0, 0], seqlen=3, row_sizes=[1, 1])
    assert microbatch_tensors(mb, abc).cu_seqlens.tolist() == [0, 3, 6]


def test_empty_rows_top_up_a_fixed_shape_microbatch(abc) -> None:
    mb = MicroBatch(id=3, replica=0, samples=[0, 1], seqlen=4)
    t = microbatch_tensors(mb, abc)
    full = with_empty_rows(t, 3, 4, PAD)
    assert full.tokens.shape == (1, 12)
    assert torch.equal(full.tokens[:, :8], t.tokens) and torch.equal(full.labels[:, :8], t.labels)
    assert full.tokens[0, 8:].tolist() == full.labels[0, 8:].tolist() == [PAD] * 4
    assert full.loss_mask[0, 8:].tolist() == [0, 0, 0, 0] and full.num_tokens == t.num_tokens
    assert full.position_ids[0, 8:].tolist() == [0, 1, 2, 3]
    assert full.cu_seqlens.tolist() == [*t.cu_seqlens.tolist(), 12]
    assert with_empty_rows(t, 2, 4, PAD) is t
    with pytest.raises(DataError, match="more than 1"):
        with_empty_rows(t, 1, 4, PAD)


def test_empty_rows_extend_a_packed_microbatch_as_segments(abc) -> None:
    mb = MicroBatch(id=3, replica=0, samples=[0, 1], seqlen=6, row_sizes=[2])
    t = microbatch_tensors(mb, abc)
    full = with_empty_rows(t, 3, 6, PAD)
    assert full.tokens.shape == (1, 18)
    assert full.tokens[0, 6:].tolist() == [PAD] * 12 and full.loss_mask[0, 6:].sum() == 0
    assert full.position_ids[0, 6:].tolist() == [*range(6), *range(6)]
    assert full.cu_seqlens.tolist() == [0, 3, 5, 6, 12, 18] and full.num_tokens == 5


@pytest.mark.parametrize(
    ("mb", "message"),
    [
        (
            MicroBatch(id=5, replica=0, samples=[2], seqlen=4),
            "micro-batch 5: sample 2 has training length 5",
        ),
        (
            MicroBatch(id=6, replica=0, samples=[0, 1], seqlen=4, row_sizes=[2]),
            "micro-batch 6: packed row 0 (samples [0, 1]) holds 5 tokens",
        ),
        (MicroBatch(id=8, replica=0, samples=[9], seqlen=4), "micro-batch 8: sample 9 is not in"),
        (
            MicroBatch(id=9, replica=0, samples=[0, 1], seqlen=8, row_sizes=[1]),
            "micro-batch 9: row_sizes",
        ),
    ],
)
def test_microbatch_that_does_not_fit_names_microbatch_and_sample(abc, mb, message) -> None:
    with pytest.raises(DataError, match=re.escape(message)):
        microbatch_tensors(mb, abc)


def test_rank_microbatches_takes_only_its_replica(abc) -> None:
    mbs = [
        MicroBatch(id=0, replica=0, samples=[0], seqlen=4),
        MicroBatch(id=1, replica=1, samples=[1], seqlen=2),
        MicroBatch(id=2, replica=0, samples=[2, 1], seqlen=5),
    ]
    plan = ExecutionPlan(num_stages=1, num_replicas=2, microbatches=mbs, ranks=[])
    batches = rank_microbatches(plan, 0, abc)
    assert sorted(batches) == [0, 2]
    assert batches[2].tokens.shape == (1, 10) and batches[2].num_tokens == 7


# ---------------------------------------------------------------- datasets


def test_stdlib_corpus_is_deterministic_long_tailed_and_capped() -> None:
    first = stdlib_corpus(1 << 20, max_documents=200)
    again = stdlib_corpus(1 << 20, max_documents=200)
    lengths = first.lengths()
    assert np.array_equal(lengths, again.lengths())
    assert all(np.array_equal(first.tokens(i), again.tokens(i)) for i in (0, 57, len(first) - 1))
    assert lengths.max() > 8 * np.median(lengths)  # real source files: a long tail
    tokens = first.tokens(int(np.argmax(lengths)))
    assert tokens[-1] == EOD and tokens[:-1].max() < 256  # bytes, then EOD
    assert (first.vocab_size, first.eod_id, first.pad_id) == (258, 256, 257)
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "test", "tests"}
    assert not any(skipped & set(path.relative_to(root).parts) for path in stdlib_files())
    chunked = stdlib_corpus(512, max_bytes=200_000)
    assert chunked.lengths().max() == 512 and chunked.lengths().min() >= 1


@pytest.mark.parametrize("max_seqlen", [1, 3, 4])
def test_chunking_keeps_every_label_once(tmp_path: Path, max_seqlen: int) -> None:
    documents = [list(range(n)) for n in range(0, 12)]  # + EOD: 1..12 tokens
    path = _write_jsonl(tmp_path / "docs.jsonl", [{"input_ids": d} for d in documents])
    dataset = jsonl_dataset(path, max_seqlen)
    assert dataset.lengths().min() >= 1 and dataset.lengths().max() <= max_seqlen
    samples = [dataset.tokens(i) for i in range(len(dataset))]
    assert [s.size - 1 for s in samples] == dataset.lengths().tolist()
    labels = np.concatenate([s[1:] for s in samples])
    expected = np.concatenate([np.array([*d, EOD])[1:] for d in documents])
    assert np.array_equal(labels, expected)


def test_jsonl_lengths_match_the_planners_reader(tmp_path: Path) -> None:
    texts = ["def f():\n    return 1\n", "héllo wörld", "x" * 300]
    path = _write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    assert np.array_equal(jsonl_dataset(path, 4096).lengths(), load_lengths(path))


def test_preprocess_round_trip_gives_identical_tokens(tmp_path: Path, preprocess) -> None:
    records = [{"text": "import os\n" * 7}, {"text": "ünïcode ✓"}, {"text": ""}, {"text": "a" * 40}]
    path = _write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    args = ["--input", str(path), "--output-prefix", str(out / "corpus"), "--append-eod"]
    assert preprocess.main(args) == 0
    prefix = out / "corpus_text_document"
    assert sorted(p.name for p in out.iterdir()) == [f"{prefix.name}.bin", f"{prefix.name}.idx"]
    for max_seqlen in (16, 4096):
        from_jsonl = jsonl_dataset(path, max_seqlen)
        from_idx = indexed_dataset(prefix, max_seqlen, tokenizer=BYTE_TOKENIZER)
        assert np.array_equal(from_jsonl.lengths(), from_idx.lengths())
        for i in range(len(from_jsonl)):
            assert np.array_equal(from_jsonl.tokens(i), from_idx.tokens(i))
    from_bin = indexed_dataset(f"{prefix}.bin", 16, tokenizer=BYTE_TOKENIZER)
    assert len(from_bin) == len(jsonl_dataset(path, 16))


def test_preprocess_failure_leaves_no_output(tmp_path: Path, preprocess, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    assert preprocess.main(["--input", str(path), "--output-prefix", str(tmp_path / "o")]) == 2
    assert f"{path} line 2: invalid JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_stdlib_preprocess_loads_like_the_builtin_corpus(tmp_path: Path, preprocess) -> None:
    args = ["--input", "stdlib", "--output-prefix", str(tmp_path / "stdlib"), "--append-eod"]
    assert preprocess.main([*args, "--max-documents", "40"]) == 0
    builtin = stdlib_corpus(256, max_documents=40)
    stored = build_dataset(str(tmp_path / "stdlib_text_document"), 256)
    assert np.array_equal(builtin.lengths(), stored.lengths())
    assert np.array_equal(builtin.tokens(len(builtin) - 1), stored.tokens(len(stored) - 1))


def test_synthetic_dataset_follows_the_preset() -> None:
    dataset = build_dataset("synthetic:flan", 1024, seed=3, num_samples=200)
    assert np.array_equal(dataset.lengths(), sample_lengths("flan", 200, seed=3, max_seqlen=1024))
    tokens = dataset.tokens(17)
    assert tokens[-1] == dataset.eod_id == EOD and tokens[:-1].max() < 256
    assert dataset.pad_id == PAD
    again = synthetic_dataset("flan", 200, 1024, seed=3)
    assert np.array_equal(again.tokens(17), tokens)


def test_synthetic_ids_avoid_the_special_ids_of_any_tokenizer() -> None:
    """Ordinary ids are drawn around EOD and pad wherever the tokenizer puts them."""
    tokenizer = ByteTokenizer(name="test", vocab_size=6, eod_id=1, pad_id=4)
    dataset = synthetic_dataset("lognormal", 50, 64, seed=2, tokenizer=tokenizer)
    samples = [dataset.tokens(i) for i in range(len(dataset))]
    assert all(s[-1] == 1 for s in samples)
    ordinary = np.concatenate([s[:-1] for s in samples])
    assert set(ordinary.tolist()) == {0, 2, 3, 5}


# ---------------------------------------------------------------- errors name the file


def test_corrupt_index_is_reported_with_its_path(tmp_path: Path, preprocess) -> None:
    path = _write_jsonl(tmp_path / "in.jsonl", [{"text": "some text"}, {"text": "more"}])
    assert preprocess.main(["--input", str(path), "--output-prefix", str(tmp_path / "d")]) == 0
    prefix = tmp_path / "d_text_document"
    index = Path(f"{prefix}.idx")
    intact = index.read_bytes()
    index.write_bytes(intact[: len(intact) - 5])
    with pytest.raises(DataError, match=rf"{index}: truncated Megatron index"):
        indexed_dataset(prefix, 16, tokenizer=BYTE_TOKENIZER)
    index.write_bytes(b"NOTMEGA" + intact[7:])
    with pytest.raises(DataError, match=rf"{index}: not a Megatron index"):
        indexed_dataset(prefix, 16, tokenizer=BYTE_TOKENIZER)
    index.write_bytes(intact)
    data = Path(f"{prefix}.bin")
    data.write_bytes(data.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{data}: corrupt Megatron data file"):
        indexed_dataset(prefix, 16, tokenizer=BYTE_TOKENIZER)


def test_out_of_vocabulary_token_fails_when_opened(tmp_path: Path) -> None:
    """Ids are checked when the dataset opens, naming the .bin and the document, not when a
    sample is read mid-training."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "wide")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    builder.add_document(np.array([1, 2, EOD]), [3])
    builder.add_document(np.array([1, 2, 5000, EOD]), [4])
    builder.finalize(f"{prefix}.idx")
    message = rf"{prefix}.bin: document 1 has token id 5000 outside the tokenizer's vocabulary"
    with pytest.raises(DataError, match=message):
        indexed_dataset(prefix, 16, tokenizer=BYTE_TOKENIZER)
    with pytest.raises(DataError, match=r"test: document 2 has token id -1 outside"):
        in_memory_dataset(
            "test", [np.array([1, 2]), np.array([3]), np.array([4, -1])], 16,
            vocab_size=8, eod_id=6, pad_id=7,
        )  # fmt: skip


def test_vocabulary_check_scans_in_chunks_with_progress(tmp_path: Path, monkeypatch, capsys):
    """Big files are compared chunk by chunk (here 4 ids a chunk) with a progress line each;
    the first bad id past a chunk boundary is still traced to its document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    monkeypatch.setattr("megatron.dynapipe.data.variable_length._ID_CHECK_CHUNK", 4)
    monkeypatch.setattr("megatron.dynapipe.data.indexed._ID_CHECK_PROGRESS_BYTES", 1)
    prefix = str(tmp_path / "chunked")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in ([1, 2, 3], [4, 5, 6, EOD], [7, 8, 9, 300, 10]):
        builder.add_document(np.array(document), [len(document)])
    builder.finalize(f"{prefix}.idx")
    with pytest.raises(DataError, match=rf"{prefix}.bin: document 2 has token id 300 outside"):
        indexed_dataset(prefix, 16, tokenizer=BYTE_TOKENIZER)
    assert capsys.readouterr().err.splitlines() == [
        f"{prefix}.bin: token ids checked, 33%",
        f"{prefix}.bin: token ids checked, 67%",
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n\n{"text": "a"\n', r"line 3: invalid JSON"),
        ('{"text": "ok"}\n{"body": "a"}\n', r"line 2: missing field 'text'"),
        (
            '{"input_ids": [1, 2]}\n{"input_ids": [1, 999]}\n',
            r"line 2: field 'input_ids' has token id 999 outside the vocabulary \[0, 258\)",
        ),
        (
            '{"input_ids": [1, "a"]}\n',
            r"line 1: field 'input_ids' must be text or a list of token ids",
        ),
        ('{"input_ids": "hello"}\n', r"field 'input_ids' must be a flat list of integer token"),
        ('{"text": 12345}\n', r"line 1: field 'text' must be a string, got '12345'"),
        ("[1, 2]\n", r"line 1: expected a JSON object"),
        ('{"body": "a"}\n', r"line 1: none of the fields text, input_ids"),
        ("\n", r": no samples"),
    ],
)
def test_bad_jsonl_is_reported_with_path_and_line(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{path}.*{message}"):
        jsonl_dataset(path, 16)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"{tmp_path / 'nope.jsonl'}: no such file"):
        build_dataset(str(tmp_path / "nope.jsonl"), 16)
    with pytest.raises(DataError, match=rf"{tmp_path / 'nope.idx'}: no such file"):
        build_dataset(str(tmp_path / "nope"), 16)
    with pytest.raises(DataError, match="unknown length preset 'zipf'"):
        build_dataset("synthetic:zipf", 16)


# ---------------------------------------------------------------- global batches


def _take(sampler: GlobalBatchSampler, count: int) -> list[tuple[int, list[int]]]:
    return [(iteration, batch.tolist()) for iteration, batch in islice(sampler, count)]


def test_global_batch_sampler_is_deterministic_across_epochs() -> None:
    lengths = sample_lengths("lognormal", 40, seed=1, max_seqlen=512)
    sampler = GlobalBatchSampler(lengths, tokens_per_batch=2048, seed=5)
    batches = _take(sampler, 30)
    assert sampler.epoch >= 2  # crossed epoch boundaries
    assert [i for i, _ in batches] == list(range(30))
    assert batches == _take(GlobalBatchSampler(lengths, 2048, seed=5), 30)
    assert batches != _take(GlobalBatchSampler(lengths, 2048, seed=6), 30)
    epoch0 = [b.tolist() for b in global_batches(lengths, 2048, seed=5, epoch=0)]
    assert [b for _, b in batches[: len(epoch0)]] == epoch0
    assert sorted(chain(*epoch0)) == list(range(lengths.size))


def test_global_batch_sampler_resumes_where_it_stopped() -> None:
    lengths = sample_lengths("lognormal", 40, seed=1, max_seqlen=512)
    uninterrupted = _take(GlobalBatchSampler(lengths, 2048, seed=5), 25)
    first = GlobalBatchSampler(lengths, 2048, seed=5)
    _take(first, 11)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = GlobalBatchSampler(lengths, 2048, seed=5)
    resumed.load_state_dict(state)
    assert _take(resumed, 14) == uninterrupted[11:]
    with pytest.raises(DataError, match="seed=5, this run has 6"):
        GlobalBatchSampler(lengths, 2048, seed=6).load_state_dict(state)


def test_a_reader_continues_from_the_samplers_place_on_its_own() -> None:
    """The planning service's reader and the rank's sampler each see every batch once, across
    epochs, whichever advances first."""
    lengths = sample_lengths("lognormal", 40, seed=1, max_seqlen=512)
    uninterrupted = _take(GlobalBatchSampler(lengths, 2048, seed=5), 30)
    sampler = GlobalBatchSampler(lengths, 2048, seed=5)
    _take(sampler, 3)
    reader = sampler.reader()
    assert _take(reader, 27) == uninterrupted[3:]  # past the epochs the sampler has not seen
    assert reader.epoch > sampler.epoch
    assert _take(sampler, 27) == uninterrupted[3:]
