"""Galvatron-BMW cost estimator (seed galvatron_bmw.txt §V, App. C) and CostInputs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search import CostInputs, analytic_cost_inputs, strategy_space
from dynapipe_planner.search.estimator import (
    Estimator,
    overlapped,
    peak_memory,
    stage_fwd_bytes,
)

GPU = get_gpu("A100-40GB")


@pytest.fixture(scope="module")
def inputs():
    return analytic_cost_inputs(MODEL_PRESETS["gpt-350m"], GPU, 16, seq_length=512)


def _by_name(strategies):
    return {str(s): j for j, s in enumerate(strategies)}


def test_cost_inputs_cover_the_model_and_topology(inputs):
    assert inputs.num_layers == 24 and inputs.overlap_slowdown == 1.3
    (decoder,) = inputs.layer_types
    assert set(decoder.forward_s_per_sample) == {1, 2, 4, 8, 16}
    # TP splits compute: more TP, less time per sample on each GPU.
    f = decoder.forward_s_per_sample
    assert f[1] > f[2] > f[4]
    # Two nodes of 8: consecutive groups of 8 stay on NVLink, 16 GPUs or strided 2s cross.
    assert inputs.bandwidth(8, 1) == GPU.intra_node_bandwidth
    assert inputs.bandwidth(16, 1) == GPU.inter_node_bandwidth
    assert inputs.bandwidth(2, 8) == GPU.inter_node_bandwidth
    assert inputs.p2p_bandwidth[2] == GPU.inter_node_bandwidth
    assert inputs.p2p_bandwidth[4] == GPU.inter_node_bandwidth  # GPU 7 -> 8 crosses
    with pytest.raises(PlanningError, match="stride"):
        inputs.bandwidth(3, 1)


def test_overlap_slowdown_formula():
    assert overlapped(np.array(4.0), np.array(0.0), 1.3) == 4.0
    assert overlapped(np.array(4.0), np.array(1.0), 1.3) == pytest.approx(1.3 + 3.0)
    assert overlapped(np.array(1.0), np.array(4.0), 1.3) == pytest.approx(1.3 + 3.0)


def test_layer_costs_follow_section_v(inputs):
    strategies = strategy_space(16)[1]
    idx = _by_name(strategies)
    est = Estimator(inputs, strategies)
    m = 4
    t = est.stage_tables(range(24), 0, 32, m)
    dp, dp_ck = idx["DP16"], idx["DP16+CKPT"]
    sdp, tp = idx["SDP16"], idx["TP8+DP2"]
    # CKPT: one more forward in backward, only the layer input kept.
    assert t.nosync[0, dp_ck] > t.nosync[0, dp]
    assert t.fwd_bytes[0, dp_ck] < t.fwd_bytes[0, dp]
    # DP's gradient all-reduce happens on the last micro-batch only (App. C).
    assert t.sync[0, dp] > t.nosync[0, dp]
    np.testing.assert_allclose(t.objective[0], (m - 1) * t.nosync[0] + t.sync[0])
    # SDP shards model states 16 ways, DP keeps them whole.
    assert t.state_bytes[0, sdp] == pytest.approx(t.state_bytes[0, dp] / 16)
    # A larger overlap slowdown can only make overlapped layers slower.
    slow = Estimator(dataclasses.replace(inputs, overlap_slowdown=2.0), strategies)
    t2 = slow.stage_tables(range(24), 0, 32, m)
    assert t2.sync[0, dp] > t.sync[0, dp] and t2.nosync[0, sdp] > t.nosync[0, sdp]
    assert t2.nosync[0, tp] == t.nosync[0, tp]  # TP all-reduces are not overlapped
    # Micro-batches that do not split over a strategy's data degree rule it out.
    odd = est.stage_tables(range(2), 0, 8, 1)
    assert np.isinf(odd.objective[0, dp]) and np.isfinite(odd.objective[0, tp])


def test_1f1b_stage_keeps_p_minus_i_microbatches(inputs):
    strategies = strategy_space(16)[4]
    est = Estimator(inputs, strategies)
    j = 0
    per_stage = [est.stage_tables(range(6), i, 16, 8).fwd_bytes[0, j] for i in range(4)]
    one = per_stage[3]
    assert per_stage == pytest.approx([4 * one, 3 * one, 2 * one, one])
    few = [est.stage_tables(range(6), i, 16, 2).fwd_bytes[0, j] for i in range(4)]
    assert few == pytest.approx([2 * one, 2 * one, 2 * one, one])


def test_stage_input_is_held_per_microbatch_in_flight_and_the_gradient_received(inputs):
    """A layer's activations hold its output, not its input: the stage's input (received, or
    the embedding's output) is kept for every micro-batch in flight, and all but the last
    stage hold the output gradient a backward receives; on the first layer's row only."""
    strategies = strategy_space(16)[4]
    est = Estimator(inputs, strategies)
    idx = _by_name(strategies)
    j = idx["PP4+DP4"]  # 4 samples of a micro-batch of 16 on each GPU
    (decoder,) = inputs.layer_types
    one = 4 * decoder.boundary_bytes_per_sample
    for stage, held in enumerate([4 + 1, 3 + 1, 2 + 1, 1]):
        t = est.stage_tables(range(6), stage, 16, 8)
        assert t.input_bytes[:, j] == pytest.approx([held * one] * 6)
        fwd = stage_fwd_bytes(t)
        np.testing.assert_array_equal(fwd[1:], t.fwd_bytes[1:])
        assert fwd[0, j] == pytest.approx(t.fwd_bytes[0, j] + held * one)
        chosen = [j] * 6
        without = dataclasses.replace(t, input_bytes=0 * t.input_bytes)
        assert peak_memory(t, chosen) == pytest.approx(peak_memory(without, chosen) + held * one)


def test_cost_inputs_can_be_built_directly():
    from dynapipe_planner.search import LayerTypeCosts

    layer = LayerTypeCosts(
        name="block",
        forward_s_per_sample={1: 1e-3, 2: 0.6e-3},
        activation_bytes_per_sample={1: 1e8, 2: 0.6e8},
        workspace_bytes_per_sample={1: 1e7, 2: 1e7},
        param_bytes=1e8,
        boundary_bytes_per_sample=1e6,
        tp_allreduce_bytes_per_sample=4e6,
    )
    ci = CostInputs(
        layer_types=(layer,),
        layer_kinds=(0,) * 4,
        allreduce_bandwidth={(2, 1): 1e11},
        p2p_bandwidth={1: 1e11, 2: 1e11},
        sdp_forward_s={2: 1e-3},
        sdp_backward_s={2: 2e-3},
    )
    est = Estimator(ci, strategy_space(2)[1])
    assert np.isfinite(est.stage_tables(range(4), 0, 4, 1).objective).all()
    assert CostInputs.from_dict(json.loads(json.dumps(ci.to_dict()))) == ci
    with pytest.raises(PlanningError, match="malformed"):
        CostInputs.from_dict({"layer_types": []})
    with pytest.raises(PlanningError, match="layer 1"):
        CostInputs((layer,), (0, 3), {}, {})
    with pytest.raises(PlanningError, match="overlap"):
        CostInputs((layer,), (0,), {}, {}, overlap_slowdown=0.5)
