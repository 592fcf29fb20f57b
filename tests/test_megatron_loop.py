"""DynaPipe inside megatron.training's own `pretrain` loop (`import megatron.dynapipe.enable`).

A Megatron-LM program (`megatron_lm_program.py`: its model provider, forward_step and dataset
provider, Megatron's loop, optimiser and logging) trains on 2 CPU ranks with PP=2 and
`--dynamic-micro-batching --pipeline-schedule adaptive`, and reports the losses of our
`pretrain_gpt.py` (Megatron's loop too, with its own providers and DynaPipe's data) and of
DynaPipe's own loop (`training.pretrain`, which runs the jobs Megatron's loop cannot) with the
same seed and data: same weights (Megatron's seeding), same global batches, same plans. The
CUDA call sites megatron.training reaches are known ones.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import program_exit_status, run_ranks  # noqa: E402

CALL_SITES_FILE = Path(__file__).parent / "data" / "cuda_call_sites.txt"
PRETRAIN_GPT = str(Path(__file__).resolve().parents[1] / "pretrain_gpt.py")
USER_PROGRAM = str(Path(__file__).resolve().parent / "megatron_lm_program.py")
ITERATIONS = 3
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "128", "--pipeline-model-parallel-size", "2",
    "--dynamic-micro-batching", "--pipeline-schedule", "adaptive",
    "--tokens-per-global-batch", "2048", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "255", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--dynapipe-memory-limit", "0.01",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--train-iters", str(ITERATIONS), "--split", "100,0,0",
]  # fmt: skip
LLAMA = [
    "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
    "--num-query-groups", "2", "--position-embedding-type", "rope", "--rotary-base", "10000",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]  # fmt: skip


def _megatron_program(
    rank: int, world: int, argv: list[str], model: str
) -> tuple[list[str], list[int], list[int]]:
    """Megatron's pretrain in a forked rank (the import enables DynaPipe in this process only).
    Returns the CUDA call sites redirected, each iteration's planned global batch size and its
    number of packed micro-batches."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import megatron_lm_program

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe.megatron_loop import DynaPipeSchedule

    planned: list[int] = []
    packed: list[int] = []
    count = DynaPipeSchedule.count_samples

    def count_samples(self, args) -> None:
        planned.append(self.last.samples)
        packed.append(sum(bool(mb.row_sizes) for mb in self.last.plan.microbatches))
        count(self, args)

    DynaPipeSchedule.count_samples = count_samples
    try:
        megatron_lm_program.main(argv, model)
    except SystemExit as stop:  # Megatron's loop ends --exit-interval runs with sys.exit(0)
        assert stop.code in (0, None), stop.code
    return sorted(cpu_compat.recorded_call_sites()), planned, packed


def _our_loop(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


def iteration_rows(out: str) -> list[dict[str, str]]:
    """DynaPipe's iteration lines in `out`, read as the benchmarks read them."""
    root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, root)
    try:
        from benchmarks.torchrun_runs import iteration_rows as rows
    finally:
        sys.path.remove(root)
    return rows(out)


def _megatron_losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]


TP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]
PACKED = ["--dataloader-inter-document-masking"]


PP3 = ["--pipeline-model-parallel-size", "3", "--num-layers", "3"]


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("gpt", []),
        ("llama", []),
        ("gpt", TP2),
        ("gpt", [*PP3, *PACKED]),
        ("llama", [*TP2, *PACKED]),
    ],
    ids=["gpt", "llama", "tp2", "pp3-packed", "llama-tp2-packed"],
)
def test_megatron_pretrain_with_dynapipe_equals_our_loop(model, layout, capfd) -> None:
    """PP=2, and TP=2 (Megatron-LM's get_batch: TP rank 0 reads, megatron-core broadcasts);
    every micro-batch, packed rows among them, reaches Megatron-LM's get_batch in its
    --dataloader-inter-document-masking form, which DynaPipe turns on when the program does
    not (PACKED gives it), the middle stage of PP=3 taking only their boundaries."""
    flags = [*(FLAGS if model == "gpt" else [*FLAGS, *LLAMA]), *layout]
    world = 3 if layout[:2] == PP3[:2] else 2
    ranks = run_ranks(_megatron_program, world, flags, model, timeout_s=240)
    sites, planned, packed = zip(*ranks, strict=True)
    assert sum(packed[0]) > 0, packed  # packed rows whether the program asked or not
    out = capfd.readouterr().out
    megatron = _megatron_losses(out)
    assert len(megatron) == ITERATIONS, out[-3000:]
    # Megatron's consumed samples count the planned global batches, not 1 per iteration.
    consumed = [int(n) for n in re.findall(r"consumed samples: +(\d+)", out)]
    assert consumed == list(itertools.accumulate(planned[0])) and min(planned[0]) > 1, consumed
    dynapipe = iteration_rows(out)  # DynaPipe's line in Megatron's loop, as the benchmarks read it
    assert [int(row["it"]) for row in dynapipe] == list(range(1, ITERATIONS + 1))
    assert all(int(row["tps"].replace(",", "")) > 0 and row["predicted"] for row in dynapipe)
    ours = run_ranks(_our_loop, world, flags, timeout_s=240)[0]
    assert [float(row["loss"]) for row in dynapipe] == pytest.approx(ours, abs=1e-4)
    if (model == "gpt" and not layout) or layout == [*TP2, *PACKED]:  # pretrain_gpt.py's providers
        capfd.readouterr()  # our loop's lines
        assert (
            run_ranks(program_exit_status, world, PRETRAIN_GPT, flags, timeout_s=240) == [0] * world
        )
        rows = iteration_rows(capfd.readouterr().out)
        assert [float(row["loss"]) for row in rows] == pytest.approx(ours, abs=1e-4)
    # Megatron logs the mean loss since its last reset, and does not reset after the first
    # iteration's line: with --log-interval 1 it prints L1, (L1 + L2) / 2, L3.
    logged = [ours[0], (ours[0] + ours[1]) / 2, ours[2]]
    assert megatron == pytest.approx(logged, rel=2e-6)
    assert ours[-1] < ours[0]
    known = set(CALL_SITES_FILE.read_text().split())
    unknown = sorted(set().union(*map(set, sites)) - known)
    assert not unknown, f"new CUDA call sites, add them to {CALL_SITES_FILE.name}: {unknown}"


