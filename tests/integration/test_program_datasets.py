"""Issue 33: under DynaPipe's planning flags a Megatron-LM program's own training dataset is what
trains (`megatron.dynapipe.data.program_samples`).

megatron.training's `SFTDataset` (conversations of varied length, made offline with a
byte-level HuggingFace tokenizer through Megatron's `SFTTokenizer`): its lengths are its packed
conversations' tokens, each planned sample is the provider's sample cut to that length, and a
2-rank job plans exactly the provider's samples in Megatron's order with Megatron's losses per
token. A dataset that says its lengths through `sample_lengths()` is read through it; one that
does not stops the job with one line, exit status 2. megatron-core's GPT datasets:
test_megatron_loop.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.training")
pytest.importorskip("transformers")

from distributed import run_ranks  # noqa: E402

from dynapipe_planner.plan import MicroBatch  # noqa: E402
from megatron.dynapipe.data.base import DataError  # noqa: E402
from megatron.dynapipe.data.microbatches import microbatch_tensors  # noqa: E402
from megatron.dynapipe.data.program_samples import (  # noqa: E402
    ProgramSamples,
    sample_lengths,
)

SEQ_LENGTH = 96
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")


def _sentence(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, words))


def _conversations(path: Path, count: int = 40) -> Path:
    """`count` lines of SFT conversations of 5-140 characters (some cut at SEQ_LENGTH), every
    fourth line two conversations packed together."""
    rng = np.random.default_rng(0)
    lines = []
    for k in range(count):
        messages = []
        for _ in range(2 if k % 4 == 3 else 1):
            messages += [
                {"role": "system", "content": "s"},
                {"role": "user", "content": _sentence(rng, int(rng.integers(1, 8)))},
                {"role": "assistant", "content": _sentence(rng, int(rng.integers(1, 18)))},
            ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _byte_tokenizer(directory: Path) -> Path:
    """A HuggingFace tokenizer of one token per byte (plus <unk>, <pad>, </s>) whose chat
    template joins the messages' contents: what `--sft-tokenizer-prompt-format identity`
    reads, made offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<unk>", "<pad>", "</s>"):
        vocab[special] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sft")
    return _conversations(root / "conversations.jsonl"), _byte_tokenizer(root / "tokenizer")


def _sft_dataset(data: Path, tokenizer_dir: Path, num_samples: int):
    """megatron.training's SFTDataset over `data`, as the test program's provider builds it."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args
    from megatron.training.datasets.sft_dataset import SFTDataset

    argv = ["--tokenizer-type", "SFTTokenizer", "--tokenizer-model", str(tokenizer_dir),
            "--sft-tokenizer-prompt-format", "identity"]  # fmt: skip
    with mock.patch.object(sys, "argv", ["sft", *argv]):
        tokenizer = build_tokenizer(parse_args(ignore_unknown_args=True))
    lines = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=SEQ_LENGTH,
        split="100,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        context_parallel_size=1,
        create_attention_mask=False,
    )
    indices = np.arange(len(lines), dtype=np.int32)
    return SFTDataset(lines, str(data), indices, num_samples, Split.train, config), lines


def test_sft_samples_are_the_datasets_own_cut_to_their_conversations(sft_files) -> None:
    """Each SFTDataset sample's length is its conversations' bytes (at most SEQ_LENGTH); the
    sample DynaPipe plans is the dataset's own dict cut there, everything after it padding
    without loss, and its conversations stay separate segments of a micro-batch."""
    data, tokenizer_dir = sft_files
    dataset, lines = _sft_dataset(data, tokenizer_dir, num_samples=60)
    lengths = sample_lengths(dataset)
    contents = [sum(len(m["content"].encode()) for m in line) for line in lines]
    expected = [min(contents[i % len(lines)], SEQ_LENGTH) for i in range(60)]
    assert lengths.tolist() == expected
    assert min(expected) < 40 and max(expected) == SEQ_LENGTH  # varied, some cut
    samples = ProgramSamples(dataset, lengths, SEQ_LENGTH)
    for index in (0, 3, 41):  # 3: two conversations; 41: line 1 again
        item, sample, n = dataset[index], samples.training_sample(index), int(lengths[index])
        assert sample.tokens.tolist() == item["tokens"][:n].tolist()
        assert sample.labels.tolist() == item["labels"][:n].tolist()
        assert item["loss_mask"][n:].sum() == 0 and set(item["tokens"][n:].tolist()) <= {256}
    split = lines[3][0]["content"] + lines[3][1]["content"] + lines[3][2]["content"]
    assert samples.training_sample(3).starts == (0, len(split.encode()))
    mb = MicroBatch(id=0, replica=0, samples=[3, 0], seqlen=SEQ_LENGTH * 2, row_sizes=[2])
    bounds = microbatch_tensors(mb, samples).cu_seqlens.tolist()
    first = int(lengths[3])
    assert bounds[:4] == [0, len(split.encode()), first, first + int(lengths[0])]


class _Said:
    """A map-style dataset that says its lengths through the protocol."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def sample_lengths(self) -> list[int]:
        return self.lengths

    def __getitem__(self, index: int) -> dict:
        n = self.lengths[index]
        tokens = torch.arange(SEQ_LENGTH) + 10 * index
        return {
            "tokens": tokens,
            "labels": tokens + 1,
            "loss_mask": (torch.arange(SEQ_LENGTH) < n).float(),
            "position_ids": torch.arange(SEQ_LENGTH),
        }


