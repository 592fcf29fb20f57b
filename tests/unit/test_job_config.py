"""The job's `JobConfig` (GitHub issue #36): built once when the flags are validated, frozen,
holding what DynaPipe derives from its flags, while Megatron's args receive only the values
Megatron's own code reads."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("megatron.training")

from megatron.dynapipe import arguments
from megatron.dynapipe.arguments import add_dynapipe_args, parse_args
from megatron.dynapipe.job_config import JobConfig, PerArgs

MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "64", "--train-iters", "3",
]  # fmt: skip

FULL_RECOMPUTE = [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1",
]  # fmt: skip

# The Megatron flags validation may set (`arguments.megatron_settings`, `_check_batch`).
MEGATRON_WRITES = {
    "global_batch_size",
    "train_iters",
    "distributed_timeout_minutes",
    "dataloader_inter_document_masking",
    "create_attention_mask_in_dataloader",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
}
DYNAPIPE_FLAGS = {action.dest for action in add_dynapipe_args(argparse.ArgumentParser())._actions}

COMMAND_LINES = [
    [],
    ["--dynamic-micro-batching", "--micro-batch-size", "2"],
    ["--batching", "packing", "--dynapipe-packed-rows", "off"],
    ["--baseline", "packing-1f1b", "--global-batch-size", "8"],
    ["--baseline", "megatron-1f1b", "--tokens-per-global-batch", "1024", "--micro-batch-size", "2"],
    ["--dynamic-micro-batching", "--recompute-activations", "--dynapipe-timeout", "30"],
    ["--dynamic-micro-batching", "--distributed-timeout-minutes", "2", "--dynapipe-timeout", "300"],
    ["--dynamic-strategies", "--device-speed", "0:2", "--strategy-window", "2"],
    ["--hetero-plan", "layout.json", "--overlap-pull-push"],
    ["--parallel-plan", "plan.json"],
    ["--dynapipe-recompute", "full"],
]


def _job(*flags: str) -> JobConfig:
    return JobConfig.of(parse_args([*MODEL, *flags]))


def test_the_config_is_frozen() -> None:
    job = _job("--dynamic-strategies")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.batching = "packing"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.hetero.strategy_window = 3  # type: ignore[misc]


def test_one_config_per_args_object() -> None:
    args = parse_args([*MODEL, "--dynamic-micro-batching"])
    job = JobConfig.of(args)
    assert JobConfig.of(args) is job
    assert JobConfig.from_args(args, {"dynapipe_timeout": "--dynapipe-timeout"}) is job
    again = parse_args([*MODEL, "--dynamic-micro-batching"])
    assert JobConfig.of(again) is not job and JobConfig.of(again) == job
    with pytest.raises(LookupError, match="not validated"):
        JobConfig.of(argparse.Namespace(**vars(args)))  # a copy is not the validated object


def test_per_args_values_are_dropped_with_their_args() -> None:
    import gc

    memo: PerArgs[int] = PerArgs()
    args = argparse.Namespace(a=1)
    memo.set(args, 7)
    assert memo.get(args) == 7 and memo.get(argparse.Namespace(a=1)) is None
    del args
    gc.collect()
    assert memo._values == {}


@pytest.mark.parametrize(
    ("flags", "plans", "batching"),
    [
        ([], False, "padding"),
        (["--dynamic-micro-batching"], True, "dynamic"),
        (["--batching", "padding"], True, "padding"),
        (["--batching", "packing"], True, "packing"),
        (["--baseline", "packing-1f1b", "--global-batch-size", "8"], True, "packing"),
        (["--baseline", "megatron-1f1b"], False, "padding"),
        (["--parallel-plan", "plan.json"], True, "padding"),
    ],
)
def test_batching_is_resolved(flags: list[str], plans: bool, batching: str) -> None:
    job = _job(*flags)
    assert (job.plans, job.batching) == (plans, batching)
    assert job.schedule == ("adaptive" if batching == "dynamic" else "1f1b")


@pytest.mark.parametrize(
    ("flags", "recompute"),
    [
        (["--dynamic-micro-batching"], "auto"),
        (["--dynamic-micro-batching", "--recompute-activations"], "selective"),
        (["--dynamic-micro-batching", "--dynapipe-recompute", "none"], "none"),
        (["--dynamic-micro-batching", *FULL_RECOMPUTE], "full"),
        (["--parallel-plan", "plan.json"], "none"),  # the plan's layers, no mode per iteration
        ([], "auto"),
        (["--recompute-activations"], "selective"),  # Megatron's loop, Megatron's mode
    ],
)
def test_recompute_is_resolved(flags: list[str], recompute: str) -> None:
    assert _job(*flags).recompute == recompute


def test_megatron_recomputes_as_its_flags_say_where_dynapipe_does_not_plan() -> None:
    block = ["--recompute-granularity", "full", "--recompute-method", "block"]
    args = parse_args([*MODEL, *block, "--recompute-num-layers", "2"])
    assert JobConfig.of(args).recompute == "full"
    assert (args.recompute_granularity, args.recompute_num_layers) == ("full", 2)
    args = parse_args([*MODEL, "--dynamic-micro-batching", "--recompute-activations"])
    assert args.recompute_granularity is None  # the executor switches each plan's mode on


@pytest.mark.parametrize(
    ("flags", "timeout_s", "planned_minutes", "megatron_minutes"),
    [
        ([], 600.0, 10, 10),
        (["--dynapipe-timeout", "30"], 30.0, 0.5, 10),
        (["--distributed-timeout-minutes", "2"], 120.0, 2, 2),
        (["--distributed-timeout-minutes", "1", "--dynapipe-timeout", "300"], 60.0, 1, 1),
        (["--distributed-timeout-minutes", "20", "--dynapipe-timeout", "300"], 300.0, 5, 20),
    ],
)
def test_the_timeout_is_the_smaller_flag_given(
    flags: list[str], timeout_s: float, planned_minutes: float, megatron_minutes: float
) -> None:
    """Megatron's groups take the job's timeout when DynaPipe plans; in Megatron's loop they
    keep Megatron's."""
    args = parse_args([*MODEL, "--dynamic-micro-batching", *flags])
    assert JobConfig.of(args).timeout_s == timeout_s
    assert args.distributed_timeout_minutes == planned_minutes
    args = parse_args([*MODEL, *flags])
    assert JobConfig.of(args).timeout_s == timeout_s
    assert args.distributed_timeout_minutes == megatron_minutes


