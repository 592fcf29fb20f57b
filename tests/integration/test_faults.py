"""Faults end the job with an error that names the rank and the iteration, within the timeout.

Forked gloo ranks train with `--dynapipe-timeout 5`: (a) a rank exits in the middle of an
iteration (a pipeline neighbour, a data-parallel peer in the gradient all-reduce, or rank 0,
which serves the plan store) and every survivor raises naming it and the iteration; a rank that
hangs instead ends the job when the transfer or the all-reduce waiting for it times out; (b)
rank 0's planner worker never delivers a plan and every rank raises naming the iteration. Times are
checked loosely (under 3x the timeout) only to show nothing waits for a default timeout.
Messages count iterations from 1, as the progress lines do: the first iteration is "iteration 1".
Corrupt checkpoints and dataset indexes are covered by test_training and test_runtime_data.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks
from test_training import TINY

TIMEOUT_S = 5.0
FAULTY = [*TINY, "--train-iters", "3", "--dynapipe-timeout", str(TIMEOUT_S)]


def _train_until(
    rank: int, faulty_rank: int, fault: Callable[[], None], layout: list[str], at: int = 1
) -> tuple[str, float]:
    """Train; `faulty_rank` calls `fault` at its first forward pass of the iteration of index
    `at` (0 is the first). Returns this rank's error and the seconds from that iteration's
    start to it."""
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.pipeline.executor import PlanExecutor
    from megatron.dynapipe.training import pretrain

    begun: dict[int, float] = {}
    run = PlanExecutor.run

    def run_with_fault(self, plan, batches, *, iteration=0):
        begun[iteration] = time.monotonic()
        if iteration == at and rank == faulty_rank:
            self._forward = lambda *args: fault()
        return run(self, plan, batches, iteration=iteration)

    PlanExecutor.run = run_with_fault
    try:
        pretrain(parse_args([*FAULTY, "--planner-workers", "0", *layout]))
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - begun[at]
    return "no error", 0.0


def _dies(rank: int, world: int, dying_rank: int, layout: list[str], at: int) -> tuple[str, float]:
    return _train_until(rank, dying_rank, _die_after_the_handoff, layout, at)


def _die_after_the_handoff() -> None:
    """Exit mid-iteration, once the other rank has had time to read this iteration's plan: rank
    0 serves the plan store, and dying while the survivor still fetches the plan is the store's
    loss (`PlanChannel.fetch` names the planning rank then), not a peer lost mid-step."""
    time.sleep(1.0)
    os._exit(1)


@pytest.mark.parametrize(
    ("layout", "dying_rank", "p2p", "at"),
    [
        (["--pipeline-model-parallel-size", "2"], 1, True, 1),  # the last stage
        (["--pipeline-model-parallel-size", "1"], 1, False, 1),  # DP=2: in the all-reduce
        (["--pipeline-model-parallel-size", "2"], 0, True, 1),  # also the plan store's server
        (["--pipeline-model-parallel-size", "2"], 1, True, 0),  # in the first iteration
    ],
)
def test_a_rank_that_dies_is_named_by_the_survivors(layout, dying_rank, p2p, at) -> None:
    results = run_ranks(_dies, 2, dying_rank, layout, at, timeout_s=60, may_die={dying_rank})
    assert results[dying_rank] is None
    survivor = 1 - dying_rank
    error, spent = results[survivor]
    # Index `at` is the progress line's "iteration {at + 1}/3", and so the error's.
    assert error.startswith(
        f"PeerFailure: rank {survivor}, iteration {at + 1}: rank {dying_rank} stopped answering"
    ), error
    assert p2p == (f"rank {dying_rank} did not complete the transfer" in error)
    assert spent < 3 * TIMEOUT_S


def _hangs(rank: int, world: int, layout: list[str], pid_file: Path) -> tuple[str, float] | None:
    """Rank 1 hangs (alive, heartbeating) in iteration 2; rank 0 stops it once it has failed."""
    if rank == 1:
        pid_file.write_text(str(os.getpid()))
        return _train_until(rank, 1, lambda: time.sleep(3600), layout)
    result = _train_until(rank, 1, lambda: None, layout)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return result


@pytest.mark.parametrize(
    ("layout", "p2p"),
    [
        (["--pipeline-model-parallel-size", "2"], True),  # a plan's transfer times out
        (["--pipeline-model-parallel-size", "1"], False),  # the DP group's all-reduce does
    ],
)
def test_a_rank_that_hangs_ends_the_job_within_the_timeout(tmp_path, layout, p2p) -> None:
    results = run_ranks(_hangs, 2, layout, tmp_path / "pid", timeout_s=60, may_die={1})
    error, spent = results[0]
    assert error.startswith("PeerFailure: rank 0, iteration 2: every other rank still answers")
    assert p2p == ("rank 1 did not complete the transfer within 5 s" in error), error
    assert TIMEOUT_S <= spent < 3 * TIMEOUT_S


def _planner_hangs(rank: int, world: int) -> tuple[str, float]:
    from stalled_planner import NeverAnswers

    from megatron.dynapipe import iterations
    from megatron.dynapipe.pipeline import plan_source

    recipe = plan_source.planner_recipe

    def stalled_recipe(*args):
        real = recipe(*args)
        return dataclasses.replace(real, cost_model=NeverAnswers(real.cost_model))

    iterations.planner_recipe = stalled_recipe
    asked: list[float] = []
    get = plan_source.PlanSource.get

    def timed_get(self, iteration, batch):
        asked.append(time.monotonic())
        return get(self, iteration, batch)

    plan_source.PlanSource.get = timed_get
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    try:
        pretrain(parse_args([*FAULTY, "--planner-workers", "1"]))
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - asked[0]
    return "no error", 0.0


def test_a_plan_that_never_comes_fails_every_rank_naming_the_iteration() -> None:
    (planner_error, planner_spent), (error, spent) = run_ranks(_planner_hangs, 2, timeout_s=60)
    # The first iteration is "iteration 1", as its progress line would be.
    assert planner_error.startswith("PlanTimeoutError: plan of iteration 1 not ready after")
    # The error says what the planner was doing: planning iteration 1 or, on a loaded machine
    # where the spawned worker is still importing when the timeout comes, still starting.
    assert "planning iteration 1 for" in planner_error or (
        "no plan in progress; 1 of 1 workers still starting" in planner_error
    )
    assert error.startswith("PlanTimeoutError: rank 1: no plan for iteration 1 after 5.0 s; ")
    assert "rank 0 plans and publishes it" in error
    assert planner_spent < 3 * TIMEOUT_S and spent < 3 * TIMEOUT_S


_READ_AFTER_TRUNCATION = """
import os, sys
import torch
from megatron.dynapipe.data.base import BYTE_TOKENIZER
from megatron.dynapipe.data.indexed import indexed_dataset
from megatron.dynapipe.exits import exit_status, name_bus_errors_in_workers

