"""`pretrain_gpt.py`'s flags are Megatron's: parsed and validated by `megatron.training`, with
DynaPipe's on top; what the runtime cannot honour stops with exit status 2 and one line naming
the flag, and Megatron's own failed checks are reported the same way."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")

from megatron.dynapipe.arguments import parse_args
from megatron.dynapipe.job_config import JobConfig

MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "64", "--train-iters", "3",
]  # fmt: skip


def _refused(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*MODEL, *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_megatron_flags_keep_megatron_meaning_and_defaults() -> None:
    args = parse_args([*MODEL, "--swiglu", "--lr-decay-style", "cosine"])
    assert args.ffn_hidden_size == int(4 * 32 * 2 / 3 / 64) * 64  # Megatron's SwiGLU default
    assert args.max_position_embeddings == 64  # DynaPipe's default for a Megatron-required flag
    assert args.micro_batch_size == 1 and args.global_batch_size == 1
    assert args.log_interval == 100 and args.seed == 1234 and args.hidden_dropout == 0.1
    job = JobConfig.of(args)
    assert job.batching == "padding" and job.recompute == "auto"


@pytest.mark.parametrize(
    ("flags", "dynapipe_s", "megatron_min"),
    [
        ([], 600.0, 10),  # both defaults: 10 minutes
        (["--dynapipe-timeout", "30"], 30.0, 0.5),
        (["--distributed-timeout-minutes", "2"], 120.0, 2),
        (["--distributed-timeout-minutes", "1", "--dynapipe-timeout", "300"], 60.0, 1),
    ],
)
def test_the_smaller_timeout_bounds_every_wait_when_dynapipe_plans(
    flags, dynapipe_s, megatron_min
) -> None:
    """Issue 34: --dynapipe-timeout and --distributed-timeout-minutes agree, the smaller given
    one wins, and Megatron's process groups take it when DynaPipe plans; without a DynaPipe
    flag Megatron's groups keep Megatron's timeout."""
    args = parse_args([*MODEL, *flags, "--dynamic-micro-batching"])
    timeout_s = JobConfig.of(args).timeout_s
    assert (timeout_s, args.distributed_timeout_minutes) == (dynapipe_s, megatron_min)
    args = parse_args([*MODEL, "--dynapipe-timeout", "30"])
    assert (JobConfig.of(args).timeout_s, args.distributed_timeout_minutes) == (30.0, 10)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--context-parallel-size", "2", "--dynamic-micro-batching"], "--context-parallel-size"),
        (
            ["--num-layers-per-virtual-pipeline-stage", "1", "--batching", "padding"],
            "--num-layers-per-virtual-pipeline-stage",
        ),
        (["--fp8-format", "hybrid", "--dynamic-micro-batching"], "--fp8-format"),
        (["--tensorboard-dir", "tb", "--dynamic-strategies"], "--tensorboard-dir"),
        (["--profile", "--dynamic-strategies"], "--profile"),
        (["--sequence-parallel", "--dynamic-strategies"], "--sequence-parallel"),
        (
            ["--step-batch-size-schedule", "0:8", "--dynamic-strategies"],
            "--step-batch-size-schedule",
        ),
        (["--transformer-impl", "transformer_engine"], "--transformer-impl"),
        (["--attention-backend", "fused"], "--attention-backend"),
        (["--apply-layernorm-1p"], "--apply-layernorm-1p"),
        (["--dynamic-strategies", "--log-peak-memory"], "--log-peak-memory"),
    ],
)
def test_flags_the_runtime_cannot_honour_are_refused_by_name(capsys, flags, named) -> None:
    assert named in _refused(capsys, *flags)


def test_megatron_features_are_refused_only_with_a_flag_that_makes_dynapipe_plan(capsys):
    """Without DynaPipe's flags Megatron trains as it would without the line, so it takes its
    flags as it would (issue 33); with one, the line names both flags."""
    features = ["--tensorboard-dir", "tb", "--step-batch-size-schedule", "0:8", "--profile"]
    args = parse_args([*MODEL, *features])
    assert not JobConfig.of(args).plans and args.tensorboard_dir == "tb" and args.profile
    args = parse_args([*MODEL, *features, "--baseline", "megatron-1f1b"])  # Megatron itself
    assert not JobConfig.of(args).plans
    line = _refused(capsys, *features, "--dynamic-micro-batching")
    assert "error: --step-batch-size-schedule with --dynamic-micro-batching: batch-size" in line
    # Megatron's loop keeps TensorBoard and the profiler under DynaPipe's schedule.
    args = parse_args([*MODEL, "--tensorboard-dir", "tb", "--profile", "--dynamic-micro-batching"])
    assert JobConfig.of(args).plans and args.tensorboard_dir == "tb" and args.profile


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--seq-length", "0"),
        ("--dynapipe-timeout", "0"),
        ("--dynapipe-timeout", "-5"),
        ("--dynapipe-memory-limit-gib", "nan"),
        ("--dynapipe-memory-limit-gib", "0"),
        ("--dynapipe-memory-limit-gib", "inf"),
        ("--seed", "0"),
    ],
)
def test_numbers_that_must_be_positive_are_refused_by_name(capsys, flag, value) -> None:
    line = _refused(capsys, flag, value)
    assert flag in line and "positive" in line, line


@pytest.mark.parametrize(
    ("old", "new"), [("--dynapipe-memory-limit", "--dynapipe-memory-limit-gib")]
)
def test_an_old_spelling_is_refused_naming_its_replacement(capsys, old, new) -> None:
    """One vocabulary (#35): the old flag is no alias; it stops with one line naming the new."""
    line = _refused(capsys, old, "1", "--dynamic-micro-batching")
    assert line.endswith(f": error: {old} was renamed {new}"), line
    assert parse_args([*MODEL, new, "1"]).dynapipe_memory_limit_gib == 1.0


def test_megatron_check_failures_are_one_line(capsys) -> None:
    line = _refused(capsys, "--hidden-size", "30")  # heads do not divide the hidden size
    assert "--hidden-size % --num-attention-heads" in line


def test_batch_is_samples_or_tokens_never_both(capsys) -> None:
    tokens = parse_args([*MODEL, "--tokens-per-global-batch", "4096"])
    assert tokens.tokens_per_global_batch == 4096
    samples = parse_args([*MODEL, "--global-batch-size", "8"])
    assert samples.tokens_per_global_batch is None and samples.global_batch_size == 8
    line = _refused(capsys, "--global-batch-size", "8", "--tokens-per-global-batch", "4096")
    assert "--global-batch-size" in line and "--tokens-per-global-batch" in line
    with pytest.raises(SystemExit):  # an iteration's sample count varies with a token budget
        flags = [f for f in MODEL if f not in ("--train-iters", "3")]
        parse_args([*flags, "--tokens-per-global-batch", "4096", "--train-samples", "24"])
    assert "--train-samples" in capsys.readouterr().err
    line = _refused(capsys, "--tokens-per-global-batch", "63")  # MODEL's --seq-length is 64
    assert "--tokens-per-global-batch 63 is below one sequence (--seq-length 64)" in line


def test_train_samples_count_iterations_of_global_batches() -> None:
    flags = [f for f in MODEL if f not in ("--train-iters", "3")]
    args = parse_args([*flags, "--train-samples", "24", "--global-batch-size", "8"])
    assert args.train_iters == 3


def test_megatron_recompute_flags_fix_the_planner_mode(capsys) -> None:
    planned = [*MODEL, "--dynamic-micro-batching"]
    args = parse_args([*planned, "--recompute-activations"])
    assert JobConfig.of(args).recompute == "selective"
    assert args.recompute_granularity is None  # the executor switches modes per plan
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    args = parse_args([*planned, *full, "--recompute-num-layers", "1"])
    assert JobConfig.of(args).recompute == "full"
    line = _refused(capsys, "--dynamic-micro-batching", "--recompute-activations",
                    "--dynapipe-recompute", "none")  # fmt: skip
    assert "--recompute-granularity" in line and "--dynapipe-recompute" in line


def test_without_dynapipe_batching_megatron_recomputes_as_its_flags_say() -> None:
    """Megatron's loop without a DynaPipe batching flag is Megatron's: its recomputation flags
    stay, block recomputation of some layers included."""
    block = ["--recompute-granularity", "full", "--recompute-method", "block"]
    args = parse_args([*MODEL, *block, "--recompute-num-layers", "2"])
    assert not JobConfig.of(args).plans
    assert (args.recompute_granularity, args.recompute_method) == ("full", "block")
    assert args.recompute_num_layers == 2


def test_gpu_only_defaults_are_switched_off_with_a_note() -> None:
    args = parse_args(MODEL)
    assert args.transformer_impl == "local"
    assert not args.bias_gelu_fusion and not args.apply_rope_fusion
    assert any("local layer spec" in note for note in JobConfig.of(args).notes)


def test_argparse_errors_are_one_line_without_megatrons_usage(capsys) -> None:
    line = _refused(capsys, "--tokenizer-type", "Foo")
    assert "--tokenizer-type" in line and "'Foo'" in line


def test_every_number_rule_names_a_numeric_flag() -> None:
    """A rule under a destination no flag has checks nothing (`--norm-epsilon` is stored as
    `layernorm_epsilon`, for one)."""
    from megatron.dynapipe.arguments import _NUMBERS, _parser, add_dynapipe_args

    assert sorted(set(_NUMBERS) - set(_parser(add_dynapipe_args)[2])) == []


def test_help_lists_every_flag_megatrons_and_dynapipes(capsys) -> None:
    """megatron-core 0.19.2's help of `--moe-paged-stash-buffer-size-factor-cuda` holds a bare
    `%` ("10%)") that made every program's `--help` a traceback; here it prints, exit 0."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--moe-paged-stash-buffer-size-factor-cuda", "--seq-length", "--dynapipe-gpu"):
        assert flag in out
    assert "10%)" in out  # the escaped percent prints as one


def test_help_text_percent_signs_are_escaped_once() -> None:
    import argparse

    from megatron.dynapipe.arguments import _printable_help

    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--a", default=3, help="up 10%) by %(default)s, 5%% of it")
    assert "up 10%) by 3, 5% of it" in _printable_help(parser).format_help()


@pytest.fixture
def hooked_parse_args(monkeypatch):
    """megatron.training's own `parse_args` as `import megatron.dynapipe.enable` hooks it for a
    Megatron-LM program, reading `sys.argv`; the module's functions are restored afterwards."""
    from megatron.training import arguments as megatron_arguments

    from megatron.dynapipe import megatron_hooks

    for name in ("parse_args", "validate_args"):
        monkeypatch.setattr(megatron_arguments, name, getattr(megatron_arguments, name))
    megatron_hooks.install(megatron_hooks.PARSER)
    return megatron_arguments.parse_args


def test_help_of_a_megatron_program_with_the_one_line(
    capsys, monkeypatch, hooked_parse_args
) -> None:
    """A Megatron-LM program's own `parse_args`, hooked by `import megatron.dynapipe.enable`."""
    import sys

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        hooked_parse_args()
    assert exit_info.value.code == 0
    assert "--moe-paged-stash-buffer-size-factor-cuda" in capsys.readouterr().out


def test_gpt2_files_without_a_type_take_upstreams_default(tmp_path) -> None:
    """Upstream's GPT-3 script passes the GPT-2 files and relies on upstream's `pretrain_gpt.py`
    defaulting --tokenizer-type to GPT2BPETokenizer; with no tokenizer flag, the byte one."""
    files = ["--vocab-file", str(tmp_path / "v.json"), "--merge-file", str(tmp_path / "m.txt")]
    assert parse_args([*MODEL, *files]).tokenizer_type == "GPT2BPETokenizer"
    assert parse_args(MODEL).tokenizer_type is None


def test_per_token_loss_only_when_dynapipe_plans(monkeypatch, hooked_parse_args) -> None:
    """A Megatron-LM program with the one line and no DynaPipe flag keeps its loss as its flags
    say (issue 33: neutral when off); DynaPipe's plans weigh every token equally."""
    import sys

    for flags, per_token in (([], False), (["--calculate-per-token-loss"], True)):
        monkeypatch.setattr(sys, "argv", ["program.py", *MODEL, *flags])
        assert hooked_parse_args().calculate_per_token_loss is per_token
    monkeypatch.setattr(sys, "argv", ["program.py", *MODEL, "--dynamic-micro-batching"])
    assert hooked_parse_args().calculate_per_token_loss is True
