"""Real-run figure scripts (`examples/runs/*.sh`, issue #19): one of them end to end in TINY mode
on CPU ranks, their shell hygiene, and the log-line parser they share."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

pytest.importorskip("megatron.training")

RUNS = ROOT / "examples" / "runs"
SCRIPTS = sorted(p for p in RUNS.glob("*.sh") if not p.name.startswith("_"))  # _lib.sh: sourced


@pytest.mark.slow
def test_hexiscale_table2_tiny(tmp_path: Path) -> None:
    """One global batch x (HexiScale's plan, plain DP): two real torchrun jobs of 2 CPU ranks,
    then the PNG, CSV and note, started from another working directory."""
    env = {
        **os.environ, "TINY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
        "GLOBAL_BATCHES": "16", "LAYOUTS": "1x1",
    }  # fmt: skip
    done = subprocess.run(
        ["bash", str(RUNS / "hexiscale_table2.sh")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "runs" / "hexiscale_table2"
    assert (out / "hexiscale_table2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (out / "hexiscale_table2.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["x"], r["method"]) for r in rows] == [("16", "hexiscale"), ("16", "DP2")]
    for r in rows:
        assert r["status"] == "ok"
        assert int(r["iterations"]) == 2  # 3 iterations, 1 warm-up dropped
        for key in ("tokens_per_s", "iteration_ms", "predicted_ms", "peak_rss_gib"):
            assert float(r[key]) > 0, (key, r)
    note = (out / "hexiscale_table2.md").read_text()
    assert note.startswith("# HexiScale Table 2:")
    assert "no GPU: CPU ranks (gloo)" in note and "they are not the paper's" in note
    assert "--hetero-plan" in note and "--device-speed" in note


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_scripts_are_shellcheck_clean() -> None:
    done = subprocess.run(
        ["shellcheck", "-x", *map(str, SCRIPTS), str(RUNS / "_lib.sh")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout


def test_scripts_are_strict_bash() -> None:
    assert len(SCRIPTS) == 4
    for script in SCRIPTS:
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
        assert os.access(script, os.X_OK), script


def test_iteration_lines_parse_with_padded_numbers_and_predictions() -> None:
    from benchmarks.torchrun_runs import iteration_rows

    homogeneous = (
        "[##..] iteration  2/10 | lm loss 5.1539 | tokens/s 2,333 | padding eff 0.953 | "
        "micro-batches 4 | recompute none | iteration 6,691 ms (predicted 8 ms on A100-80GB) | "
        "planning 0.8 ms (waited 0.7 ms)"
    )
    baseline = (
        "[##..] iteration 10/10 | lm loss 5.1 | tokens/s 934 | padding eff 1.000 | "
        "micro-batches 4 | recompute none | iteration 1,200 ms | learning rate 1.0E-04"
    )
    hetero = (
        "iteration  5/10 | strategy 2xTP1PP1@A100-80GB | lm loss 6.1023 | tokens/s 9,286 | "
        "micro-batches 4 | recompute none | iteration 217 ms (pull 77, propagation 132, push 29, "
        "optimizer 19 ms, slowest rank) | predicted 0.8 ms | planning 86.7 ms"
    )
    rows = iteration_rows("\n".join([homogeneous, baseline, hetero]))
    assert [(r["it"], r["tps"], r["ms"], r["predicted"]) for r in rows] == [
        ("2", "2,333", "6,691", "8"),
        ("10", "934", "1,200", None),
        ("5", "9,286", "217", "0.8"),
    ]


def test_emulated_cluster_file_is_what_device_speed_emulates(tmp_path: Path) -> None:
    """The HexiScale script plans on the cluster that `--device-speed` emulates: rank r's FLOPS
    and memory bandwidth divided by its factor, as the runtime's `emulated_cluster` has them."""
    from dynapipe_planner.cluster import get_gpu
    from dynapipe_planner.devices import emulated_cluster, load_cluster

    yaml_path = tmp_path / "cluster.yaml"
    subprocess.run(
        [sys.executable, str(RUNS / "_prepare.py"), "emulated-cluster", "H100", "1,1,2,4",
         str(yaml_path)],
        check=True,
    )  # fmt: skip
    planned, emulated = load_cluster(yaml_path), emulated_cluster(get_gpu("H100"), [1, 1, 2, 4])
    assert planned.num_devices == emulated.num_devices == 4
    for rank in range(4):
        mine, theirs = planned.machine_of(rank).gpu, emulated.machine_of(rank).gpu
        assert mine.peak_flops == pytest.approx(theirs.peak_flops)
        assert mine.hbm_bandwidth == pytest.approx(theirs.hbm_bandwidth)
