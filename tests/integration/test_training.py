"""The training loop end to end on forked gloo ranks, and `pretrain_gpt.py` under torchrun.

PP=2 with dynamic micro-batches and the adaptive schedule learns (the loss falls over a few
iterations), and a run saved after two iterations and resumed (planning inline instead of in a
worker process) reproduces the uninterrupted run's later losses (same weights, optimiser state,
data order and plans).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import program_exit_status, run_ranks  # noqa: E402

PRETRAIN_GPT = str(ROOT / "pretrain_gpt.py")
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "128", "--pipeline-model-parallel-size", "2",
    "--dynamic-micro-batching", "--tokens-per-global-batch", "2048",
    "--data-path", "synthetic:flan", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--dynapipe-memory-limit-gib", "0.01",
    "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


def test_loss_falls_and_resume_continues_the_same_run(tmp_path: Path, capfd) -> None:
    full = run_ranks(_train, 2, [*TINY, "--train-iters", "4"], timeout_s=120)
    assert full[0] == full[1]  # every rank reports the global loss
    losses = full[0]
    assert losses[-1] < losses[0] - 0.1, losses
    # the online fit learnt iterations 2 and 3 (not the first) and predicted the fourth
    lines = [line for line in capfd.readouterr().out.splitlines() if "| lm loss " in line]
    assert ["; fitted " in line for line in lines] == [False, False, False, True], lines
    assert "median error" in lines[-1] and "over 1 iteration)" in lines[-1]
    ckpt = str(tmp_path / "ckpt")
    # Megatron's way to stop early: --exit-interval saves and ends the run after iteration 2.
    stop = [*TINY, "--train-iters", "4", "--exit-interval", "2", "--save", ckpt]
    first = run_ranks(_train, 2, stop, timeout_s=120)
    assert first[0] == losses[:2]
    # Planned inline this time: plans do not depend on the number of planner workers.
    resume = [*TINY, "--train-iters", "4", "--load", ckpt, "--planner-workers", "0"]
    resumed = run_ranks(_train, 2, resume, timeout_s=120)
    assert resumed[0] == pytest.approx(losses[2:], rel=1e-6)


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def test_bpe_blend_with_split_trains_and_evaluates(gpt2_bpe, preprocess_tool, tmp_path, capfd):
    """Megatron's data path end to end: a GPT-2 BPE, two corpora preprocessed with upstream's
    flags, a weighted blend of their prefixes split 8,1,1, validation during and after
    training and the test split at the end, in Megatron's report lines."""
    from megatron.dynapipe.data.stdlib_corpus import stdlib_files

    files = stdlib_files()
    prefixes = []
    for name, part in (("code", files[60:90]), ("more", files[90:110])):
        jsonl = _jsonl(tmp_path / f"{name}.jsonl", [f.read_text() for f in part])
        flags = ["--input", str(jsonl), "--output-prefix", str(tmp_path / name)]
        assert preprocess_tool.main([*flags, *gpt2_bpe.flags(), "--append-eod"]) == 0
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    model = [f for f in TINY if f not in ("--data-path", "synthetic:flan")]
    model = model[: model.index("--tokens-per-global-batch")] + model[model.index("2048") + 1 :]
    argv = [
        *model, *gpt2_bpe.flags(), "--data-path", "0.7", prefixes[0], "0.3", prefixes[1],
        "--split", "8,1,1", "--global-batch-size", "8", "--train-iters", "4",
        "--eval-interval", "2", "--eval-iters", "2",
    ]  # fmt: skip
    losses = run_ranks(_train, 2, argv, timeout_s=180)[0]
    out = capfd.readouterr().out
    assert len(losses) == 4 and all(np.isfinite(losses)), losses
    for line in (
        "validation loss at iteration 2 | lm loss value:",
        "validation loss at iteration 4 | lm loss value:",
        "validation loss at iteration 4 on validation set | lm loss value:",
        "test loss at iteration 4 on test set | lm loss value:",
    ):
        assert line in out, out[-3000:]
    assert "lm loss PPL:" in out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--data-path", "/nonexistent/prefix"], "/nonexistent/prefix.idx"),
        (["--data-path", "x", "/tmp/a", "0.5", "/tmp/b"], "blend weight 'x'"),
        (
            [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                "/no.json",
                "--merge-file",
                "/no",
            ],
            "--vocab-file /no.json",
        ),
    ],
)
def test_pretrain_gpt_bad_data_is_one_line_and_exit_2(flags, named, capfd):
    """pretrain_gpt.py's user errors end the run before Megatron builds anything."""
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    model += ["--seq-length", "128", "--train-iters", "1", "--lr", "1e-3"]
    argv = [*model, "--dynamic-micro-batching", *flags]
    os.environ.pop("DYNAPIPE_DEBUG", None)  # the forked rank inherits this environment
    assert run_ranks(program_exit_status, 1, PRETRAIN_GPT, argv) == [2]
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], lines
    # --debug: the traceback too, still exit status 2
    assert run_ranks(program_exit_status, 1, PRETRAIN_GPT, [*argv, "--debug"]) == [2]
    debugged = capfd.readouterr().err.strip().splitlines()
    assert debugged[0] == "Traceback (most recent call last):" and debugged[-1] == lines[0]


