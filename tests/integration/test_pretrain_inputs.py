"""`pretrain_gpt.py` against bad inputs (#18), the cases of `tools/sweep_pretrain_inputs.py`:
every numeric DynaPipe flag and Megatron's main numeric flags given nan, inf, -1, 0 where the
flag must be positive, 2**63 and a word, and bad data, checkpoint and plan paths. Each must be
refused with exit status 2 and one stderr line naming the flag or path, no traceback and no
file written, and before torch.distributed starts (no process group, no model): the program
runs in a forked process, stopped where the process group would start. A case that gets that far
runs for real as a one-rank job instead (a missing cost table is read by the planner, after).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from paths import ROOT

pytest.importorskip("megatron.training")

TOOL = ROOT / "tools" / "sweep_pretrain_inputs.py"


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep_pretrain_inputs", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sweep_pretrain_inputs"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


sweep = _sweep()


@pytest.fixture(scope="module", autouse=True)
def imported():
    """The modules the program imports, imported once here so that each forked run is quick
    (importing does not enable DynaPipe; running the program does, in the fork only), and
    Megatron's parser built once (its help texts, read from source, are then memoized)."""
    from distributed import import_rank_modules

    import_rank_modules()


@pytest.mark.parametrize("case", sweep.numeric_cases(), ids=lambda case: case.label)
def test_a_bad_number_is_refused_before_the_job_starts(case, tmp_path) -> None:
    outcome = sweep.until_process_group(case, tmp_path)
    assert outcome is not None, f"{case.label} got as far as starting torch.distributed"
    assert outcome.kind == "refused", f"{outcome.kind}: {outcome.detail}"


def test_bad_paths_are_refused(tmp_path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    started = []
    for index, case in enumerate(sweep.path_cases(scratch)):
        workdir = tmp_path / f"run-{index}"
        workdir.mkdir()
        outcome = sweep.until_process_group(case, workdir)
        if outcome is None:
            started.append(case.label)
            outcome = sweep.real_run(case, workdir, timeout_s=120)
        assert outcome.kind == "refused", f"{case.label}: {outcome.kind}: {outcome.detail}"
    assert started == ["--dynapipe-cost-model missing"]  # the rest stop before any group
