"""Megatron's tokenizers through megatron.dynapipe.data.tokenizer, with nothing downloaded: ids
equal the reference library's own encoding (HuggingFace `tokenizers` for GPT-2 BPE and a local
HuggingFace directory, `sentencepiece` for the SentencePiece family), special ids follow the
documented pad rule, the byte tokenizer stays the default, Megatron's namespace is left as it
was, and bad flags give one line naming the flag and path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from megatron.dynapipe.data.base import BYTE_TOKENIZER
from megatron.dynapipe.data.stdlib_corpus import stdlib_files
from megatron.dynapipe.data.tokenizer import TokenizerError, build_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "ünïcode ✓ and  spaces", "", "import os\n" * 5]


def test_no_tokenizer_type_gives_the_byte_tokenizer(megatron_args) -> None:
    assert build_tokenizer(megatron_args()) is BYTE_TOKENIZER


def test_gpt2_bpe_from_vocab_and_merges_encodes_like_the_library(gpt2_bpe, megatron_args) -> None:
    args = megatron_args(*gpt2_bpe.flags())
    before = dict(vars(args))
    started = time.perf_counter()
    tokenizer = build_tokenizer(args)
    assert time.perf_counter() - started < 10  # a Hub lookup would hang for a minute offline
    assert vars(args) == before  # megatron-core's padded_vocab_size is not set behind our back
    vocab = json.loads(gpt2_bpe.vocab_file.read_text())
    assert tokenizer.vocab_size == len(vocab) == 500
    assert tokenizer.eod_id == tokenizer.pad_id == vocab["<|endoftext|>"]  # GPT-2 has no pad
    reference = gpt2_bpe.reference()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int64
        assert ids.tolist() == reference.encode(text).ids
    assert tokenizer.name == "GPT2BPETokenizer (vocab.json, merges.txt)"


def test_huggingface_tokenizer_from_a_local_directory(gpt2_bpe, megatron_args, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path / "hf"
    PreTrainedTokenizerFast(
        tokenizer_object=gpt2_bpe.reference(), eos_token="<|endoftext|>", pad_token="Ġ"
    ).save_pretrained(directory)
    tokenizer = build_tokenizer(
        megatron_args(
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory)
        )
    )
    gpt2 = build_tokenizer(megatron_args(*gpt2_bpe.flags()))
    vocab = json.loads(gpt2_bpe.vocab_file.read_text())
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (gpt2.vocab_size, gpt2.eod_id)
    assert tokenizer.pad_id == vocab["Ġ"]  # its own pad, when it has one
    for text in TEXTS:
        assert np.array_equal(tokenizer.encode(text), gpt2.encode(text))


@pytest.fixture(scope="module")
def sentencepiece_models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny SentencePiece BPE models over stdlib source: without and with a pad piece."""
    sentencepiece = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sentencepiece")
    corpus = directory / "corpus.txt"
    corpus.write_text("".join(path.read_text() for path in stdlib_files()[:10]))
    models = {}
    for name, pad_id in (("plain", -1), ("padded", 3)):
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(directory / name),
            vocab_size=300,
            model_type="bpe",
            pad_id=pad_id,
            minloglevel=2,
        )
        models[name] = directory / f"{name}.model"
    return models


@pytest.mark.parametrize(
    "kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
def test_sentencepiece_family_encodes_like_sentencepiece(
    kind, sentencepiece_models, megatron_args
) -> None:
    import sentencepiece

    model = sentencepiece_models["plain"]
    tokenizer = build_tokenizer(
        megatron_args("--tokenizer-type", kind, "--tokenizer-model", str(model))
    )
    reference = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert tokenizer.vocab_size == reference.get_piece_size() == 300
    assert tokenizer.eod_id == tokenizer.pad_id == reference.eos_id()  # no pad piece: EOD
    for text in TEXTS:
        assert tokenizer.encode(text).tolist() == reference.encode(text)
    padded = build_tokenizer(
        megatron_args(
            "--tokenizer-type", kind, "--tokenizer-model", str(sentencepiece_models["padded"])
        )
    )
    assert padded.pad_id == 3 != padded.eod_id


def test_null_tokenizer_reads_ids(megatron_args) -> None:
    tokenizer = build_tokenizer(
        megatron_args("--tokenizer-type", "NullTokenizer", "--vocab-size", "1000")
    )
    assert (tokenizer.vocab_size, tokenizer.eod_id, tokenizer.pad_id) == (1000, 999, 999)
    assert tokenizer.encode("5 17 998").tolist() == [5, 17, 998]
    with pytest.raises(TokenizerError, match="cannot encode it"):
        tokenizer.encode("not ids")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tokenizer-type", "BertWordPieceCase"],
            r"--tokenizer-type BertWordPieceCase: not supported by this runtime",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "{merges}"],
            r"--tokenizer-type GPT2BPETokenizer needs --vocab-file \(a local file",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{tmp}/missing.json",
             "--merge-file", "{merges}"],
            r"--vocab-file {tmp}/missing.json: no such file",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{merges}",
             "--merge-file", "{merges}"],
            r"GPT2BPETokenizer \(--vocab-file {merges}, --merge-file {merges}\): cannot be loaded",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
            r"--tokenizer-model gpt2: no such directory \(nothing is downloaded\)",
        ),
        (
            ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "{tmp}"],
            r"--tokenizer-model {tmp}: no such file",
        ),
        (["--tokenizer-type", "NullTokenizer"], r"NullTokenizer needs --vocab-size"),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tmp}",
             "--vocab-file", "{tmp}/vocab.json"],
            r"--vocab-file {tmp}/vocab.json: no such file",
        ),
        (["--vocab-file", "{merges}"], r"--vocab-file given without --tokenizer-type"),
    ],
)  # fmt: skip
def test_bad_tokenizer_flags_give_one_line(
    flags, message, gpt2_bpe, megatron_args, tmp_path
) -> None:
    def fill(text: str) -> str:
        return text.format(merges=gpt2_bpe.merge_file, tmp=tmp_path)

    with pytest.raises(TokenizerError, match=fill(message)) as raised:
        build_tokenizer(megatron_args(*map(fill, flags)))
    assert "\n" not in str(raised.value)