@pytest.mark.parametrize("debug", ["quiet", "--debug", "DYNAPIPE_DEBUG"])
def test_a_job_fault_is_one_line_exit_1_with_traceback_on_request(debug, capsys, monkeypatch):
    """A fault of the running job (here a peer that died) is one line on the rank that saw it;
    the traceback only with --debug or DYNAPIPE_DEBUG=1."""
    from megatron.dynapipe.exits import exit_status
    from megatron.dynapipe.pipeline.liveness import PeerFailure

    def peer_died():
        raise PeerFailure("rank 1, iteration 4: rank 3 stopped answering\n(original error ...)")

    flags = argparse.Namespace(debug=debug == "--debug")
    monkeypatch.setenv("DYNAPIPE_DEBUG", "1" if debug == "DYNAPIPE_DEBUG" else "0")
    assert exit_status("pretrain_gpt.py", peer_died, flags) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "pretrain_gpt.py: error: rank 1, iteration 4: rank 3 stopped answering"
    assert ("Traceback (most recent call last):" in err) == (debug != "quiet")
    assert len(err) > 1 if debug != "quiet" else len(err) == 1


@pytest.mark.slow
def test_pretrain_gpt_under_torchrun() -> None:
    """The real entry point: torchrun, two processes, the per-iteration line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        str(ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", "2",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # DynaPipe's line ("| lm loss 5.7280 |"), beside Megatron's own ("| lm loss: 5.728E+00 |")
    lines = [line for line in out.stdout.splitlines() if "| lm loss " in line]
    assert len(lines) == 2 and "iteration 2/2" in lines[-1], out.stdout
    assert "tokens/s" in lines[0] and "padding eff" in lines[0] and "planning" in lines[0]


def test_iteration_line_says_when_the_planner_budget_ran_out() -> None:
    """The line is unchanged unless the plan's DP ran out of its wall-clock budget; then it
    says so after the planning fields, and the benchmarks' parser still reads it."""

    from benchmarks.torchrun_runs import iteration_rows
    from dynapipe_planner.plan import ExecutionPlan
    from megatron.dynapipe.iterations import Iteration
    from megatron.dynapipe.log import iteration_line

    stats = {
        "padding_efficiency": 0.953, "num_microbatches": 4, "recompute": "none",
        "predicted_iteration_s": 0.008, "planning_time_s": 0.0008,
    }  # fmt: skip

    analytic = {"cost_model": {"kind": "analytic", "cluster": {"gpu": "A100-80GB"}}}

    def line(exhausted: bool, meta: dict = analytic) -> str:
        plan = ExecutionPlan(1, 1, [], [], {**stats, "budget_exhausted": exhausted}, meta)
        work = Iteration(lambda: None, plan.stats, 4, waited_s=0.0007, plan=plan)
        return iteration_line(2, 10, work, 5.15391, 15610, 6.691)

    expected = (
        "[####................] iteration  2/10 | lm loss 5.1539 | tokens/s 2,333 | "
        "padding eff 0.953 | micro-batches 4 | recompute none | iteration 6,691 ms "
        "(predicted 8.0 ms on A100-80GB, analytic) | planning 0.8 ms (waited 0.7 ms)"
    )
    assert line(False) == expected
    assert line(True) == expected + " | planner budget exhausted"
    # a profiled table names the device it measured
    profiled = {"cost_model": {"kind": "profiled", "device": "cpu", "path": "t.json"}}
    assert "(predicted 8.0 ms on cpu, profiled) |" in line(False, profiled)
    rows = iteration_rows(line(True) + " | learning rate 1.000E-04")
    assert [(r["it"], r["tps"], r["ms"], r["predicted"]) for r in rows] == [
        ("2", "2,333", "6,691", "8.0")
    ]
    # a searched plan file's job: the search's prediction, for the devices it priced
    plan = ExecutionPlan(1, 1, [], [], stats)
    work = Iteration(lambda: None, plan.stats, 4, waited_s=0.0007, plan=plan)
    searched = iteration_line(2, 10, work, 5.15391, 15610, 6.691, (), (1.152, "cpu"))
    assert "iteration 6,691 ms (search predicted 1,152.0 ms on cpu) | planning 0.8 ms" in searched
    assert iteration_rows(searched)[0]["predicted"] == "1,152.0"
    # the online fit's prediction, once it has one, with its record so far
    from dynapipe_planner.online_fit import IterationTimeFit, PlanFeatures

    fit = IterationTimeFit(min_iterations=1)
    fit.observe(PlanFeatures(0.008, 4), 6.0, None)
    fit.observe(PlanFeatures(0.008, 4), 6.691, 6.0)
    plan = ExecutionPlan(1, 1, [], [], stats, analytic)
    work = Iteration(lambda: None, plan.stats, 4, plan=plan, fitted_s=6.3456)
    fitted = iteration_line(2, 10, work, 5.15391, 15610, 6.691, fit=fit)
    assert (
        "(predicted 8.0 ms on A100-80GB, analytic; fitted 6,345.6 ms, median error 10.3% "
        "over 1 iteration) | planning" in fitted
    )
    assert iteration_rows(fitted)[0]["fitted"] == "6,345.6"