# What Megatron needs to train on CPU ranks without the line: its GPU defaults off by flag.
CPU_FLAGS = [
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-swiglu-fusion",
]  # fmt: skip
MEGATRON_ONLY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0",
    "--eval-interval", "1000", "--train-iters", "3", "--split", "100,0,0",
]  # fmt: skip


def _program_without_the_line(rank: int, world: int, argv: list[str]) -> None:
    """`megatron_lm_program.py` with its `import megatron.dynapipe.enable` (and pretrain_gpt.py's,
    whose forward_step it takes) a no-op, and only what runs megatron.training on CPU ranks at
    all: gloo initialisation and the prebuilt dataset helpers."""
    from megatron.training import arguments

    from megatron.dynapipe import cpu_compat, megatron_startup

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    sys.modules["megatron.dynapipe.enable"] = types.ModuleType("megatron.dynapipe.enable")
    cpu_compat.install_training()
    megatron_startup._use_prebuilt_dataset_helpers()
    import megatron_lm_program

    assert not getattr(arguments.parse_args, "_dynapipe", False)  # DynaPipe is not there
    megatron_lm_program.main(argv)


def _two_prefix_blend(directory: Path) -> list[str]:
    """--data-path of two prefixes written by megatron-core's IndexedDatasetBuilder, weighted
    0.3 and 0.7: documents of 20-300 random token ids below NullTokenizer's EOD (254)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    flags = []
    for name, weight in (("a", "0.3"), ("b", "0.7")):
        builder = IndexedDatasetBuilder(str(directory / f"{name}.bin"), dtype=np.uint16)
        for _ in range(60):
            document = [*rng.integers(0, 254, rng.integers(20, 300)), 254]
            builder.add_document(np.array(document), [len(document)])
        builder.finalize(str(directory / f"{name}.idx"))
        flags += [weight, str(directory / name)]
    return ["--data-path", *flags]


@pytest.mark.parametrize(
    ("data", "precision"),
    [("mock", []), ("mock", ["--bf16"]), ("blend", [])],
    ids=["mock-fp32", "mock-bf16", "blend-fp32"],
)
def test_the_line_without_dynapipe_flags_trains_as_megatron(
    data, precision, tmp_path, capfd
) -> None:
    """Issue 33: with the line and no DynaPipe flag, a Megatron-LM program's losses are
    Megatron's own, digit for digit (PP=2; mock data and a two-prefix blend; fp32 and bf16)."""
    source = ["--mock-data"] if data == "mock" else _two_prefix_blend(tmp_path)
    flags = [*MEGATRON_ONLY, *source, *CPU_FLAGS, *precision]
    run_ranks(_megatron_exit_status, 2, flags, timeout_s=240)
    with_line = _megatron_losses(capfd.readouterr().out)
    run_ranks(_program_without_the_line, 2, flags, timeout_s=240)
    without = _megatron_losses(capfd.readouterr().out)
    assert len(with_line) == 3 and with_line == without, (with_line, without)


def _megatron_exit_status(rank: int, world: int, argv: list[str]) -> int | str | None:
    """The exit status of `megatron_lm_program.py` (its GPT) on this forked rank."""
    return program_exit_status(rank, world, USER_PROGRAM, argv)


