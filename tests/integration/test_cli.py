"""The command-line tools end to end: the comparison table, plan files that the simulator
accepts, traces, and clear errors (exit status 2) that name the offending input."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dynapipe_planner.cli import plan_main, simulate_main

SMALL = [
    "--model", "gpt-350m", "--gpu", "A100-40GB", "--pipeline-model-parallel-size", "2",
    "--num-gpus", "4",
]  # fmt: skip


def test_comparison_table_lists_every_method(capsys):
    assert (
        plan_main(
            [
                *SMALL,
                "--preset",
                "flan",
                "--num-samples",
                "400",
                "--seq-length",
                "2048",
                "--tokens-per-global-batch",
                "16384",
                "--iterations",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    for method in ("dynapipe", "dynamic+1f1b", "packing+1f1b", "token-budget+1f1b", "padding+1f1b"):
        assert method in out.out
    assert "[2/2]" in out.err  # progress for multi-iteration runs


@pytest.mark.parametrize("fmt", ["json", "bin"])
def test_written_plans_simulate_cleanly(tmp_path, capsys, fmt):
    out_dir = tmp_path / "plans"
    assert (
        plan_main(
            [
                *SMALL,
                "--preset",
                "lognormal",
                "--num-samples",
                "300",
                "--tokens-per-global-batch",
                "20000",
                "--iterations",
                "2",
                "--batching",
                "dynamic",
                "--output-dir",
                str(out_dir),
                "--format",
                fmt,
                "--json",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().out)["dynamic+adaptive"]
    files = sorted(out_dir.iterdir())
    assert [f.name for f in files] == [f"iter_0000{i}.{fmt}" for i in range(2)]
    trace, png = tmp_path / "trace.json", tmp_path / "t.png"
    assert simulate_main([str(files[0]), "--trace", str(trace), "--png", str(png)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["makespan_s"] == pytest.approx(stats[0]["predicted_iteration_s"], rel=0.05)
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lengths_file(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in [100, 2000, 30, 700] * 50))
    assert (
        plan_main(
            [
                *SMALL,
                "--lengths",
                str(path),
                "--batching",
                "dynamic",
                "--tokens-per-global-batch",
                "50000",
            ]
        )
        == 0
    )
    assert "dynamic+adaptive" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-404"], "neither a preset"),
        (["--gpu", "Z80"], "unknown GPU type 'Z80'"),
        (["--cost-table", "/nonexistent/table.json"], "cannot read cost table"),
        (["--tensor-model-parallel-size", "3"], "TP=3 does not divide"),
    ],
)
def test_bad_arguments_are_explained(capsys, args, message):
    assert plan_main(["--preset", "lognormal", "--num-samples", "50", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_lengths_file_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.txt"
    path.write_text("12\n40\n0\n7\n")
    assert plan_main([*SMALL, "--lengths", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.txt" in err and "line 3" in err


def test_a_budget_below_the_longest_sample_or_a_deep_record_is_one_line(tmp_path, capsys):
    """Issue 34 sweep: a global batch that cannot hold the longest sample is refused (it planned
    one sample a batch); a 100,000-deep JSON line is named, not a RecursionError."""
    path = tmp_path / "lengths.txt"
    path.write_text("100\n900\n")
    assert plan_main([*SMALL, "--lengths", str(path), "--tokens-per-global-batch", "500"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dynapipe-plan: error: --tokens-per-global-batch 500 cannot hold the longest sample (900 "
        "tokens); a global batch holds whole samples (--seq-length truncates)"
    )
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"length": 5}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    assert plan_main([*SMALL, "--lengths", str(deep)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "deep.jsonl line 2: invalid JSON (nested too deeply)" in line


def test_sample_that_never_fits_is_named_exit_2_and_nothing_written(tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text("100\n200\n120000\n")  # dataset id 2, wherever shuffling puts it
    out_dir = tmp_path / "plans"
    flags = ["--lengths", str(path), "--batching", "dynamic", "--recompute", "none"]
    flags += ["--tokens-per-global-batch", "200000", "--output-dir", str(out_dir)]
    assert plan_main([*SMALL, *flags]) == 2
    captured = capsys.readouterr()
    assert "sample 2 (length 120000)" in captured.out  # the table says why
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("dynapipe-plan: error: iteration 1: no plan")
    assert "sample 2 (length 120000)" in errors[0]
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_simulate_rejects_corrupt_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text('{"version": 1, "num_stages": 2}')
    assert simulate_main([str(path)]) == 2
    assert "plan is missing 'microbatches'" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("dynapipe-plan") is None, reason="package not installed")
def test_console_script():
    done = subprocess.run(
        [
            "dynapipe-plan",
            "--preset",
            "lognormal",
            "--num-samples",
            "100",
            "--pipeline-model-parallel-size",
            "2",
            "--model",
            "gpt-125m",
            "--batching",
            "dynamic",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "dynamic+adaptive" in done.stdout