def test_log_peak_memory_traces_the_last_iteration_on_every_rank(capfd) -> None:
    """`--log-peak-memory`: the last iteration's line, and only it, gives every rank's traced
    peak, at least the stage's fp32 weights, gradient buffer and Adam moments (16 bytes per
    parameter) that are alive throughout."""
    from benchmarks.torchrun_runs import iteration_rows
    from dynapipe_planner.model_spec import ModelSpec

    run_ranks(_train, 2, [*TINY, "--train-iters", "2", "--log-peak-memory"], timeout_s=120)
    out = capfd.readouterr().out
    rows = iteration_rows(out)
    assert [r["peak_mib"] is not None for r in rows] == [False, True]
    line = next(x for x in out.splitlines() if "| peak memory" in x)
    per_rank = line.split("(per rank ")[1].split(";")[0].split(", ")
    assert max(float(p) for p in per_rank) == float(rows[-1]["peak_mib"])
    spec = ModelSpec("tiny", "gpt", 2, 32, 4, 128, 384, max_position_embeddings=128)
    layer = spec.layer_params("decoder")
    floors = [16 * (layer + spec.embedding_params()), 16 * (layer + spec.output_params())]
    for peak, floor in zip(per_rank, floors, strict=True):
        assert float(peak) * 2**20 >= floor, (per_rank, floors)
