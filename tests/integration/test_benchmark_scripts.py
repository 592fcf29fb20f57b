"""Every benchmark script in its smoke mode (issue #35): `python -m benchmarks.<name> --smoke`
(a tiny configuration, one round) must end well, so an API change that breaks a benchmark fails
CI. The scripts are found by globbing benchmarks/*.py for a `main` function, so a new one is
covered without listing it; a failure names the script.

Each runs in a fork of this test process (`forked_programs`), and so do the `torchrun ...
pretrain_gpt.py` ranks and profilers it launches: the imports are paid once per worker, not per
process. A smoke run writes only under its temporary working directory (or the system's
temporary folder); `benchmarks/results/` must come out unchanged.
"""

from __future__ import annotations

import ast
import glob
import importlib
from pathlib import Path

import pytest
from forked_programs import preimport_runtime, run_forked
from paths import ROOT

BENCHMARKS_DIR = ROOT / "benchmarks"
RESULTS = BENCHMARKS_DIR / "results"
SMOKE_TIMEOUT_S = 300.0
# Stops at its CUDA check where there is none: covered up to there (import, the check, its exit
# status and message). Where a GPU is, the GPU lane runs its smoke mode (test_gpu.py).
NEEDS_CUDA = {"gpu_throughput"}


def _has_main(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


BENCHMARKS = sorted(p.stem for p in BENCHMARKS_DIR.glob("*.py") if _has_main(p))


@pytest.fixture(scope="module", autouse=True)
def imported() -> None:
    """Every benchmark module and what the programs they launch import, imported once here so
    that every fork inherits it."""
    if not preimport_runtime():
        pytest.skip("the runtime extra (torch, megatron-core) is not installed")
    for name in BENCHMARKS:
        importlib.import_module(f"benchmarks.{name}")


def _results() -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in RESULTS.rglob("*")}


def test_benchmarks_are_found() -> None:
    assert {"cpu_throughput", "executor_overhead", "plan_quality"} <= set(BENCHMARKS)
    assert "torchrun_runs" not in BENCHMARKS  # shared code, no script


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_smoke(name: str, tmp_path: Path) -> None:
    no_gpu = not glob.glob("/dev/nvidia[0-9]*")
    if name in NEEDS_CUDA and not no_gpu:
        pytest.skip("a GPU is here: the GPU lane runs this benchmark's smoke mode")
    before = _results()
    argv = ["-m", f"benchmarks.{name}", "--smoke"]
    done = run_forked(argv, cwd=tmp_path, timeout_s=SMOKE_TIMEOUT_S)
    if name in NEEDS_CUDA:
        assert done.returncode == 2 and "no CUDA device" in done.stdout, (
            f"benchmarks/{name}.py --smoke without CUDA (exit status {done.returncode}):\n"
            f"{done.stdout[-4000:]}"
        )
    else:
        assert done.returncode == 0, (
            f"benchmarks/{name}.py --smoke failed (exit status {done.returncode}):\n"
            f"{done.stdout[-4000:]}"
        )
    assert _results() == before, f"benchmarks/{name}.py --smoke wrote under benchmarks/results"
