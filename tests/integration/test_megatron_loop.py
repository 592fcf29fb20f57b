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

import gzip
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from paths import ROOT, TESTS

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import program_exit_status, run_ranks  # noqa: E402

CALL_SITES_FILE = TESTS / "data" / "cuda_call_sites.txt"
PRETRAIN_GPT = str(ROOT / "pretrain_gpt.py")
USER_PROGRAM = str(TESTS / "megatron_lm_program.py")
ITERATIONS = 3
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "128", "--pipeline-model-parallel-size", "2",
    "--dynamic-micro-batching", "--pipeline-schedule", "adaptive",
    "--tokens-per-global-batch", "2048", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "255", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--dynapipe-memory-limit-gib", "0.01",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--train-iters", str(ITERATIONS), "--split", "100,0,0",
]  # fmt: skip
LLAMA = [
    "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
    "--num-query-groups", "2", "--position-embedding-type", "rope", "--rotary-base", "10000",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]  # fmt: skip


def _count_planned() -> tuple[list[int], list[int]]:
    """From now on in this rank, each iteration's planned global batch size and its number of
    packed micro-batches."""
    from megatron.dynapipe.megatron_loop import DynaPipeSchedule

    planned: list[int] = []
    packed: list[int] = []
    count = DynaPipeSchedule.count_samples

    def count_samples(self, args) -> None:
        planned.append(self.last.samples)
        packed.append(sum(bool(mb.row_sizes) for mb in self.last.plan.microbatches))
        count(self, args)

    DynaPipeSchedule.count_samples = count_samples
    return planned, packed


def _megatron_program(
    rank: int, world: int, argv: list[str], model: str, data: str = "megatron"
) -> tuple[list[str], list[int], list[int]]:
    """Megatron's pretrain in a forked rank (the import enables DynaPipe in this process only).
    Returns the CUDA call sites redirected, each iteration's planned global batch size and its
    number of packed micro-batches."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import megatron_lm_program

    from megatron.dynapipe import cpu_compat

    planned, packed = _count_planned()
    try:
        megatron_lm_program.main(argv, model, data)
    except SystemExit as stop:  # Megatron's loop ends --exit-interval runs with sys.exit(0)
        assert stop.code in (0, None), stop.code
    return sorted(cpu_compat.recorded_call_sites()), planned, packed


def _pretrain_gpt(rank: int, world: int, argv: list[str]) -> tuple[int | str | None, list[int]]:
    """pretrain_gpt.py's exit status on a forked rank and its packed micro-batches."""
    _, packed = _count_planned()
    return program_exit_status(rank, world, PRETRAIN_GPT, argv), packed


def _our_loop(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


def iteration_rows(out: str) -> list[dict[str, str]]:
    """DynaPipe's iteration lines in `out`, read as the benchmarks read them."""
    from benchmarks.torchrun_runs import iteration_rows as rows

    return rows(out)


def _megatron_losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]


TP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]
PACKED = ["--dataloader-inter-document-masking"]


PP3 = ["--pipeline-model-parallel-size", "3", "--num-layers", "3"]


def _reference_program(rank: int, world: int, argv: list[str], model: str, data: str) -> None:
    """The same program without DynaPipe's flags, in Megatron's own schedule; its THD
    micro-batches reach megatron-core's local attention through the per-sample attention
    DynaPipe's runs use on CPU (`packed_attention`)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import megatron_lm_program
    from megatron.training import training

    from megatron.dynapipe.packed_attention import use_packed_attention

    setup = training.setup_model_and_optimizer

    def setup_model_and_optimizer(*args, **kwargs):
        model, *rest = setup(*args, **kwargs)
        return [use_packed_attention(chunk) for chunk in model], *rest

    training.setup_model_and_optimizer = setup_model_and_optimizer
    megatron_lm_program.main(argv, model, data)


# What the reference run gives instead of DynaPipe's flags: Megatron's global batch of the
# samples a DynaPipe batch of 2,048 tokens takes (16 windows of 128), per-token loss and the
# per-document attention DynaPipe turns on.
DYNAPIPE_ONLY = [
    "--dynamic-micro-batching", "--pipeline-schedule", "adaptive",
    "--tokens-per-global-batch", "2048", "--dynapipe-memory-limit-gib", "0.01",
]  # fmt: skip
AS_MEGATRON = ["--global-batch-size", "16", "--micro-batch-size", "1",
               "--calculate-per-token-loss", "--dataloader-inter-document-masking"]  # fmt: skip


def without_dynapipe(flags: list[str]) -> list[str]:
    """`flags` less DynaPipe's (`DYNAPIPE_ONLY`, each with its value), plus `AS_MEGATRON`."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in DYNAPIPE_ONLY:
            skip = flag not in ("--dynamic-micro-batching",)
        else:
            kept.append(flag)
    return [*kept, *AS_MEGATRON]


