"""The in-program baselines through megatron-core's own 1F1B schedule.

`packing-1f1b`: on forked gloo ranks with PP=2, one global batch packed into rows of the full
sequence length and run by `get_forward_backward_func()` gives the loss and every parameter
gradient of the single-process non-pipelined reference, with one row per micro-batch and with
three (the last micro-batch then topped up with a padding row); megatron-core's 1F1B schedule
is what ran. `megatron-1f1b`: its fixed-length samples are exactly what megatron-core's
GPTDataset cuts from the same documents written as a Megatron indexed dataset.
`pretrain_gpt.py` trains with either in Megatron's loop (the loss falls on PP=2, with
Megatron's evaluation for megatron-1f1b).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from paths import TESTS

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import program_exit_status, run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    MAX_SEQLEN,
    assert_matches_reference,
    make_plan,
    stage_gradients,
    stage_model_like_reference,
)
from gpt_reference import reference as _reference  # noqa: E402
from test_megatron_loop import PRETRAIN_GPT, iteration_rows  # noqa: E402

from dynapipe_planner.plan import ExecutionPlan  # noqa: E402

CALL_SITES_FILE = TESTS / "data" / "cuda_call_sites.txt"
ONE_F_ONE_B = (
    "megatron/core/pipeline_parallel/schedules.py:forward_backward_pipelining_without_interleaving"
)


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict, dict]:
    return run_ranks(_reference, 1)[0]


def _megatron_baseline(rank: int, world: int, pp: int, mbs: int, plan: ExecutionPlan, weights):
    """One iteration through megatron-core's schedule: (loss sum, tokens), grads, call sites."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.pipeline.megatron_baseline import MegatronPackingBaseline

    cpu_compat.install()
    ps.initialize(1, pp, world // pp)
    try:
        config, model, names = stage_model_like_reference(1, pp, weights)
        baseline = MegatronPackingBaseline(
            model, config, seq_length=MAX_SEQLEN, micro_batch_size=mbs, pad_id=DATA.pad_id
        )
        model.zero_grad_buffer()
        result = baseline.run(plan, rank_microbatches(plan, ps.replica(), DATA))
        grads = stage_gradients(model, names, 1)
        return (result.loss_sum, result.num_tokens), grads, cpu_compat.recorded_call_sites()
    finally:
        ps.destroy()


@pytest.mark.parametrize("mbs", [1, 3])
def test_packing_1f1b_equals_reference(reference, mbs: int) -> None:
    plan = make_plan(1, 2, 1, "packing", micro_batch_size=mbs)
    assert all(mb.seqlen == MAX_SEQLEN and mb.num_rows <= mbs for mb in plan.microbatches)
    if mbs == 3:
        assert any(mb.num_rows < mbs for mb in plan.microbatches), "no filler row exercised"
    results = run_ranks(_megatron_baseline, 2, 2, mbs, plan, reference[1])
    assert_matches_reference(reference, [(r[0], r[1]) for r in results], 1)
    sites = set().union(*(r[2] for r in results))
    assert ONE_F_ONE_B in sites
    unknown = sorted(sites - set(CALL_SITES_FILE.read_text().split()))
    assert not unknown, f"new CUDA call sites, add them to {CALL_SITES_FILE.name}: {unknown}"


@pytest.mark.parametrize(
    "baseline",
    [
        ["--baseline", "packing-1f1b"],
        ["--baseline", "megatron-1f1b", "--split", "8,1,1", "--eval-interval", "2"],
    ],
    ids=["packing-1f1b", "megatron-1f1b"],
)
def test_pretrain_with_megatron_baseline_learns(baseline: list[str], capfd) -> None:
    """`pretrain_gpt.py` (Megatron's loop) trains either baseline; megatron-1f1b evaluates."""
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "128", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
        "--tokens-per-global-batch", "2048", "--data-path", "synthetic:flan",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "1",
        "--lr", "1e-2", "--lr-decay-style", "constant", "--train-iters", "4", "--log-interval", "1",
        *baseline,
    ]  # fmt: skip
    assert run_ranks(program_exit_status, 2, PRETRAIN_GPT, argv, timeout_s=240) == [0, 0]
    out = capfd.readouterr().out
    losses = [float(row["loss"]) for row in iteration_rows(out)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, out[-3000:]
    if baseline[1] == "megatron-1f1b":
        assert "validation loss at iteration 2" in out, out[-3000:]


def _parse(*flags: str):
    from megatron.dynapipe.arguments import parse_args

    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    return parse_args([*common, "--seq-length", "128", "--train-iters", "1", *flags])


def test_baseline_flags() -> None:
    from megatron.dynapipe.job_config import JobConfig

    packing = _parse("--global-batch-size", "8", "--baseline", "packing-1f1b")
    assert JobConfig.of(packing).batching == "packing"
    tokens = ["--tokens-per-global-batch", "1100", "--micro-batch-size", "2"]
    assert _parse(*tokens, "--baseline", "megatron-1f1b").global_batch_size == 8  # 1100 // 128
    for baseline in ("megatron-1f1b", "packing-1f1b"):
        with pytest.raises(SystemExit):
            _parse("--baseline", baseline, "--dynamic-micro-batching")


def test_megatron_global_batch_must_split_into_micro_batches(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        _parse("--tokens-per-global-batch", "1000", "--baseline", "megatron-1f1b",
               "--micro-batch-size", "3")  # fmt: skip
    assert stop.value.code == 2
    assert "global batch of 7 samples" in capsys.readouterr().err


@pytest.mark.parametrize("documents", [False, True], ids=["windows", "inter-document-masking"])
def test_fixed_length_samples_are_megatron_cores(tmp_path: Path, documents: bool) -> None:
    """The same documents written by megatron-core's IndexedDatasetBuilder and read by its
    IndexedDataset give GPTDataset the same windows as our samples do (with each window's
    document bounds under --dataloader-inter-document-masking)."""
    import argparse

    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.datasets.utils import Split

    from megatron.dynapipe.data.megatron_samples import fixed_length_samples

    args = argparse.Namespace(
        seed=7, seq_length=16, reset_position_ids=True, reset_attention_mask=True,
        eod_mask_loss=True, dataloader_inter_document_masking=documents,
    )  # fmt: skip
    ours = fixed_length_samples(DATA, args, 30, "train")
    assert ("cu_seqlens" in ours[0]) == documents
    builder = IndexedDatasetBuilder(str(tmp_path / "docs.bin"), dtype=np.int32)
    for i in range(len(DATA)):
        builder.add_document(DATA.tokens(i), [len(DATA.tokens(i))])
    builder.finalize(str(tmp_path / "docs.idx"))
    indexed = IndexedDataset(str(tmp_path / "docs"))
    theirs = GPTDataset(indexed, None, np.arange(len(DATA), dtype=np.int32), 30, Split.train,
                        ours.config)  # fmt: skip
    assert len(ours) == len(theirs) >= 30
    for i in range(len(ours)):
        for key, value in theirs[i].items():
            torch.testing.assert_close(ours[i][key], value, msg=f"sample {i} {key}")
