"""tools/preprocess_data.py with upstream Megatron-LM's flags: a GPT-2 BPE trained here (no
download) writes `<prefix>_<key>_document.bin/.idx` whose sequences, read back by megatron-core's
own IndexedDataset and by the runtime's loader, are exactly the tokenizer's ids (+ EOD with
--append-eod); several --json-keys give one dataset each; --workers does not change a byte; ids
past the vocabulary, bad tokenizer flags and unsupported upstream options fail in one line
naming the item and leave nothing behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

pytest.importorskip("megatron.core")

from megatron.dynapipe.data.base import BYTE_TOKENIZER
from megatron.dynapipe.data.indexed import indexed_dataset
from megatron.dynapipe.data.stdlib_corpus import stdlib_texts
from megatron.dynapipe.data.tokenizer import build_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning")

TEXTS = ["def f(x):\n    return x + 1\n", "ünïcode ✓ and  spaces", "import os\n" * 5, "x"]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _megatron_sequences(prefix: Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def _files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_gpt2_bpe_preprocess_writes_the_tokenizers_ids(
    gpt2_bpe, preprocess_tool, megatron_args, tmp_path
) -> None:
    source = _jsonl(tmp_path / "in.jsonl", [{"text": text} for text in TEXTS])
    out = tmp_path / "out"
    flags = ["--input", str(source), "--output-prefix", str(out / "corpus"), "--append-eod"]
    assert preprocess_tool.main([*flags, *gpt2_bpe.flags()]) == 0
    assert _files(out) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    prefix = out / "corpus_text_document"
    bpe, eod = gpt2_bpe.reference(), gpt2_bpe.eod_id()
    expected = [[*bpe.encode(text).ids, eod] for text in TEXTS]
    assert _megatron_sequences(prefix) == expected
    tokenizer = build_tokenizer(megatron_args(*gpt2_bpe.flags()))
    loaded = indexed_dataset(prefix, 4096, tokenizer=tokenizer)
    assert [loaded.tokens(i).tolist() for i in range(len(loaded))] == expected
    assert (loaded.vocab_size, loaded.eod_id) == (500, eod)


def test_each_json_key_gets_its_own_dataset_and_eod_only_when_asked(
    preprocess_tool, tmp_path
) -> None:
    records = [{"text": "abc", "title": "T", "input_ids": [7, 8]}, {"text": "é", "title": "U"}]
    source = _jsonl(tmp_path / "in.jsonl", records)
    flags = ["--input", str(source), "--output-prefix", str(tmp_path / "d")]
    assert preprocess_tool.main([*flags, "--json-keys", "text", "title"]) == 0
    assert _megatron_sequences(tmp_path / "d_text_document") == [[97, 98, 99], [195, 169]]
    assert _megatron_sequences(tmp_path / "d_title_document") == [[84], [85]]
    assert preprocess_tool.main([*flags, "--json-keys", "input_ids", "--max-documents", "1"]) == 0
    assert _megatron_sequences(tmp_path / "d_input_ids_document") == [[7, 8]]


def test_workers_change_no_byte(gpt2_bpe, preprocess_tool, tmp_path) -> None:
    records = [{"text": text[:2000]} for _, text in stdlib_texts(max_documents=60)]
    source = _jsonl(tmp_path / "in.jsonl", records)
    for workers in ("1", "2"):
        flags = ["--input", str(source), "--output-prefix", str(tmp_path / workers)]
        assert preprocess_tool.main([*flags, *gpt2_bpe.flags(), "--workers", workers]) == 0
    for suffix in ("bin", "idx"):
        one = Path(tmp_path / f"1_text_document.{suffix}").read_bytes()
        assert one == Path(tmp_path / f"2_text_document.{suffix}").read_bytes()


def test_stdlib_input_loads_like_the_builtin_corpus_with_any_tokenizer(
    gpt2_bpe, preprocess_tool, megatron_args, tmp_path
) -> None:
    flags = ["--input", "stdlib", "--output-prefix", str(tmp_path / "s"), "--max-documents", "3"]
    assert preprocess_tool.main([*flags, *gpt2_bpe.flags(), "--append-eod"]) == 0
    tokenizer = build_tokenizer(megatron_args(*gpt2_bpe.flags()))
    bpe, eod = gpt2_bpe.reference(), gpt2_bpe.eod_id()
    expected = [[*bpe.encode(text).ids, eod] for _, text in stdlib_texts(max_documents=3)]
    assert _megatron_sequences(tmp_path / "s_text_document") == expected
    loaded = indexed_dataset(tmp_path / "s_text_document", 1 << 20, tokenizer=tokenizer)
    assert loaded.tokens(2).tolist() == expected[2]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ids_past_the_vocabulary_fail_naming_file_and_line(
    workers, gpt2_bpe, preprocess_tool, tmp_path, capsys
) -> None:
    source = _jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 500, 4]}])
    flags = ["--input", str(source), "--output-prefix", str(tmp_path / "new" / "x")]
    flags += ["--json-keys", "input_ids", "--workers", workers]
    assert preprocess_tool.main([*flags, *gpt2_bpe.flags()]) == 2
    assert capsys.readouterr().err == (
        f"preprocess_data.py: error: {source} line 2: field 'input_ids' has token id 500 outside "
        "the vocabulary [0, 500) of the GPT2BPETokenizer (vocab.json, merges.txt) tokenizer\n"
    )
    assert _files(tmp_path) == ["in.jsonl"]  # not even the output directory


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--split-sentences"], "--split-sentences is not supported: it needs NLTK's punkt"),
        (["--partitions", "2"], "--partitions 2 is not supported: the input is streamed"),
        (["--json-keys", "text", "text"], "--json-keys text text: a key is repeated"),
        (
            ["--tokenizer-type", "NullTokenizer"],
            "--tokenizer-type NullTokenizer needs --vocab-size",
        ),
        (["--vocab-file", "v.json"], "--vocab-file given without --tokenizer-type"),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m"],
            "--vocab-file v.json: no such file (nothing is downloaded)",
        ),
    ],
)
def test_refusals_are_one_line_and_write_nothing(
    flags, message, preprocess_tool, tmp_path, capsys
) -> None:
    source = _jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "x"), *flags]
    assert preprocess_tool.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"preprocess_data.py: error: {message}") and error.count("\n") == 1
    assert _files(tmp_path) == ["in.jsonl"]


def test_argparse_errors_are_one_line_and_help_names_the_default(
    preprocess_tool, tmp_path, capsys
) -> None:
    argv = ["--input", "x.jsonl", "--output-prefix", str(tmp_path / "x")]
    with pytest.raises(SystemExit) as exited:
        preprocess_tool.main([*argv, "--tokenizer-type", "Bert"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--tokenizer-type: invalid choice: 'Bert'" in error
    with pytest.raises(SystemExit):
        preprocess_tool.main(["--help"])
    assert "without it, the byte-level tokenizer" in " ".join(capsys.readouterr().out.split())


def test_accepted_upstream_flags_keep_documents_whole(preprocess_tool, tmp_path) -> None:
    source = _jsonl(tmp_path / "in.jsonl", [{"text": "a\n\nb\n"}])
    flags = ["--input", str(source), "--output-prefix", str(tmp_path / "x"), "--keep-newlines"]
    assert preprocess_tool.main([*flags, "--keep-sequential-samples", "--log-interval", "1"]) == 0
    assert _megatron_sequences(tmp_path / "x_text_document") == [list(b"a\n\nb\n")]
    loaded = indexed_dataset(tmp_path / "x_text_document", 16, tokenizer=BYTE_TOKENIZER)
    assert np.array_equal(loaded.tokens(0), np.frombuffer(b"a\n\nb\n", np.uint8))


def test_command_line_failure_prints_exactly_one_line(tmp_path) -> None:
    """As a script (fresh interpreter): no import-time warnings around the error line."""
    source = _jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    tool = ROOT / "tools" / "preprocess_data.py"
    argv = [sys.executable, str(tool), "--input", str(source), "--output-prefix", "x"]
    argv += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "nope.model"]
    root = str(ROOT)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=environment)
    assert done.returncode == 2
    assert done.stderr == (
        "preprocess_data.py: error: --tokenizer-model nope.model: no such file (nothing is "
        "downloaded)\n"
    )
    assert _files(tmp_path) == ["in.jsonl"]


def test_an_output_that_is_not_a_regular_file_is_refused(preprocess_tool, tmp_path, capsys):
    """Issue 34 sweep: a FIFO where the .bin goes was replaced by the finished file (exit 0)."""
    import stat

    source = _jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    os.mkfifo(tmp_path / "x_text_document.bin")
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "x")]
    assert preprocess_tool.main(argv) == 2
    assert capsys.readouterr().err == (
        f"preprocess_data.py: error: {tmp_path / 'x_text_document.bin'} exists and is not a "
        "regular file; not replacing it\n"
    )
    assert stat.S_ISFIFO(os.stat(tmp_path / "x_text_document.bin").st_mode)