@pytest.mark.parametrize(
    ("model", "layout"),
    [("gpt", []), ("llama", TP2), ("gpt", PP3)],
    ids=["gpt", "llama-tp2", "pp3"],
)
def test_megatron_program_trains_its_own_samples_with_dynapipe(
    model, layout, tmp_path, capfd
) -> None:
    """Issue 33: a Megatron-LM program under --dynamic-micro-batching trains the samples its own
    provider returns (megatron-core's MockGPTDataset: windows of 128), read in Megatron's
    order: the losses per token are those of the same program in Megatron's schedule with
    that global batch (PP=2; Llama with TP=2, where TP rank 0 reads; PP=3, whose middle stage
    reads only the boundaries), and Megatron's consumed samples and global batch size count
    the planned batches.
    With --tensorboard-dir (PP=2) Megatron's event file holds DynaPipe's metrics beside its own,
    and with --profile its torch profiler's trace shows DynaPipe's instructions."""
    flags = [*(FLAGS if model == "gpt" else [*FLAGS, *LLAMA]), *layout]
    if not layout:
        flags += ["--tensorboard-dir", str(tmp_path / "tb"), "--profile", "--use-pytorch-profiler",
                  "--profile-step-start", "2", "--profile-step-end", "3"]  # fmt: skip
    world = 3 if layout == PP3 else 2
    ranks = run_ranks(_megatron_program, world, flags, model, timeout_s=240)
    sites, planned, _ = zip(*ranks, strict=True)
    out = capfd.readouterr().out
    dynapipe = _megatron_losses(out)
    assert len(dynapipe) == ITERATIONS, out[-3000:]
    assert list(planned[0]) == [16] * ITERATIONS, planned
    consumed = [int(n) for n in re.findall(r"consumed samples: +(\d+)", out)]
    assert consumed == [16, 32, 48], consumed
    assert re.findall(r"global batch size: +(\d+)", out) == ["16"] * ITERATIONS, out[-3000:]
    rows = iteration_rows(out)  # DynaPipe's line in Megatron's loop, as the benchmarks read it
    assert [int(row["it"]) for row in rows] == list(range(1, ITERATIONS + 1))
    assert all(int(row["tps"].replace(",", "")) > 0 and row["predicted"] for row in rows)
    if not layout:
        _check_events(tmp_path / "tb", [float(row["loss"]) for row in rows])
        with gzip.open(tmp_path / "torch_profile" / "rank-0.json.gz", "rt") as trace:
            assert "DynaPipe ForwardPass mb" in trace.read()  # the executor's ranges
    run_ranks(_reference_program, world, without_dynapipe(flags), model, "megatron", timeout_s=240)
    megatron = _megatron_losses(capfd.readouterr().out)
    assert dynapipe == pytest.approx(megatron, rel=1e-5), (dynapipe, megatron)
    assert dynapipe[-1] < dynapipe[0]
    known = set(CALL_SITES_FILE.read_text().split())
    unknown = sorted(set().union(*map(set, sites)) - known)
    assert not unknown, f"new CUDA call sites, add them to {CALL_SITES_FILE.name}: {unknown}"


def test_megatrons_flops_accounting_counts_the_planned_samples() -> None:
    """Issue 33: after a planned step Megatron's FLOPs accounting (its TFLOP/s field) holds the
    pipeline's real tokens and per-sample attention, not what the program's `forward_step`
    counted from cu_seqlens whose segments include each row's padding."""
    from megatron.training import training

    from dynapipe_planner.plan import ExecutionPlan, MicroBatch
    from megatron.dynapipe.megatron_loop import _count_planned_tokens

    lengths = np.array([5, 9, 3, 7])
    plan = ExecutionPlan(
        num_stages=1,
        num_replicas=2,
        microbatches=[
            MicroBatch(0, 0, [0, 2], 5),
            MicroBatch(1, 1, [1], 9),
            MicroBatch(2, 0, [3], 7),
        ],
        ranks=[],
    )
    training.update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 5, 8, 9]))  # padding too
    _count_planned_tokens(plan, 0, lengths, torch.device("cpu"))
    assert training.consume_seqlen_stats_in_iteration() == (15.0, 25.0 + 9.0 + 49.0)


