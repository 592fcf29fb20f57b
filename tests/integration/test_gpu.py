"""The GPU lane (`pytest -m gpu`): the runtime on CUDA with NCCL, skipped where there is no GPU.

CI has no GPU, so there these tests are collected and skipped; a developer with a lent GPU runs them
(docs/gpu.md "The GPU lane"). One GPU is enough for most: gradients of a plan run by the executor on
CUDA equal the non-pipelined reference computed on the same device (with two GPUs, PP=2 over NCCL
too, dynamic and THD-packed micro-batches), `pretrain_gpt.py` trains in fp32 and bf16 (DynaPipe and
the megatron-core baselines, packing through THD), and `tools/profile_costs.py` writes a CUDA cost
table that the planner then plans with, predicting the measured iteration time within 2x. Packed
rows through TransformerEngine: `test_packed_sequences.py`. The test process never uses CUDA itself:
the ranks are spawned processes, each with its own CUDA context.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from paths import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import free_port, run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    GPT,
    LLAMA,
    assert_matches_reference,
    make_plan,
    reference,
    stage_gradients,
    stage_model_like_reference,
)

pytestmark = pytest.mark.gpu


def _executor_on_gpu(rank: int, world: int, pp: int, plan, weights: dict, flags: tuple[str, ...]):
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.pipeline.executor import PlanExecutor

    cpu_compat.install()
    ps.initialize(1, pp, world // pp)
    try:
        config, model, names = stage_model_like_reference(1, pp, weights, flags)
        assert next(model.parameters()).is_cuda
        executor = PlanExecutor.for_this_rank(
            model, config, device=torch.device("cuda", rank), timeout_s=60
        )
        result = executor.run(plan, rank_microbatches(plan, ps.replica(), DATA))
        return (result.loss_sum, result.num_tokens), stage_gradients(model, names, 1)
    finally:
        ps.destroy()


@pytest.mark.parametrize("flags", [GPT, LLAMA], ids=["gpt", "llama"])
def test_executor_on_gpu_gives_the_reference_gradients(flags) -> None:
    """Several variable-length micro-batches through NCCL-backed DDP on one GPU."""
    ref = run_ranks(reference, 1, flags, backend="nccl")[0]
    plan = make_plan(1, 1, 1, memory=1_500_000)  # one stage holds the whole model
    results = run_ranks(_executor_on_gpu, 1, 1, plan, ref[1], flags, backend="nccl")
    assert_matches_reference(ref, results, 1)


@pytest.mark.parametrize("batching", ["dynamic", "packing"])
def test_pipeline_over_nccl_gives_the_reference_gradients(batching) -> None:
    """PP=2 on two GPUs: variable-shape activations (and THD packed rows) over NCCL p2p."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL pipeline: needs two GPUs")
    ref = run_ranks(reference, 1, GPT, backend="nccl")[0]
    plan = make_plan(1, 2, 1, batching)
    results = run_ranks(_executor_on_gpu, 2, 2, plan, ref[1], GPT, backend="nccl")
    assert_matches_reference(ref, results, 1)


TRAIN = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "256", "--tokens-per-global-batch", "4096", "--train-iters", "8",
    "--lr", "1e-3", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


def _pretrain_gpt(*flags: str) -> list[str]:
    """`torchrun --nproc-per-node 1 pretrain_gpt.py`: DynaPipe's iteration lines (it must pass)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py"), *TRAIN, *flags,
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # DynaPipe's lines ("| lm loss 5.7280 |"), not Megatron's own ("| lm loss: 5.728E+00 |")
    return [line for line in out.stdout.splitlines() if "| lm loss " in line]


def _losses(lines: list[str]) -> list[float]:
    return [float(re.search(r"lm loss (\S+)", line).group(1)) for line in lines]


@pytest.mark.parametrize(
    "flags",
    [
        ("--dynamic-micro-batching",),
        ("--dynamic-micro-batching", "--bf16"),
        ("--baseline", "megatron-1f1b", "--micro-batch-size", "2", "--bf16"),
        ("--baseline", "packing-1f1b", "--micro-batch-size", "2", "--bf16"),
    ],
    ids=["dynapipe-fp32", "dynapipe-bf16", "megatron-1f1b-bf16", "packing-1f1b-thd-bf16"],
)
def test_pretrain_gpt_learns_on_one_gpu(flags) -> None:
    losses = _losses(_pretrain_gpt(*flags))
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.5, losses


def test_profiled_cuda_costs_plan_training(tmp_path) -> None:
    """tools/profile_costs.py measures the GPU; pretrain_gpt.py plans with that table."""
    table = tmp_path / "costs.json"
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    cmd = [
        sys.executable, str(ROOT / "tools" / "profile_costs.py"), *model,
        "--seq-length", "256", "--microbatch-sizes", "1,2,4,8,16", "--output", str(table),
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    content = json.loads(table.read_text())
    assert content["format"] == "dynapipe-cost-table"
    assert content["device"] != "cpu" and "cpu" not in content["device"].lower()
    lines = _pretrain_gpt("--dynamic-micro-batching", "--dynapipe-cost-model", str(table))
    predicted = [_ms(r"predicted ([\d,.]+) ms", line) for line in lines]
    measured = [_ms(r"\| iteration ([\d,.]+) ms", line) for line in lines]
    assert len(predicted) == 8 and all(p > 0 for p in predicted)
    # With the device's own costs the plan's prediction is the iteration's time within 2x
    # (after the first iteration, which pays CUDA's warm-up).
    ratios = sorted(m / p for m, p in zip(measured[1:], predicted[1:], strict=True))
    assert 0.5 <= ratios[len(ratios) // 2] <= 2.0, ratios


def _ms(pattern: str, line: str) -> float:
    return float(re.search(pattern, line).group(1).replace(",", ""))


def test_too_many_processes_for_the_gpus_is_one_line() -> None:
    gpus = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        check=True,
    )
    nproc = str(int(gpus.stdout) + 1)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
        "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py"), *TRAIN,
    ]  # fmt: skip
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ}
    )
    assert out.returncode != 0
    assert f"{nproc} processes on this node" in out.stderr


def test_gpu_throughput_smoke_mode_runs() -> None:
    """`python -m benchmarks.gpu_throughput --smoke` (CI without a GPU checks only that it
    stops at its CUDA check, `test_benchmark_scripts.py`): every method on a tiny GPT, real
    torchrun ranks on the GPUs."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_throughput", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ratio:" in out.stdout