def test_notes_say_what_start_up_decided() -> None:
    notes = _job("--dynamic-micro-batching", "--micro-batch-size", "2").notes
    cpu = [n for n in notes if "TransformerEngine" in n or "fused kernels off" in n]
    assert list(notes[: len(cpu)]) == cpu  # the CPU defaults come first
    assert any(n.startswith("per-sample attention") for n in notes)
    assert any(n.startswith("--micro-batch-size 2 is not used") for n in notes)
    assert not any(n.startswith("per-sample attention") for n in _job().notes)


def test_heterogeneous_flags_and_device_speed() -> None:
    job = _job("--dynamic-strategies", "--device-speed", "1:2", "--max-cached-strategies", "2")
    assert job.hetero.enabled and job.hetero.max_cached_strategies == 2
    assert job.slowdowns(2) == [1.0, 2.0] and not _job().hetero.enabled
    assert _job("--dynapipe-memory-limit-gib", "0.5").memory_limit_bytes == 2**29


def _validation_writes(argv: list[str]) -> tuple[set[str], set[str]]:
    """The attributes DynaPipe's checks add to the args Megatron parsed and validated, and
    those whose values they change."""
    args = arguments.parse_megatron_args(argv, add_dynapipe_args)
    before = dict(vars(args))
    arguments._check_dynapipe(args, arguments.given_flags(argv, add_dynapipe_args))
    after = vars(args)
    changed = {name for name in before if before[name] != after[name]}
    return set(after) - set(before), changed


@pytest.mark.parametrize("flags", COMMAND_LINES, ids=lambda f: " ".join(f) or "megatron")
def test_validation_writes_only_what_megatron_reads(flags: list[str]) -> None:
    added, changed = _validation_writes([*MODEL, *flags])
    assert not added
    assert changed <= MEGATRON_WRITES, changed - MEGATRON_WRITES
    args = parse_args([*MODEL, *flags])
    assert {name for name in vars(args) if name.startswith("dynapipe_")} <= DYNAPIPE_FLAGS


def test_the_write_check_sees_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = arguments.megatron_settings

    def writing(args: argparse.Namespace, job: JobConfig) -> None:
        settings(args, job)
        args.dynapipe_plans = job.plans
        args.batching = job.batching

    monkeypatch.setattr(arguments, "megatron_settings", writing)
    added, changed = _validation_writes([*MODEL, "--dynamic-micro-batching"])
    assert added == {"dynapipe_plans"} and "batching" in changed