# FLAGS on the built-in corpus: DynaPipe's own documents of every length, in its seeded order.
MOCK_DATA = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255")
BUILT_IN_CORPUS = [flag for flag in FLAGS if flag not in MOCK_DATA]


def _losses_of(rank: int, world: int, program: str, argv: list[str]) -> list[float]:
    """`program` on a forked rank: each iteration's loss as Megatron's step reduced it, at full
    precision (the last rank; none elsewhere)."""
    from megatron.dynapipe import megatron_loop

    losses: list[float] = []
    log_step = megatron_loop._log_step

    def logged(args, work, reported, *rest, **kwargs):
        if reported:
            losses.append(float(reported["lm loss"]))
        return log_step(args, work, reported, *rest, **kwargs)

    megatron_loop._log_step = logged
    assert program_exit_status(rank, world, program, argv) == 0
    return losses


@pytest.mark.parametrize(
    ("program", "dropout"),
    [(PRETRAIN_GPT, "0"), (USER_PROGRAM, "0.1")],
    ids=["pretrain_gpt", "program-dropout"],
)
@pytest.mark.slow
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, program, dropout) -> None:
    """Issue 34: 6 iterations straight, or 3, saved, and 3 more after --load: the same losses
    to the last bit, with and without dropout, on DynaPipe's samples of the built-in corpus
    (pretrain_gpt.py) and on the program's MockGPTDataset, read on from Megatron's consumed
    samples, which its own unread training loader does not refuse (the data position, the optimiser
    state and the dropout stream restored; on CPU ranks the data loaders Megatron builds after
    a load must not draw from the dropout stream, `cpu_compat`)."""
    data = BUILT_IN_CORPUS if program == PRETRAIN_GPT else FLAGS
    flags = [*data, "--hidden-dropout", dropout, "--attention-dropout", dropout,
             "--train-iters", "6"]  # fmt: skip
    straight = run_ranks(_losses_of, 2, program, flags, timeout_s=240)[1]
    ckpt = str(tmp_path / "ckpt")
    saved = [*flags, "--save", ckpt, "--exit-interval", "3"]
    first = run_ranks(_losses_of, 2, program, saved, timeout_s=240)[1]
    resumed = run_ranks(_losses_of, 2, program, [*flags, "--load", ckpt], timeout_s=240)[1]
    assert len(straight) == 6 and first + resumed == straight, (straight, first, resumed)


@pytest.mark.parametrize(
    "precision", [["--bf16"], ["--fp16", "--loss-scale", "1"]], ids=["bf16", "fp16"]
)
@pytest.mark.slow
def test_a_half_precision_job_saves_and_resumes_bitwise(tmp_path, precision) -> None:
    """Issue 34: bf16 and fp16 saves hung on CPU ranks (an empty `iter_N/` left behind); on 2
    CPU ranks under DynaPipe they save, and 2 iterations after --load repeat the uninterrupted
    run's to the last bit (fp16 with a fixed loss scale: a dynamic one skips the first steps,
    leaving no optimizer state to save, `test_megatron_checkpoints`)."""
    flags = [*FLAGS, *precision, "--train-iters", "4"]
    straight = run_ranks(_losses_of, 2, PRETRAIN_GPT, flags, timeout_s=240)[1]
    ckpt = str(tmp_path / "ckpt")
    saved = [*flags, "--save", ckpt, "--exit-interval", "2"]
    first = run_ranks(_losses_of, 2, PRETRAIN_GPT, saved, timeout_s=240)[1]
    assert (tmp_path / "ckpt" / "iter_0000002" / ".metadata").is_file()
    resumed = run_ranks(_losses_of, 2, PRETRAIN_GPT, [*flags, "--load", ckpt], timeout_s=240)[1]
    assert len(straight) == 4 and first + resumed == straight, (straight, first, resumed)