def test_megatron_program_ends_on_a_refused_batch_as_pretrain_gpt_does(capfd) -> None:
    """A model that fits nowhere: one line on rank 0, exit status 2 on every rank."""
    flags = [*FLAGS, "--dynapipe-memory-limit", "0.000001"]
    assert run_ranks(_megatron_exit_status, 2, flags, timeout_s=240) == [2, 2]
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith("megatron_lm_program.py: error: iteration 1: no feasible plan")


def test_megatron_program_whose_stages_hold_other_layer_counts_is_refused(capfd) -> None:
    """3 layers split [1, 2] by the program's flags, [2, 1] by DynaPipe's plans: one line
    naming the flags that fix it, exit status 2 on every rank."""
    flags = [*FLAGS, "--num-layers", "3", "--decoder-first-pipeline-num-layers", "1",
             "--decoder-last-pipeline-num-layers", "2"]  # fmt: skip
    assert run_ranks(_megatron_exit_status, 2, flags, timeout_s=240) == [2, 2]
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert errors == [
        "megatron_lm_program.py: error: the model's pipeline stages hold other layer counts "
        "than DynaPipe's plans price ([2, 1]); pass --decoder-first-pipeline-num-layers 2 "
        "--decoder-last-pipeline-num-layers 1"
    ], errors


def _middle_stage_drops_boundaries(rank: int, world: int, argv: list[str]) -> int | str | None:
    """The program's get_batch on the middle stage forgets the packed boundaries."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import megatron_lm_program  # noqa: F401  (puts pretrain_gpt.py on the path)

    import pretrain_gpt  # the program's forward_step is pretrain_gpt.py's

    get_batch = pretrain_gpt.get_batch

    def forgetful(data_iterator):
        batch = get_batch(data_iterator)
        return [*batch[:5], None] if rank == 1 else batch

    pretrain_gpt.get_batch = forgetful
    return _megatron_exit_status(rank, world, argv)


def test_a_packed_micro_batch_without_its_boundaries_is_named(capfd) -> None:
    """Attention over a THD micro-batch without PackedSeqParams would span its samples: the
    stage that runs it stops (exit 2, one line); its neighbours name it as the peer lost."""
    flags = [*FLAGS, *PP3, *PACKED, "--dynapipe-timeout", "5"]
    results = run_ranks(_middle_stage_drops_boundaries, 3, flags, timeout_s=240)
    assert results[1] == 2 and results[0] == results[2] == 1, results
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert any(
        line.startswith("megatron_lm_program.py: error: stage 1: forward_step ran micro-batch")
        and "without PackedSeqParams" in line
        for line in errors
    ), errors


def _megatron_rank_dies(rank: int, world: int, argv: list[str]) -> int | str | None:
    """Rank 1 exits in the middle of the second iteration, once rank 0 has its plan."""
    import time

    from megatron.dynapipe.pipeline.executor import PlanExecutor

    run = PlanExecutor.run

    def run_or_die(self, plan, batches, *, iteration=0):
        if iteration == 1 and rank == 1:
            time.sleep(1.0)
            os._exit(1)
        return run(self, plan, batches, iteration=iteration)

    PlanExecutor.run = run_or_die
    return _megatron_exit_status(rank, world, argv)


def test_megatron_program_names_a_rank_that_died(capfd) -> None:
    """Megatron's loop, a peer lost mid-step: the survivor exits 1 naming it and the iteration."""
    flags = [*FLAGS, "--dynapipe-timeout", "5"]
    results = run_ranks(_megatron_rank_dies, 2, flags, timeout_s=240, may_die={1})
    assert results == [1, None]
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        "megatron_lm_program.py: error: rank 0, iteration 2: rank 1 stopped answering"
    ), errors[0]


def test_checkpoint_of_megatrons_loop_resumes_in_ours(tmp_path) -> None:
    """Megatron's pretrain saves (its own save_checkpoint, --exit-interval 2); pretrain_gpt.py's
    loop loads it and trains iteration 3 as the uninterrupted run did."""
    uninterrupted = run_ranks(_our_loop, 2, FLAGS, timeout_s=240)[0]
    ckpt = str(tmp_path / "ckpt")
    saved = [*FLAGS, "--save", ckpt, "--exit-interval", "2"]
    run_ranks(_megatron_program, 2, saved, "gpt", timeout_s=240)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = run_ranks(_our_loop, 2, [*FLAGS, "--load", ckpt], timeout_s=240)[0]
    assert resumed == pytest.approx(uninterrupted[2:], rel=1e-6)


def test_megatron_lm_program_under_torchrun() -> None:
    """The program as users launch it: torchrun starts the processes, Megatron's own
    initialisation creates the process group (gloo on CPU ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    program = Path(__file__).parent / "megatron_lm_program.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(program)]
    out = subprocess.run(
        [*cmd, *FLAGS], cwd=program.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_megatron_losses(out.stdout)) == ITERATIONS, out.stdout[-3000:]
    assert len(iteration_rows(out.stdout)) == ITERATIONS, out.stdout[-3000:]
