"""The Galvatron profile writer (benchmarks/galvatron_reference/profiles.py): the files carry
the keys hetu-galvatron 2.4.0's search reads, in its units, and give back our numbers.

Pure Python: no throwaway environment, no network.
"""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.galvatron_reference import profiles
from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search import analytic_cost_inputs

MIB = 2**20
MODEL = MODEL_PRESETS["gpt-1.3b"]
SEQ = 1024


@pytest.fixture(scope="module")
def inputs16():
    full = analytic_cost_inputs(MODEL, get_gpu("A100-80GB"), 16, seq_length=SEQ)
    return profiles.galvatron_representable(full, 16)


@pytest.fixture(scope="module")
def docs16(inputs16):
    return profiles.profile_documents(
        inputs16, model_name="m", num_gpus=16, gpus_per_node=8, hidden_size=MODEL.hidden_size
    )


def test_file_names_follow_galvatron(docs16) -> None:
    assert sorted(docs16) == sorted(
        [
            "computation_profiling_bf16_m.json",
            "memory_profiling_bf16_m.json",
            "allreduce_bandwidth_2nodes_8gpus_per_node.json",
            "p2p_bandwidth_2nodes_8gpus_per_node.json",
            "overlap_coefficient.json",
            "sp_time_2nodes_8gpus_per_node.json",
        ]
    )


def test_computation_profile_is_forward_ms_per_sample(docs16, inputs16) -> None:
    comp = docs16["computation_profiling_bf16_m.json"]
    # Static mode collects every key starting with `layertype_0_`: there must be exactly one.
    layer_keys = [k for k in comp if k.startswith("layertype_0_")]
    assert layer_keys == [f"layertype_0_bsz1_seq{SEQ}"]
    fwd = inputs16.layer_types[0].forward_s_per_sample
    assert comp[layer_keys[0]] == pytest.approx(fwd[1] * 1e3)
    assert [k for k in comp if k.startswith("layertype_other_")] == [
        f"layertype_other_bsz1_seq{SEQ}"
    ]


def test_representable_inputs_scale_forward_as_galvatron(inputs16) -> None:
    fwd = inputs16.layer_types[0].forward_s_per_sample
    for tp, t in fwd.items():
        assert t == pytest.approx(fwd[1] / tp)
    assert set(inputs16.layer_types[0].workspace_bytes_per_sample.values()) == {0.0}
    assert inputs16.link_latency_s == 0.0
    assert inputs16.embedding_param_bytes == inputs16.output_param_bytes == 0.0


def test_memory_profile_round_trips(docs16, inputs16) -> None:
    mem = docs16["memory_profiling_bf16_m.json"]
    lt = inputs16.layer_types[0]
    layer = mem["layertype_0"][str(SEQ)]
    # Galvatron's model states are 4 x parameter_size, equal to ours.
    assert 4 * layer["parameter_size"] * MIB == pytest.approx(
        lt.param_bytes * inputs16.model_state_factor
    )
    act = layer["tp_activation_per_bsz_dict"]
    assert act["checkpoint"] * MIB == pytest.approx(lt.boundary_bytes_per_sample)
    for tp, v in lt.activation_bytes_per_sample.items():
        assert act[str(tp)] * MIB == pytest.approx(v)
    for key in ("other_memory_pp_off", "other_memory_pp_on_first", "other_memory_pp_on_last"):
        entry = mem[key][str(SEQ)]
        assert set(entry) == {"model_states", "activation"}
        assert "1" in entry["model_states"] and "1" in entry["activation"]