sys.argv[0] = "pretrain_gpt.py"  # the program every line names
dataset = indexed_dataset(sys.argv[1], 64, tokenizer=BYTE_TOKENIZER)
os.truncate(sys.argv[1] + ".bin", 0)  # as a user rewriting the file mid-training would
last = len(dataset) - 1
if sys.argv[2] == "worker":  # read in a worker process, as Megatron's own data loader does
    class Samples(torch.utils.data.Dataset):
        def __len__(self): return 1
        def __getitem__(self, index): return dataset.tokens(last)
    loader = torch.utils.data.DataLoader(Samples(), num_workers=1)
    read = lambda: next(iter(name_bus_errors_in_workers(loader)))
else:
    read = lambda: dataset.tokens(last)
sys.exit(exit_status("pretrain_gpt.py", read))
"""


@pytest.mark.parametrize("reader", ["rank", "worker"])
def test_a_data_file_truncated_while_read_is_named(tmp_path: Path, reader: str) -> None:
    """A `.bin` that shrinks under its memory map kills the reading process by SIGBUS, which
    Python cannot handle; the native handler `exit_status` installs (and Megatron's data-loader
    workers reinstall over torch's) names the file and the rank in one line instead, exit
    status 1; a SIGBUS sent by another process still kills as before."""
    import subprocess
    import sys

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(400):  # 400 documents of 50 tokens: 40 KB, ten pages
        builder.add_document(np.arange(1, 51, dtype=np.uint16), [50])
    builder.finalize(f"{prefix}.idx")
    env = {**os.environ, "RANK": "1"}
    read = subprocess.run(
        [sys.executable, "-c", _READ_AFTER_TRUNCATION, prefix, reader],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    lines = [line for line in read.stderr.splitlines() if line.startswith("pretrain_gpt.py")]
    assert read.returncode == 1, read.stderr
    reading = "rank 1" if reader == "rank" else "rank 1, data-loader worker 0"
    assert lines[0].startswith(
        f"pretrain_gpt.py: error: {reading}: {prefix}.bin changed while the job read it: "
        "bus error at byte "
    ), read.stderr
    if reader == "worker":  # then the rank's own line on its worker's end
        assert lines[1].startswith("pretrain_gpt.py: error: rank 1: DataLoader worker (pid")
    assert len(lines) == (1 if reader == "rank" else 2), read.stderr
    assert "Traceback" not in read.stderr and "Fatal Python error" not in read.stderr
    if reader == "worker":
        return
    sent = subprocess.run(
        [
            sys.executable, "-c",
            "import os, signal; from megatron.dynapipe import _bus_error; "
            "_bus_error.install('x: '); os.kill(os.getpid(), signal.SIGBUS)",
        ],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert sent.returncode == -signal.SIGBUS and sent.stderr == ""