def test_a_dataset_says_its_lengths_through_the_protocol() -> None:
    dataset = _Said([5, 96, 17])
    assert sample_lengths(dataset).tolist() == [5, 96, 17]
    sample = ProgramSamples(dataset, sample_lengths(dataset), SEQ_LENGTH).training_sample(2)
    assert sample.tokens.tolist() == list(range(20, 37)) and sample.starts == (0,)
    assert sample.loss_mask.tolist() == [1.0] * 17


def test_a_dataset_without_lengths_is_named() -> None:
    with pytest.raises(DataError, match=r"training dataset \(list\) does not say its samples'"):
        sample_lengths([{"tokens": torch.zeros(4)}])


def _sft_program(
    rank: int, world: int, argv: list[str], data: str
) -> tuple[list[list[int]], list[int]]:
    """The test program (`megatron_lm_program.py`) on a forked rank; with DynaPipe, the sample
    ids each iteration's plan trains and the lengths of its micro-batches."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import megatron_lm_program

    from megatron.dynapipe.megatron_loop import DynaPipeSchedule

    planned: list[list[int]] = []
    seqlens: list[int] = []
    count = DynaPipeSchedule.count_samples

    def count_samples(self, args) -> None:
        planned.append(sorted(s for mb in self.last.plan.microbatches for s in mb.samples))
        seqlens.extend(mb.seqlen for mb in self.last.plan.microbatches)
        count(self, args)

    DynaPipeSchedule.count_samples = count_samples
    megatron_lm_program.main(argv, "gpt", data)
    return planned, seqlens


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]


def _sft_flags(data: Path, tokenizer_dir: Path) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
        "--pipeline-model-parallel-size", "2", "--sft", "--tokenizer-type", "SFTTokenizer",
        "--tokenizer-model", str(tokenizer_dir), "--sft-tokenizer-prompt-format", "identity",
        "--data-path", str(data), "--split", "100,0,0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--lr", "1e-2", "--lr-decay-style", "constant",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
        "--train-iters", "3", "--global-batch-size", "12",
    ]  # fmt: skip


def test_sft_job_plans_the_providers_samples_with_megatrons_losses(sft_files, capfd) -> None:
    """An SFT job (SFTDataset from the program's provider) under --dynamic-micro-batching on
    2 ranks (PP=2) plans exactly the provider's samples, 12 a batch in the dataset's order,
    and its losses per token are those of the same job in Megatron's schedule (micro-batches
    of one padded sample, per-document attention)."""
    flags = _sft_flags(*sft_files)
    ranks = run_ranks(_sft_program, 2, [*flags, "--dynamic-micro-batching"], "sft", timeout_s=240)
    assert ranks[0][0] == [list(range(12 * i, 12 * (i + 1))) for i in range(3)], ranks[0]
    dynapipe = _losses(capfd.readouterr().out)
    megatron = _reference_losses(flags, 2, capfd)
    assert len(dynapipe) == 3 and dynapipe == pytest.approx(megatron, rel=1e-5), (
        dynapipe,
        megatron,
    )


def _reference_losses(flags: list[str], world: int, capfd) -> list[float]:
    """The losses of the SFT job `flags` in Megatron's schedule: micro-batches of one padded
    sample, per-token loss, per-document attention."""
    from test_megatron_loop import _reference_program

    reference = [*flags, "--micro-batch-size", "1", "--calculate-per-token-loss",
                 "--dataloader-inter-document-masking"]  # fmt: skip
    run_ranks(_reference_program, world, reference, "gpt", "sft", timeout_s=300)
    return _losses(capfd.readouterr().out)


def test_sequence_parallel_sft_job_under_dynapipe_has_megatrons_losses(sft_files, capfd) -> None:
    """Issue 33: the SFT job on TP=2 x PP=2 with --sequence-parallel, planned micro-batches of
    one sample each at its own length (odd ones among them, padded to even): each TP rank sends
    and receives its half of every planned boundary, the norms' gradients are summed over the
    TP group (on CPU ranks by `cpu_compat`'s norm), and the losses per token are those of
    Megatron's own schedule with sequence parallelism."""
    flags = [*_sft_flags(*sft_files), "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    megatron = _reference_losses(flags, 4, capfd)
    ranks = run_ranks(_sft_program, 4, [*flags, "--batching", "padding"], "sft", timeout_s=300)
    assert any(n % 2 for n in ranks[0][1]), ranks[0][1]  # some rows needed padding
    dynapipe = _losses(capfd.readouterr().out)
    assert len(megatron) == 3 and dynapipe == pytest.approx(megatron, rel=1e-5), (
        dynapipe,
        megatron,
    )


def _opaque_program(rank: int, world: int, argv: list[str]) -> int | str | None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import megatron_lm_program

    try:
        megatron_lm_program.main(argv, "gpt", "opaque")
    except SystemExit as stop:
        return stop.code
    return 0


def test_a_program_dataset_without_lengths_stops_the_job_in_one_line(capfd) -> None:
    from test_megatron_loop import FLAGS

    assert run_ranks(_opaque_program, 2, FLAGS, timeout_s=240) == [2, 2]
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert errors == [
        "megatron_lm_program.py: error: the program's training dataset (_Opaque) does not say "
        "its samples' lengths, which DynaPipe plans over: give it a sample_lengths() method "
        "(docs/datasets.md) or train without DynaPipe's planning flags"
    ], errors