def test_end_layers_have_an_entry_per_vocabulary_tp_degree() -> None:
    """Galvatron's default search (vocabulary TP on) reads the embedding and output layers'
    memory at every degree v = 1, 2, 4, ... it tries; each entry is the whole split v ways."""
    full = analytic_cost_inputs(MODEL, get_gpu("A100-80GB"), 16, seq_length=SEQ)
    assert full.embedding_param_bytes > 0 and full.output_activation_bytes_per_sample > 0
    mem = profiles.profile_documents(
        full, model_name="m", num_gpus=16, gpus_per_node=8, hidden_size=MODEL.hidden_size
    )["memory_profiling_bf16_m.json"]
    states = full.model_state_factor
    whole = {
        "other_memory_pp_off": (
            (full.embedding_param_bytes + full.output_param_bytes) * states,
            full.output_activation_bytes_per_sample,
        ),
        "other_memory_pp_on_first": (full.embedding_param_bytes * states, 0.0),
        "other_memory_pp_on_last": (
            full.output_param_bytes * states,
            full.output_activation_bytes_per_sample,
        ),
    }
    for key, totals in whole.items():
        entry = mem[key][str(SEQ)]
        for part, total in zip(("model_states", "activation"), totals, strict=True):
            assert set(entry[part]) == {"1", "2", "4", "8", "16"}
            for v, mib in entry[part].items():
                assert mib * MIB * int(v) == pytest.approx(total)


def test_bandwidths_are_mib_per_ms_of_galvatron_groups(docs16, inputs16) -> None:
    ar = docs16["allreduce_bandwidth_2nodes_8gpus_per_node.json"]
    # What Galvatron's reader looks up for 16 GPUs: the full group consecutive, then both
    # layouts of every smaller power of two.
    expected = {"allreduce_size_16_consec_1"} | {
        f"allreduce_size_{k}_consec_{c}" for k in (2, 4, 8) for c in (0, 1)
    }
    assert set(ar) == expected
    for k in (2, 4, 8, 16):
        bw = inputs16.bandwidth(k, 1)
        assert ar[f"allreduce_size_{k}_consec_1"] == pytest.approx(bw / MIB / 1e3)
    for k in (2, 4, 8):
        # Strided groups as Galvatron's profiler forms them: stride N / k.
        bw = inputs16.bandwidth(k, 16 // k)
        assert ar[f"allreduce_size_{k}_consec_0"] == pytest.approx(bw / MIB / 1e3)
    # 2 GPUs 8 apart sit on two nodes, 2 consecutive GPUs on one.
    assert ar["allreduce_size_2_consec_0"] < ar["allreduce_size_2_consec_1"]
    p2p = docs16["p2p_bandwidth_2nodes_8gpus_per_node.json"]
    assert set(p2p) == {"pp_size_2", "pp_size_4", "pp_size_8", "pp_size_16"}
    assert p2p["pp_size_2"] == pytest.approx(inputs16.p2p_bandwidth[2] / MIB / 1e3)
    assert docs16["overlap_coefficient.json"] == {"overlap_coe": inputs16.overlap_slowdown}


def test_sp_time_has_enough_points_per_group(docs16) -> None:
    sp = docs16["sp_time_2nodes_8gpus_per_node.json"]
    for op in ("allreduce", "all2all"):
        for k in (2, 4, 8, 16):
            keys = [s for s in sp if s.startswith(f"{op}_size_{k}_")]
            assert len(keys) >= 8  # Galvatron fits a line and asserts at least 8 sizes
            assert all(s.endswith("MB_time") for s in keys)


def test_representable_strided_bandwidth_is_galvatrons(inputs16) -> None:
    for (size, stride), bw in inputs16.allreduce_bandwidth.items():
        if stride > 1 and (size, 16 // size) in inputs16.allreduce_bandwidth:
            assert bw == inputs16.allreduce_bandwidth[(size, 16 // size)]


def test_write_profiles_round_trips_json(tmp_path, docs16) -> None:
    paths = profiles.write_profiles(str(tmp_path), docs16)
    assert len(paths) == len(docs16)
    for path in paths:
        with open(path) as f:
            assert json.load(f) == docs16[os.path.basename(path)]


def test_two_layer_types_are_refused() -> None:
    t5 = MODEL_PRESETS["t5-5.5b"]
    full = analytic_cost_inputs(t5, get_gpu("A100-80GB"), 8, seq_length=512)
    with pytest.raises(ValueError, match="one layer type"):
        profiles.galvatron_representable(full, 8)
