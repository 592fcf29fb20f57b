"""Cluster descriptions (HexiScale device graph): the shipped examples load with the right device
counts and links, overrides apply, and every kind of bad file is rejected with a message that
names the offending item."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

from dynapipe_planner.cluster import GiB
from dynapipe_planner.devices import cluster_from_dict, homogeneous_cluster, load_cluster
from dynapipe_planner.errors import PlanningError

EXAMPLES = ROOT / "examples" / "clusters"


def base(**extra) -> dict:
    return {
        "name": "t",
        "network": {"bandwidth_gbs": 0.7, "latency_us": 50},
        "machines": [
            {"name": "a", "gpu": "RTX4090", "count": 2, "intra_bandwidth_gbs": 32},
            {"name": "b", "gpu": "A800", "count": 2},
        ],
        **extra,
    }


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        ("hexiscale_setting1.yaml", 40),
        ("hexiscale_setting2.yaml", 32),
        ("hexiscale_setting3.yaml", 56),
        ("hexiscale_appb_240.yaml", 240),
        ("mixed_8gpu.yaml", 8),
    ],
)
def test_examples_load(name: str, devices: int) -> None:
    c = load_cluster(EXAMPLES / name)
    assert c.num_devices == devices
    assert np.allclose(c.bandwidth, c.bandwidth.T)
    assert np.isinf(np.diag(c.bandwidth)).all()


def test_links_and_overrides() -> None:
    c = cluster_from_dict(
        base(links=[{"machines": ["a", "b"], "bandwidth_gbs": 5, "latency_us": 20}])
    )
    c.machines[0].gpu  # noqa: B018
    assert c.bandwidth[0, 1] == pytest.approx(32e9)  # inside machine a
    assert c.bandwidth[2, 3] == pytest.approx(200e9)  # A800 NVLink from the catalogue
    assert c.bandwidth[0, 2] == pytest.approx(5e9) == c.bandwidth[3, 1]
    assert c.latency[1, 3] == pytest.approx(20e-6)
    o = cluster_from_dict(
        {
            "network": {"bandwidth_gbs": 1},
            "machines": [{"gpu": "A800", "count": 1, "peak_tflops": 100, "memory_gib": 40}],
        }
    )
    assert o.peak_flops[0] == pytest.approx(100e12)
    assert o.machines[0].gpu.memory_bytes == 40 * GiB
    assert o.memory_limit(0) == 36 * GiB  # the 10% reserve


def test_homogeneous_cluster() -> None:
    c = homogeneous_cluster("A800-PCIe", 20, inter_bandwidth_gbs=0.7)
    assert [m.count for m in c.machines] == [8, 8, 4]
    assert c.total_peak_flops == pytest.approx(20 * 312e12)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d["machines"][0].update(gpu="GTX480"), "machine 'a': unknown GPU type 'GTX480'"),
        (
            lambda d: d["machines"][1].update(memory_gib=0),
            "machine 'b': memory_gib must be positive",
        ),
        (lambda d: d["machines"][1].update(count=0), "machine 'b': count must be a positive"),
        (lambda d: d["machines"][0].update(peak_tflops=-1), "machine 'a': peak_tflops"),
        (lambda d: d["machines"][0].update(speed=3), "machine 'a': unknown key(s) ['speed']"),
        (lambda d: d["machines"][1].update(name="a"), "duplicate machine name(s) ['a']"),
        (
            lambda d: d.update(bandwidth_matrix_gbs=[[0, 1.0], [2.0, 0]]),
            "bandwidth_matrix_gbs is asymmetric: [0][1] ('a' -> 'b') = 1 but [1][0] = 2",
        ),
        (lambda d: d.update(bandwidth_matrix_gbs=[[0, 1.0]]), "bandwidth_matrix_gbs must be a 2x2"),
        (
            lambda d: d.update(bandwidth_matrix_gbs=[[0, 0], [0, 0]]),
            "bandwidth_matrix_gbs[0][1] ('a' -> 'b') must be positive",
        ),
        (lambda d: d.update(links=[{"machines": ["a", "z"]}]), "link #0: unknown machine 'z'"),
        (
            lambda d: d.update(network={"bandwidth_gbs": 0}),
            "network.bandwidth_gbs must be positive",
        ),
        (lambda d: d.pop("network"), "network.bandwidth_gbs (default between machines)"),
        (  # issue 34: a latency below zero was taken
            lambda d: d.update(network={"bandwidth_gbs": 1, "latency_us": -5}),
            "network.latency_us must be non-negative, got -5",
        ),
        (
            lambda d: d["machines"][0].update(intra_latency_us=-1),
            "machine 'a': intra_latency_us must be non-negative",
        ),
        (lambda d: d.update(machines=[]), "'machines' must be a non-empty list"),
        (
            lambda d: d["machines"][0].update(memory_gib=2),
            "machine 'a': no usable memory",
        ),
    ],
)
def test_bad_cluster_is_named(mutate, needle: str) -> None:
    d = base()
    mutate(d)
    with pytest.raises(PlanningError) as e:
        cluster_from_dict(d)
    assert needle in str(e.value)


def test_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("machines: [\n")
    with pytest.raises(PlanningError, match=r"bad\.yaml: not valid YAML"):
        load_cluster(bad)
    with pytest.raises(PlanningError, match="cannot read"):
        load_cluster(tmp_path / "missing.yaml")