def test_megatrons_rerun_of_a_step_runs_its_plan_again() -> None:
    """Megatron's rerun state machine (`--rerun-mode validate_results`, its default) runs a
    step again when a loss or gradient check fails, to tell a transient fault from a
    reproducible one. Under DynaPipe the step runs the same plan again (it asked the plan
    store for a second plan of the iteration and stopped: "already taken"); with Megatron's own
    fault injection the rerun differs from the injected result and Megatron ends the job for a
    restart, exit status 17, as it does without DynaPipe."""
    injected = [*FLAGS, "--train-iters", "2", "--error-injection-rate", "1",
                "--error-injection-type", "transient_error"]  # fmt: skip
    assert run_ranks(program_exit_status, 2, PRETRAIN_GPT, injected, timeout_s=240) == [17, 17]


def _check_events(directory: Path, losses: list[float]) -> None:
    """The TensorBoard events Megatron's writer left in `directory`: each iteration's loss (as
    DynaPipe's line printed it, to 4 decimals) and DynaPipe's scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx(losses, abs=1e-4)
    for tag in ("real-tokens-per-second", "padding-efficiency", "micro-batches",
                "global-batch-samples", "iteration-ms", "predicted-iteration-ms"):  # fmt: skip
        assert [e.step for e in events.Scalars(f"dynapipe/{tag}")] == [1, 2, 3], tags
    assert [e.value for e in events.Scalars("dynapipe/global-batch-samples")] == [16] * 3
    assert [e.value for e in events.Scalars("batch-size")] == [16] * 3  # Megatron's own


@pytest.mark.parametrize("layout", [[], [*TP2, *PACKED]], ids=["pp2", "tp2-packed"])
def test_pretrain_gpt_with_dynapipe_equals_our_loop(layout, capfd) -> None:
    """`pretrain_gpt.py`'s provider gives DynaPipe its own variable-length samples
    (`DocumentSamples`): Megatron's loop then trains what DynaPipe's own loop trains with the
    same seed and data (same weights, global batches and plans), packed rows among them."""
    flags = [*FLAGS, *layout]
    (status, packed), _ = run_ranks(_pretrain_gpt, 2, flags, timeout_s=240)
    assert status == 0 and sum(packed) > 0, (status, packed)
    out = capfd.readouterr().out
    rows = iteration_rows(out)
    assert [int(row["it"]) for row in rows] == list(range(1, ITERATIONS + 1))
    ours = run_ranks(_our_loop, 2, flags, timeout_s=240)[0]
    assert [float(row["loss"]) for row in rows] == pytest.approx(ours, abs=1e-4)
    # Megatron logs the mean loss since its last reset, and does not reset after the first
    # iteration's line: with --log-interval 1 it prints L1, (L1 + L2) / 2, L3.
    logged = [ours[0], (ours[0] + ours[1]) / 2, ours[2]]
    assert _megatron_losses(out) == pytest.approx(logged, rel=2e-6)
    assert ours[-1] < ours[0]


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
    all: gloo initialisation and the prebuilt dataset helpers (`megatron_hooks.STARTUP`)."""
    from megatron.training import arguments

    from megatron.dynapipe import cpu_compat, megatron_hooks

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    sys.modules["megatron.dynapipe.enable"] = types.ModuleType("megatron.dynapipe.enable")
    cpu_compat.install()
    megatron_hooks.install(megatron_hooks.STARTUP)
    import megatron_lm_program

    assert arguments.parse_args.__module__ == arguments.__name__  # DynaPipe is not there
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
    flags = [*FLAGS, "--dynapipe-memory-limit-gib", "0.000001"]
    assert run_ranks(_megatron_exit_status, 2, flags, timeout_s=240) == [2, 2]
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        "megatron_lm_program.py: error: the program's MockGPTDataset: before "
        "training, a global batch of"
    ), errors[0]
    assert "no feasible plan" in errors[0]


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


def _megatron_rank_dies_as_under_torchrun(
    rank: int, world: int, argv: list[str], pid_file: Path
) -> int | str | None:
    """Rank 1 dies in the second iteration and rank 0 gets SIGTERM at once, as torchrun
    stops the other workers when one dies."""
    import signal
    import time

    from megatron.dynapipe.pipeline.executor import PlanExecutor

    if rank == 0:
        pid_file.write_text(str(os.getpid()))
    run = PlanExecutor.run

    def run_or_die(self, plan, batches, *, iteration=0):
        if iteration == 1 and rank == 1:
            time.sleep(1.0)
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
            os._exit(1)
        return run(self, plan, batches, iteration=iteration)

    PlanExecutor.run = run_or_die
    return _megatron_exit_status(rank, world, argv)


