"""NVIDIA/Megatron-LM's own launch scripts, scaled to tiny sizes, train on CPU ranks.

`examples/gpt3/train_gpt3_175b_distributed.sh` and `examples/llama/train_llama3_8b_h100_fp8.sh`
(upstream, as of megatron-core 0.19) pass about 90 flags. Every one of them parses here with
Megatron's parser; the sizes are scaled down (layers, widths, batch, iterations, vocabulary).
The flags DynaPipe cannot run stop a `--dynamic-micro-batching` job with exit status 2 and one
line naming them (`DROPPED`, each with the reason it prints); with the rest, `--tensorboard-dir`
included, `pretrain_gpt.py` trains two iterations in Megatron's loop with and without
`--dynamic-micro-batching`, on 2 ranks (TP1 x PP2) and 4 ranks (TP2 x DP2, the Llama script's
`--sequence-parallel` included), and Megatron's event files hold DynaPipe's metrics when it
plans.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("megatron.training")

from distributed import program_exit_status, run_ranks
from test_megatron_loop import PRETRAIN_GPT, iteration_rows

from megatron.dynapipe.arguments import parse_args

# The GPT-3 175B script's flags at tiny sizes (its --vocab-file/--merge-file/--data-path and
# --save/--load are filled in per test).
GPT3 = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000", "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "2", "--split", "949,50,1", "--log-interval", "100",
    "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "1",
]  # fmt: skip

# The Llama-3 8B fp8 script's flags (mock-data branch) at tiny sizes; its --split keeps the
# quotes its flags string hands the program.
LLAMA3 = [
    "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--seq-length", "128", "--max-position-embeddings", "128",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
    "--normalization", "RMSNorm", "--init-method-std", "0.0134",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "16",
    "--lr-decay-samples", "15", "--lr-warmup-samples", "4", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--tensor-model-parallel-size", "2", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1", "--log-interval", "1", "--eval-iters", "1",
    "--eval-interval", "100", "--save-interval", "1000", "--log-throughput",
    "--distributed-timeout-minutes", "60",
]  # fmt: skip

# Flags of the two scripts DynaPipe refuses on CPU ranks under --dynamic-micro-batching, each
# with the flag its one line names (without a DynaPipe flag, only the GPU-only ones). GPU-only:
# fp8 (TransformerEngine on Hopper), TransformerEngine's fused attention and zero-centred norms.
# Not implemented yet under DynaPipe: overlapped parameter gathers. The GPT-3 script's
# --step-batch-size-schedule is refused too (and megatron-core 0.19's own validate_args rejects
# it next to the script's --global-batch-size).
DROPPED = {
    "gpt3": [
        (["--step-batch-size-schedule", "0:16 2.4B:320"], "--step-batch-size-schedule"),
    ],
    "llama3": [
        (["--fp8-format", "hybrid"], "--fp8-format"),
        (["--fp8-param-gather"], "--fp8-param-gather"),
        (["--attention-backend", "fused"], "--attention-backend"),
        (["--apply-layernorm-1p"], "--apply-layernorm-1p"),
        (["--overlap-param-gather"], "--overlap-param-gather"),
    ],
}


@pytest.fixture(scope="module")
def gpt3_flags(gpt2_bpe, preprocess_tool, tmp_path_factory) -> list[str]:
    """GPT3 with its data: a GPT-2 BPE corpus preprocessed as upstream's README does."""
    from megatron.dynapipe.data.stdlib_corpus import stdlib_files

    root = tmp_path_factory.mktemp("gpt3")
    jsonl = root / "corpus.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": f.read_text()}) + "\n" for f in stdlib_files()[:80])
    )
    flags = ["--input", str(jsonl), "--output-prefix", str(root / "corpus"), "--append-eod"]
    assert preprocess_tool.main([*flags, *gpt2_bpe.flags()]) == 0
    # As upstream's script: the GPT-2 files without --tokenizer-type (pretrain_gpt.py's default).
    files = [
        flag for flag in gpt2_bpe.flags() if flag not in ("--tokenizer-type", "GPT2BPETokenizer")
    ]
    return [*GPT3, *files, "--data-path", str(root / "corpus_text_document")]


def _flags(script: str, gpt3_flags: list[str]) -> list[str]:
    return gpt3_flags if script == "gpt3" else LLAMA3


@pytest.mark.parametrize("script", ["gpt3", "llama3"])
def test_dropped_flags_stop_with_one_line_naming_them(script, gpt3_flags, capsys) -> None:
    for extra, named in DROPPED[script]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*_flags(script, gpt3_flags), *extra, "--dynamic-micro-batching"])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and named in lines[0], lines


@pytest.mark.parametrize("dynamic", [False, True], ids=["megatron-batching", "dynamic"])
@pytest.mark.parametrize("script", ["gpt3", "llama3"])
@pytest.mark.slow
def test_scaled_launch_script_trains(script, dynamic, gpt3_flags, tmp_path, capfd) -> None:
    """`pretrain_gpt.py` (Megatron's loop) with the script's flags, as upstream launches it."""
    import torch

    flags = _flags(script, gpt3_flags)
    world = 2 if script == "gpt3" else 4
    if dynamic:
        flags = [*flags, "--dynamic-micro-batching"]
    flags = [*flags, "--tensorboard-dir", str(tmp_path / "tb")]  # as both scripts do
    if script == "gpt3":  # upstream passes --save X --load X: X starts empty, then resumes
        flags = [*flags, "--save", str(tmp_path), "--load", str(tmp_path)]
    # The Llama script's --cross-entropy-loss-fusion torch.compiles megatron-core's fused cross
    # entropy: inductor would generate and build C++ for it on each of the 4 CPU ranks (50-100
    # CPU-s, a test of torch's compiler). The ranks run that function eagerly instead; the flag
    # still selects megatron-core's fused implementation.
    with torch.compiler.set_stance("force_eager" if script == "llama3" else "default"):
        statuses = run_ranks(program_exit_status, world, PRETRAIN_GPT, flags, timeout_s=240)
    assert statuses == [0] * world
    out = capfd.readouterr().out
    if dynamic:  # DynaPipe's lines, the last iteration's whatever --log-interval says
        rows = iteration_rows(out)
        assert rows and int(rows[-1]["it"]) == 2, out[-3000:]
        assert all(np.isfinite(float(row["loss"])) for row in rows), out[-3000:]
    if script == "gpt3":
        assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))  # Megatron's, DynaPipe's metrics in them
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "lm loss" in tags and ("dynapipe/real-tokens-per-second" in tags) == dynamic, tags