def test_a_rank_stopped_by_its_launcher_names_the_rank_that_died(tmp_path, capfd) -> None:
    """Megatron's loop, a peer lost mid-step: the survivor exits 1 naming it and the
    iteration, also when SIGTERM (torchrun's, after a worker died) reaches it first (issue 34:
    it ended silently)."""
    flags = [*FLAGS, "--dynapipe-timeout", "10"]
    results = run_ranks(_megatron_rank_dies_as_under_torchrun, 2, flags, tmp_path / "pid",
                        timeout_s=240, may_die={1})  # fmt: skip
    assert results == [1, None]
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith("megatron_lm_program.py: error: rank 0, iteration 2: "), errors
    assert "rank 1 stopped answering" in errors[0], errors[0]


def _megatron_rank_freezes(rank: int, world: int, argv: list[str], pid_file: Path) -> Any:
    """Rank 1 freezes whole (SIGSTOP: no heartbeat either) in iteration 2, after its planned
    passes, where megatron-core's gradient sync waits on it in a group megatron.training
    built; rank 0 returns its exit status and seconds from its start, then kills rank 1."""
    import signal
    import time

    from megatron.dynapipe.pipeline.executor import PlanExecutor

    if rank == 1:
        pid_file.write_text(str(os.getpid()))
        run = PlanExecutor.run

        def run_then_freeze(self, plan, batches, *, iteration=0):
            if iteration == 1:
                finalize = self.config.finalize_model_grads_func

                def frozen(*args, **kwargs):
                    os.kill(os.getpid(), signal.SIGSTOP)
                    return finalize(*args, **kwargs)

                self.config.finalize_model_grads_func = frozen
            return run(self, plan, batches, iteration=iteration)

        PlanExecutor.run = run_then_freeze
        return _megatron_exit_status(rank, world, argv)
    started = time.monotonic()
    status = _megatron_exit_status(rank, world, argv)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return status, time.monotonic() - started


def test_megatron_program_names_a_frozen_rank_within_the_timeout(tmp_path, capfd) -> None:
    """Issue 34: a rank frozen in Megatron's gradient sync (its group built by megatron.training
    with --distributed-timeout-minutes) ends the job within --dynapipe-timeout, the smaller of
    the two, with one line naming the rank; the groups had waited 10 minutes."""
    flags = [*FLAGS, "--dynapipe-timeout", "10", "--distributed-timeout-minutes", "10"]
    results = run_ranks(_megatron_rank_freezes, 2, flags, tmp_path / "pid", timeout_s=240,
                        may_die={1})  # fmt: skip
    (status, spent), _ = results
    errors = [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]
    assert status == 1 and len(errors) == 1, errors
    assert errors[0].startswith(
        "megatron_lm_program.py: error: rank 0, iteration 2: rank 1 stopped answering"
    ), errors[0]
    assert spent < 120, spent  # start-up, two iterations, one timeout


@pytest.mark.slow
def test_checkpoint_of_megatrons_loop_resumes_in_ours(tmp_path) -> None:
    """Megatron's pretrain saves (its own save_checkpoint, --exit-interval 2, pretrain_gpt.py
    in Megatron's loop); DynaPipe's own loop loads it and trains iteration 3 as the
    uninterrupted run did."""
    uninterrupted = run_ranks(_our_loop, 2, FLAGS, timeout_s=240)[0]
    ckpt = str(tmp_path / "ckpt")
    saved = [*FLAGS, "--save", ckpt, "--exit-interval", "2"]
    assert run_ranks(_pretrain_gpt, 2, saved, timeout_s=240)[0][0] == 0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = run_ranks(_our_loop, 2, [*FLAGS, "--load", ckpt], timeout_s=240)[0]
    assert resumed == pytest.approx(uninterrupted[2:], rel=1e-6)


@pytest.mark.slow
def test_megatron_lm_program_under_torchrun() -> None:
    """The program as users launch it: torchrun starts the processes, Megatron's own
    initialisation creates the process group (gloo on CPU ranks). It runs as a module from the
    repository root, where it finds pretrain_gpt.py's `forward_step`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m"]
    out = subprocess.run(
        [*cmd, "tests.megatron_lm_program", *FLAGS], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_megatron_losses(out.stdout)) == ITERATIONS, out.stdout[-3000:]
    assert len(iteration_rows(out.stdout)) == ITERATIONS, out.stdout[-3000:]
