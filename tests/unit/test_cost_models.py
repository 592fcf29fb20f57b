"""Cost models: the analytic model's physics, the profiled table loader, and the interpolation
contract in cost/table.py that the DP and the C++ core share."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_planner import make_planner

from dynapipe_planner.cluster import GPU_PRESETS, ClusterSpec
from dynapipe_planner.cost.analytic import AnalyticCostModel, geometric_grid
from dynapipe_planner.cost.profiled import ProfiledCostModel
from dynapipe_planner.cost.table import (
    PipelineCosts,
    interp3,
    lerp,
    locate,
    split_layers,
)
from dynapipe_planner.errors import CostModelError, PlanningError
from dynapipe_planner.microbatch.baselines import Group, packed_group
from dynapipe_planner.microbatch.dp import dynamic_microbatches
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec

GiB = 2**30
A100 = GPU_PRESETS["A100-80GB"]


# ---- analytic model ------------------------------------------------------------------------


def analytic(name, recompute="none", *, stages=4, tp=1, replicas=1, **kw):
    model = MODEL_PRESETS[name]
    cluster = ClusterSpec(A100, num_stages=stages, num_replicas=replicas, tp=tp)
    grid = {"max_samples": 64, "max_seqlen": 4096}
    if model.is_encoder_decoder:
        grid["max_tgt_seqlen"] = 512
    return AnalyticCostModel(model, cluster, **kw).pipeline_costs(recompute, **grid)


@pytest.fixture(scope="module")
def gpt():
    return {rc: analytic("gpt-1.3b", rc) for rc in ("none", "selective", "full")}


@pytest.fixture(scope="module")
def t5():
    return {rc: analytic("t5-5.5b", rc) for rc in ("none", "selective", "full")}


def strictly_increasing(a, axis):
    return bool(np.all(np.diff(a, axis=axis) > 0))


def non_decreasing(a, axis):
    return bool(np.all(np.diff(a, axis=axis) >= 0))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_gpt_times_and_memory_increase_with_samples_and_length(gpt, recompute):
    pc = gpt[recompute]
    for name in ("forward", "backward", "activation"):
        table = getattr(pc, name)
        assert np.all(np.isfinite(table)) and np.all(table > 0)
        assert strictly_increasing(table, 1), name  # micro-batch size
        assert strictly_increasing(table, 2), name  # sequence length
    assert non_decreasing(pc.transient, 1) and non_decreasing(pc.transient, 2)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_t5_times_and_memory_increase_with_samples_and_both_lengths(t5, recompute):
    pc = t5[recompute]
    assert pc.encoder_decoder and pc.t_grid[0] == 0 and pc.t_grid[-1] >= 512
    for name in ("forward", "backward", "activation", "transient"):
        table = getattr(pc, name)
        assert np.all(np.isfinite(table)), f"{name} has NaN/inf"  # t = 0 column included
        for axis in (1, 2, 3):
            assert non_decreasing(table, axis), (name, axis)
    for name in ("forward", "backward", "activation"):
        table = getattr(pc, name)[:, :, :, 1:]  # at a target length of zero nothing is stored
        assert strictly_increasing(table, 1), name
        if name == "activation" and recompute == "full":
            # Full recompute keeps only each layer's input: on the decoder stages (2 and 3)
            # that is b x t x h, independent of the source length (the received encoder output
            # is not counted per micro-batch).
            assert strictly_increasing(table[:2], 2) and non_decreasing(table[2:], 2)
        else:
            assert strictly_increasing(table, 2), name
        # The last stage holds decoder layers: it grows with the target length too.
        assert strictly_increasing(table[-1], 2), name


def test_t5_cost_between_zero_and_first_target_point_is_interpolated_not_nan(t5):
    pc = t5["none"]
    lo, mid, hi = (pc.stage_costs(2, 300, t) for t in (0, 4, 8))
    for a, b, c in (
        (lo.forward, mid.forward, hi.forward),
        (lo.backward, mid.backward, hi.backward),
    ):
        assert np.all(np.isfinite(b))
        assert np.all(a <= b) and np.all(b <= c)
    assert hi.forward[-1] > lo.forward[-1]  # the decoder stage does more work with targets


def test_t5_dp_plans_with_analytic_costs(t5):
    """Regression: NaN at t=0 once spread through the DP's monotone tables and the DP returned
    no micro-batches at all, with an infinite objective and no error."""
    pc = t5["selective"]
    rng = np.random.default_rng(0)
    lengths = np.stack([rng.integers(16, 2048, 64), rng.integers(1, 512, 64)], axis=1)
    res = dynamic_microbatches(lengths, pc, inflight=np.arange(4, 0, -1), num_replicas=2)
    assert math.isfinite(res.objective) and res.microbatches
    assert sorted(np.concatenate(res.microbatches).tolist()) == list(range(64))


@pytest.mark.parametrize("name", ["gpt-1.3b", "t5-5.5b"])
def test_time_per_sample_falls_as_micro_batches_grow(gpt, t5, name):
    pc = gpt["none"] if name == "gpt-1.3b" else t5["none"]
    t = 128 if pc.encoder_decoder else 0
    for s in (128, 512, 2048):
        per_sample = []
        for b in pc.b_grid:
            sc = pc.stage_costs(int(b), s, t)
            per_sample.append(float(np.sum(sc.forward + sc.backward)) / b)
        assert np.all(np.diff(per_sample) < 0), s
    # Small micro-batches are far from saturating the GPU: 1 sample costs well over 1/16 of 16.
    one, sixteen = pc.stage_costs(1, 256, t), pc.stage_costs(16, 256, t)
    total = lambda sc: float(np.sum(sc.forward + sc.backward))  # noqa: E731
    assert total(one) > 1.5 * total(sixteen) / 16


def test_attention_makes_time_superlinear_in_sequence_length(gpt):
    pc = gpt["none"]
    long_one = pc.stage_costs(1, 4096)
    short_many = pc.stage_costs(16, 256)
    assert np.all(long_one.forward > short_many.forward)
    assert np.all(long_one.forward + long_one.backward > short_many.forward + short_many.backward)
    # The same holds without the small-batch penalty: 4 x 1024 vs 16 x 256 at equal tokens.
    assert np.sum(pc.stage_costs(4, 1024).forward) > np.sum(pc.stage_costs(16, 256).forward)


@pytest.mark.parametrize("name", ["gpt-1.3b", "t5-5.5b"])
def test_recompute_trades_stored_activation_for_backward_time(gpt, t5, name):
    tables = gpt if name == "gpt-1.3b" else t5
    t = 256 if name == "t5-5.5b" else 0
    none, sel, full = (tables[rc].stage_costs(4, 1024, t) for rc in ("none", "selective", "full"))
    assert np.all(none.activation > sel.activation)
    assert np.all(sel.activation > full.activation)
    assert np.all(none.backward < sel.backward)
    assert np.all(sel.backward < full.backward)
    np.testing.assert_array_equal(none.forward, full.forward)  # recompute repeats the forward
    # Weights and optimizer state do not depend on recomputation.
    np.testing.assert_array_equal(tables["none"].static, tables["full"].static)


def test_flash_attention_stores_less_and_runs_faster():
    plain = analytic("gpt-1.3b").stage_costs(4, 2048)
    flash = analytic("gpt-1.3b", flash_attention=True).stage_costs(4, 2048)
    assert np.all(flash.activation < plain.activation)
    assert np.all(flash.forward < plain.forward)


@pytest.mark.parametrize("name", ["gpt-1.3b", "t5-5.5b"])
def test_tensor_parallelism_lowers_per_gpu_static_memory(name):
    one, two = analytic(name, tp=1), analytic(name, tp=2)
    assert np.all(two.static < one.static)
    np.testing.assert_allclose(two.static, one.static / 2)  # parameters are sharded evenly
    s1 = one.stage_costs(8, 1024, 256 if one.encoder_decoder else 0)
    s2 = two.stage_costs(8, 1024, 256 if one.encoder_decoder else 0)
    assert np.all(s2.activation < s1.activation) and np.all(s2.forward < s1.forward)


def test_distributed_optimizer_shards_optimizer_state_over_replicas():
    plain = analytic("gpt-1.3b", replicas=4)
    sharded = analytic("gpt-1.3b", replicas=4, distributed_optimizer=True)
    # bf16 weights (2) + fp32 grads (4) + Adam (12 bytes/param): 18 -> 6 + 12/4 = 9 bytes.
    np.testing.assert_allclose(sharded.static, plain.static * 9 / 18)


def test_sequence_parallel_splits_the_activations_outside_tensor_parallel_regions():
    h, stages, tp = MODEL_PRESETS["gpt-1.3b"].hidden_size, 4, 4
    plain = analytic("gpt-1.3b", stages=stages, tp=tp)
    split = analytic("gpt-1.3b", stages=stages, tp=tp, sequence_parallel=True)
    b, s = np.array([2.0]), np.array([1024.0])
    stored = [pc.stage_costs_many(b, s, np.zeros(1))[2][0, 1] for pc in (plain, split)]
    # A middle stage holds 6 layers; each keeps 10 h bytes per token outside TP regions.
    assert stored[0] - stored[1] == pytest.approx(6 * 10 * h * (1 - 1 / tp) * 2 * 1024)
    same = analytic("gpt-1.3b", stages=stages, tp=1, sequence_parallel=True)
    np.testing.assert_allclose(same.activation, analytic("gpt-1.3b", stages=stages).activation)


def test_stage_static_memory_counts_embedding_and_output_layer():
    m = MODEL_PRESETS["gpt-1.3b"]
    pc = analytic("gpt-1.3b")  # 24 layers on 4 stages: 6 each
    per_layer = m.layer_params("decoder") * 18
    np.testing.assert_allclose(pc.static[1], 6 * per_layer)
    np.testing.assert_allclose(pc.static[0], 6 * per_layer + m.embedding_params() * 18)
    np.testing.assert_allclose(pc.static[3], 6 * per_layer + m.vocab_size * m.hidden_size * 18)


def test_tp_that_does_not_divide_heads_is_rejected():
    with pytest.raises(PlanningError, match=r"TP=3 does not divide the 16 heads of gpt-1.3b"):
        analytic("gpt-1.3b", tp=3)
    with pytest.raises(PlanningError, match="recompute must be one of"):
        analytic("gpt-1.3b", "partial")


def test_grids_cover_the_requested_shapes():
    pc = AnalyticCostModel(
        MODEL_PRESETS["t5-5.5b"], ClusterSpec(A100, num_stages=2)
    ).pipeline_costs(max_samples=300, max_seqlen=5000, max_tgt_seqlen=700)
    assert pc.b_grid[0] == 1 and pc.b_grid[-1] >= 300
    assert pc.s_grid[-1] >= 5000 and pc.t_grid[0] == 0 and pc.t_grid[-1] >= 700
    assert pc.boundary_seq == ("src",)  # 24 encoder layers, then 24 decoder layers


def test_t5_boundaries_after_the_first_decoder_layer_carry_both_sequences():
    pc = analytic("t5-5.5b", stages=4)  # 12 encoder + 12 decoder layers, 6 per stage
    # Into the first decoder stage only the encoder output travels; after a decoder layer, the
    # encoder output and the decoder hidden states do.
    assert pc.boundary_seq == ("src", "src", "both")
    assert pc.boundary_shape(1, 2, 100, 30) == [2, 100, 1024]
    assert pc.boundary_shape(2, 2, 100, 30) == [2, 130, 1024]


@given(st.integers(1, 16), st.integers(1, 8), st.floats(1.01, 2.0), st.integers(1, 10**5))
@settings(max_examples=examples(50), deadline=None)
def test_geometric_grid(dense_steps, step, ratio, stop):
    first_dense = dense_steps * step
    g = geometric_grid(first_dense, step, ratio, stop)
    assert g[0] == step and g[-1] >= stop
    assert np.all(np.diff(g) >= step) and np.all(g % step == 0)
    dense = g[g <= first_dense]
    np.testing.assert_array_equal(dense, np.arange(step, first_dense + 1, step)[: len(dense)])


# ---- profiled model ------------------------------------------------------------------------

B_GRID, S_GRID = [1, 2, 4], [128, 256, 512]
TINY_GPT = ModelSpec("tiny", "gpt", 4, 64, 4, 256, 1000)
TINY_T5 = ModelSpec("tiny-t5", "t5", 2, 64, 4, 256, 1000)


def dyadic_table(rng, shape):
    """Monotone table of exactly representable values (sums are exact in any order)."""
    x = rng.integers(1, 50, shape).astype(float)
    for axis in range(len(shape)):
        x = np.cumsum(x, axis=axis)
    return x / 64


def entry(rng, component, tp=1, recompute="none", tgt=None):
    shape = (len(B_GRID), len(S_GRID)) + ((len(tgt),) if tgt else ())
    e = {
        "tp": tp,
        "recompute": recompute,
        "component": component,
        "microbatch_sizes": B_GRID,
        "seqlens": S_GRID,
        "forward_s": (dyadic_table(rng, shape) / 1024).tolist(),
        "backward_s": (dyadic_table(rng, shape) / 512).tolist(),
        "activation_bytes": (dyadic_table(rng, shape) * 2**20).tolist(),
        "transient_bytes": (dyadic_table(rng, shape) * 2**18).tolist(),
        "static_bytes": int(rng.integers(1, 1000)) * 2**20,
    }
    if tgt:
        e["tgt_seqlens"] = tgt
    return e


def write_table(tmp_path, entries, name="costs.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": "dynapipe-cost-table", "version": 1, "entries": entries}))
    return path


def gpt_entries(seed=0, **kw):
    rng = np.random.default_rng(seed)
    return [entry(rng, c, **kw) for c in ("decoder_layer", "embedding", "lm_head")]


def load(tmp_path, entries, model=TINY_GPT, stages=2, tp=1):
    cluster = ClusterSpec(A100, num_stages=stages, tp=tp)
    return ProfiledCostModel.load(write_table(tmp_path, entries), model, cluster)


def arr(e, field, nt=1):
    a = np.array(e[field], dtype=float)
    return a if a.ndim == 3 else np.repeat(a[:, :, None], nt, axis=2)


@pytest.mark.parametrize(("stages", "split"), [(1, [4]), (2, [2, 2]), (3, [1, 2, 1])])
def test_profiled_stage_costs_at_grid_points_are_sums_of_layer_entries(tmp_path, stages, split):
    entries = gpt_entries()
    dec, emb, head = entries
    pc = load(tmp_path, entries, stages=stages).pipeline_costs("none")
    assert split_layers(4, stages) == split
    np.testing.assert_array_equal(pc.b_grid, B_GRID)
    np.testing.assert_array_equal(pc.s_grid, S_GRID)
    for j, n in enumerate(split):
        extras = ([emb] if j == 0 else []) + ([head] if j == stages - 1 else [])
        for field, name in (("forward_s", "forward"), ("backward_s", "backward")):
            expected = n * arr(dec, field) + sum(arr(e, field) for e in extras)
            np.testing.assert_array_equal(getattr(pc, name)[j], expected)
        expected_act = n * arr(dec, "activation_bytes") + sum(
            arr(e, "activation_bytes") for e in extras
        )
        np.testing.assert_array_equal(pc.activation[j], expected_act)
        expected_tra = np.maximum.reduce([arr(e, "transient_bytes") for e in [dec, *extras]])
        np.testing.assert_array_equal(pc.transient[j], expected_tra)
        static = n * dec["static_bytes"] + sum(e["static_bytes"] for e in extras)
        assert pc.static[j] == static
        # stage_costs at a grid point reads the table entry exactly
        for ib, b in enumerate(B_GRID):
            for ks, s in enumerate(S_GRID):
                assert pc.stage_costs(b, s).forward[j] == pc.forward[j, ib, ks, 0]


def test_profiled_interpolates_halfway_between_grid_points(tmp_path):
    pc = load(tmp_path, gpt_entries()).pipeline_costs()
    f = pc.forward
    # halfway in b (2 -> 4 at s=256), halfway in s (128 -> 256 at b=1), halfway in both
    np.testing.assert_allclose(pc.stage_costs(3, 256).forward, (f[:, 1, 1, 0] + f[:, 2, 1, 0]) / 2)
    np.testing.assert_allclose(pc.stage_costs(1, 192).forward, (f[:, 0, 0, 0] + f[:, 0, 1, 0]) / 2)
    corners = f[:, 1, 1, 0] + f[:, 1, 2, 0] + f[:, 2, 1, 0] + f[:, 2, 2, 0]
    np.testing.assert_allclose(pc.stage_costs(3, 384).forward, corners / 4)
    # a quarter of the way: weights follow the distance
    np.testing.assert_allclose(
        pc.stage_costs(1, 160).activation,
        0.75 * pc.activation[:, 0, 0, 0] + 0.25 * pc.activation[:, 0, 1, 0],
    )
    # below the smallest sequence length: as costly as the smallest point, never less
    np.testing.assert_array_equal(pc.stage_costs(2, 5).forward, f[:, 1, 0, 0])


def test_profiled_shapes_beyond_the_grid_are_infeasible(tmp_path):
    pc = load(tmp_path, gpt_entries()).pipeline_costs()
    assert pc.stage_costs(4, 512).feasible
    for b, s in ((5, 128), (1, 513), (8, 1024)):
        sc = pc.stage_costs(b, s)
        assert not sc.feasible
        assert np.all(np.isinf(sc.forward)) and np.all(np.isinf(sc.activation))


def test_profiled_null_entries_are_infeasible_and_the_dp_avoids_them(tmp_path):
    entries = gpt_entries()
    # Strongly sublinear times: 4 samples of 512 are best run together.
    dec = entries[0]
    dec["forward_s"] = [[1.0, 1.0, 1.0], [1.01, 1.01, 1.01], [1.02, 1.02, 1.02]]
    pc = load(tmp_path, entries).pipeline_costs()
    lengths = np.full(4, 512)
    res = dynamic_microbatches(lengths, pc, inflight=np.ones(2), bucket_rel=0)
    assert [len(m) for m in res.microbatches] == [4]

    dec["forward_s"][2][2] = None  # b=4, s=512 could not run
    pc = load(tmp_path, entries).pipeline_costs()
    assert np.isinf(pc.forward[:, 2, 2, 0]).all()
    assert not pc.stage_costs(4, 512).feasible
    assert not pc.stage_costs(3, 512).feasible  # interpolating towards the null point
    assert not pc.stage_costs(4, 400).feasible
    assert pc.stage_costs(4, 256).feasible and pc.stage_costs(2, 512).feasible
    res = dynamic_microbatches(lengths, pc, inflight=np.ones(2), bucket_rel=0)
    assert [len(m) for m in res.microbatches] == [2, 2]


def test_profiled_missing_tp_degree_names_it_and_lists_what_exists(tmp_path):
    entries = gpt_entries() + gpt_entries(recompute="selective")
    model = load(tmp_path, entries, tp=2)
    assert model.recompute_modes() == []
    with pytest.raises(PlanningError) as err:
        model.pipeline_costs("none")
    msg = str(err.value)
    assert "no entry for tp=2, recompute=none, component=decoder_layer" in msg
    assert msg.endswith("it has tp=1/none, tp=1/selective")
    assert str(tmp_path / "costs.json") in msg
    assert load(tmp_path, entries, tp=1).recompute_modes() == ["none", "selective"]


def test_profiled_missing_component_is_named(tmp_path):
    entries = gpt_entries()[:2]  # no lm_head
    with pytest.raises(PlanningError, match="component=lm_head"):
        load(tmp_path, entries).pipeline_costs()


def test_profiled_malformed_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "dynapipe-cost-table", "entries": [')
    with pytest.raises(PlanningError, match=re.escape(f"cost table {path}: not valid JSON")):
        ProfiledCostModel.load(path, TINY_GPT, ClusterSpec(A100))
    missing = tmp_path / "nope.json"
    with pytest.raises(PlanningError, match=re.escape(f"cannot read cost table {missing}")):
        ProfiledCostModel.load(missing, TINY_GPT, ClusterSpec(A100))


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"format": "other", "version": 1, "entries": [{}]}, "expected format"),
        ({"format": "dynapipe-cost-table", "version": 2, "entries": [{}]}, "version 1"),
        ({"format": "dynapipe-cost-table", "version": 1, "entries": []}, "non-empty list"),
        ([1, 2], "expected format"),
    ],
)
def test_profiled_rejects_wrong_document_headers(tmp_path, document, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(document))
    with pytest.raises(PlanningError, match=message):
        ProfiledCostModel.load(path, TINY_GPT, ClusterSpec(A100))


def test_profiled_wrong_grid_shape_is_reported(tmp_path):
    entries = gpt_entries()
    entries[1]["forward_s"] = entries[1]["forward_s"][:2]  # embedding: 2 rows for 3 sizes
    with pytest.raises(
        PlanningError,
        match=re.escape(
            "entry tp=1/none/embedding: forward_s has shape (2, 3, 1), grid is (3, 3, 1)"
        ),
    ):
        load(tmp_path, entries).pipeline_costs()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e.pop("transient_bytes"), "missing 'transient_bytes'"),
        (lambda e: e.__setitem__("backward_s", [["a", 1, 2]] * 3), "backward_s is not a numeric"),
        (lambda e: e["activation_bytes"][0].__setitem__(0, -1.0), "activation_bytes has negative"),
        (lambda e: e.__setitem__("seqlens", [128, 256, 1024]), "grid differs from decoder_layer"),
    ],
)
def test_profiled_bad_entries_are_reported(tmp_path, mutate, message):
    entries = gpt_entries()
    mutate(entries[2])  # lm_head
    with pytest.raises(PlanningError, match=message):
        load(tmp_path, entries).pipeline_costs()


def test_profiled_t5_tables_broadcast_encoder_entries_over_target_lengths(tmp_path):
    rng = np.random.default_rng(5)
    tgt = [0, 64, 128]
    entries = [
        entry(rng, "encoder_layer"),
        entry(rng, "decoder_layer", tgt=tgt),
        entry(rng, "embedding"),
        entry(rng, "lm_head"),
    ]
    enc, dec, emb, head = entries
    pc = load(tmp_path, entries, model=TINY_T5, stages=3).pipeline_costs()
    np.testing.assert_array_equal(pc.t_grid, tgt)
    assert pc.boundary_seq == ("src", "both")  # stages: [enc], [enc, dec], [dec]
    f = lambda e: arr(e, "forward_s", 3)  # noqa: E731
    np.testing.assert_array_equal(pc.forward[0], f(enc) + f(emb))
    np.testing.assert_array_equal(pc.forward[1], f(enc) + f(dec))
    np.testing.assert_array_equal(pc.forward[2], f(dec) + f(head))
    assert np.all(pc.forward[0, :, :, 0] == pc.forward[0, :, :, 2])  # encoder ignores targets
    # Without tgt_seqlens an encoder-decoder table is incomplete.
    dec.pop("tgt_seqlens")
    dec["forward_s"] = np.array(dec["forward_s"])[:, :, 0].tolist()
    with pytest.raises(PlanningError, match="needs tgt_seqlens"):
        load(tmp_path, entries, model=TINY_T5, stages=3).pipeline_costs()


def test_profiled_attention_coefficient_is_the_quadratic_term(tmp_path):
    entries = gpt_entries()
    s = np.array(S_GRID, float)
    quad = 1e-9 * s**2 + 1e-6 * s + 1e-3
    for e in entries:
        for field in ("forward_s", "backward_s"):
            e[field] = np.tile(
                quad if e["component"] == "decoder_layer" else 0 * s, (3, 1)
            ).tolist()
    pc = load(tmp_path, entries, stages=2).pipeline_costs()
    # Two decoder layers per stage, forward + backward each.
    np.testing.assert_allclose(pc.attention_coef, [4e-9, 4e-9], rtol=1e-6)


# ---- table.py ------------------------------------------------------------------------------


def test_locate_edge_cases():
    g = [1.0, 2.0, 4.0]
    assert locate(g, -5) == (0, 0.0)
    assert locate(g, 1.0) == (0, 0.0)
    assert locate(g, 1.5) == (0, 0.5)
    assert locate(g, 2.0) == (1, 0.0)
    assert locate(g, 3.0) == (1, 0.5)
    assert locate(g, 4.0) == (2, 0.0)  # the last point itself is on the grid
    assert locate(g, 4.0000001) is None
    assert locate(np.array(g), 3.5) == (1, 0.75)
    assert locate([0.0], 0.0) == (0, 0.0) and locate([0.0], -1) == (0, 0.0)
    assert locate([0.0], 1e-9) is None


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True), st.floats(-10, 2e6))
@settings(max_examples=examples(100), deadline=None)
def test_locate_brackets_x(points, x):
    g = sorted(float(p) for p in points)
    cell = locate(g, x)
    if x > g[-1]:
        assert cell is None
        return
    k, w = cell
    assert 0 <= w < 1
    if x <= g[0]:
        assert (k, w) == (0, 0.0)
    elif w == 0:
        assert g[k] == x or (k < len(g) - 1 and g[k] <= x < g[k + 1])
    else:
        assert g[k] < x < g[k + 1]
        assert g[k] + w * (g[k + 1] - g[k]) == pytest.approx(x, rel=1e-12, abs=1e-9)


def test_lerp_edge_cases():
    assert lerp(1.0, 3.0, 0.25) == 1.5
    assert lerp(2.0, math.inf, 0.0) == 2.0  # w == 0 never touches b
    assert lerp(2.0, math.nan, 0.0) == 2.0
    assert lerp(2.0, math.inf, 0.5) == math.inf
    assert lerp(math.inf, 2.0, 0.5) == math.inf
    assert lerp(math.inf, math.inf, 0.5) == math.inf  # not inf - inf = nan
    assert lerp(5.0, 5.0, 0.3) == 5.0


def test_interp3_reproduces_linear_functions_and_grid_points():
    bg, sg, tg = [1.0, 2.0, 4.0], [8.0, 16.0], [0.0, 10.0, 30.0]
    B, S, T = np.meshgrid(bg, sg, tg, indexing="ij")
    table = 1 + 2 * B + 3 * S + 5 * T
    for b, s, t in ((1, 8, 0), (3, 12, 5), (4, 16, 30), (1.5, 9, 29), (2, 16, 20)):
        cells = [locate(g, x) for g, x in zip((bg, sg, tg), (b, s, t), strict=True)]
        assert interp3(table, *cells) == pytest.approx(1 + 2 * b + 3 * s + 5 * t, rel=1e-14)
    assert interp3(table, (2, 0.0), (1, 0.0), (2, 0.0)) == table[2, 1, 2]
    # Bilinear, not linear: the product term is averaged over the cell.
    prod = B * S
    cells = (locate(bg, 3), locate(sg, 12), locate(tg, 0))
    assert interp3(prod, *cells) == pytest.approx((2 * 8 + 2 * 16 + 4 * 8 + 4 * 16) / 4)


def test_interp3_infinite_neighbours():
    table = np.array([[[1.0]], [[math.inf]]])  # b grid [1, 2]
    assert interp3(table, (0, 0.0), (0, 0.0), (0, 0.0)) == 1.0
    assert interp3(table, (0, 0.5), (0, 0.0), (0, 0.0)) == math.inf


@given(st.integers(1, 200), st.integers(1, 64))
@settings(max_examples=examples(100), deadline=None)
def test_split_layers(num_layers, num_stages):
    if num_stages > num_layers:
        with pytest.raises(PlanningError, match=f"{num_stages} pipeline stages but only"):
            split_layers(num_layers, num_stages)
        return
    counts = split_layers(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    assert len(counts) == num_stages and sum(counts) == num_layers
    assert set(counts) <= {base, base + 1}
    middle = list(range(1, num_stages - 1))
    got_extra = [j for j, c in enumerate(counts) if c == base + 1]
    if extra <= len(middle):
        assert got_extra == middle[:extra]  # the first and last stages carry embedding/head
    else:
        assert set(middle) <= set(got_extra)


def test_split_layers_examples():
    assert split_layers(10, 4) == [2, 3, 3, 2]
    assert split_layers(11, 4) == [3, 3, 3, 2]
    assert split_layers(5, 2) == [3, 2]
    assert split_layers(7, 1) == [7]


def small_costs(**overrides):
    shape = (2, 2, 2, 1)
    base = {
        "b_grid": [1, 2],
        "s_grid": [8, 16],
        "t_grid": [0],
        "forward": np.ones(shape),
        "backward": np.ones(shape),
        "activation": np.ones(shape),
        "transient": np.zeros(shape),
        "static": np.array([1.0, 2.0]) * GiB,
        "attention_coef": np.zeros(2),
        "hidden_size": 32,
        "memory_limit": 4.0 * GiB,
        "p2p_bandwidth": np.array([1e9]),
        "p2p_latency": 1e-5,
    }
    return PipelineCosts(**{**base, **overrides})


def test_boundary_shape_and_p2p_time():
    pc = small_costs()
    assert pc.boundary_seq == ("src",)
    assert pc.boundary_shape(0, 3, 100) == [3, 100, 32]
    pc = dataclasses.replace(pc, boundary_seq=("tgt",))
    assert pc.boundary_shape(0, 3, 100, 7) == [3, 7, 32]
    pc = dataclasses.replace(pc, boundary_seq=("both",))
    assert pc.boundary_shape(0, 3, 100, 7) == [3, 107, 32]
    assert pc.p2p_time(0, [3, 107, 32]) == pytest.approx(1e-5 + 3 * 107 * 32 * 2 / 1e9)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"forward": np.ones((2, 2, 3, 1))}, r"cost table forward: shape \(2, 2, 3, 1\)"),
        ({"s_grid": [16, 8]}, "s_grid must be non-empty and strictly increasing"),
        ({"b_grid": [2, 4]}, "must start at 1"),
        ({"activation": np.full((2, 2, 2, 1), np.nan)}, "activation contains NaN"),
    ],
)
def test_pipeline_costs_validation(overrides, message):
    with pytest.raises(PlanningError, match=message):
        small_costs(**overrides)


def test_available_memory_names_the_stage_that_does_not_fit():
    assert small_costs().available_memory().tolist() == [3.0 * GiB, 2.0 * GiB]
    with pytest.raises(PlanningError, match=r"stage 1: .* need 5\.00 GiB, more than .* 4\.00 GiB"):
        small_costs(static=np.array([1.0, 5.0]) * GiB).available_memory()
    tiny = small_costs(static=np.array([2e-3, 2e-3]) * GiB, memory_limit=1e-6 * GiB)
    with pytest.raises(PlanningError, match=r"stage 0: .* need 0\.002 GiB, more than .* 1e-06 GiB"):
        tiny.available_memory()  # not "0.00 GiB, more than 0.00 GiB"


@pytest.mark.parametrize("name", ["gpt-6.7b", "t5-5.5b"])
def test_vectorised_costs_equal_the_scalar_path_bit_for_bit(name):
    """`stage_costs_many` (all four tables gathered at once, axes without a weight skipped) gives
    the scalar `stage_costs` exactly: on grid points, between them, below the grid and beyond
    it (inf)."""
    pc = analytic(name, "selective")
    rng = np.random.default_rng(0)
    b = np.concatenate([rng.integers(1, 80, 40), pc.b_grid[:5].astype(np.int64)])
    s = np.concatenate([rng.integers(1, 4500, 40), pc.s_grid[:5].astype(np.int64)])
    t = rng.integers(0, 600, len(b)) if pc.encoder_decoder else np.zeros(len(b), np.int64)
    many = pc.stage_costs_many(b, s, t)
    for m in range(len(b)):
        one = pc.stage_costs(int(b[m]), int(s[m]), int(t[m]))
        scalar = (one.forward, one.backward, one.activation, one.transient)
        for got, want in zip(many, scalar, strict=True):
            assert got[m].tolist() == want.tolist()


# ---- packed rows' prices --------------------------------------------------------------------


def overfitted_table_entries() -> list[dict]:
    """A decoder layer whose single-sample time is 1e-8 s^2 - 4e-6 s + 1.4e-3 (a quadratic
    whose linear term is negative, as noise makes one) and grows as b^0.75 with the micro-batch
    size: its fitted s^2 term alone exceeds the table at s = 512, so a packed row of many short
    samples was priced below zero (as a profiled CPU table priced a 4,096-token row at -4 s)."""
    b_grid, s_grid = [1, 2, 4, 8, 16, 32], S_GRID
    b, s = np.meshgrid(np.array(b_grid, float), np.array(s_grid, float), indexing="ij")
    single = 1e-8 * s**2 - 4e-6 * s + 1.4e-3
    entries = gpt_entries()
    for e in entries:
        scale = 1.0 if e["component"] == "decoder_layer" else 0.01
        e["microbatch_sizes"] = b_grid
        for field in ("activation_bytes", "transient_bytes"):
            e[field] = (np.ones_like(b) * 2**20).tolist()
        for field, passes in (("forward_s", 1), ("backward_s", 2)):
            e[field] = (scale * passes * b**0.75 * single).tolist()
    return entries


@pytest.fixture(
    scope="module",
    params=["analytic-none", "analytic-selective", "analytic-full", "profiled-overfitted"],
)
def any_costs(request, tmp_path_factory):
    kind, what = request.param.split("-")
    if kind == "analytic":
        return analytic("gpt-1.3b", what, stages=2)
    return load(tmp_path_factory.mktemp("t"), overfitted_table_entries(), stages=2).pipeline_costs()


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_packed_price_is_never_negative_nor_above_padding(any_costs, data) -> None:
    """Any samples packed first-fit-decreasing into rows of their longest: each stage's forward
    and backward times are >= 0 and the total <= the same samples padded one per row."""
    longest = int(any_costs.s_grid[-1])
    most = int(any_costs.b_grid[-1])
    lengths = np.array(
        data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=most)), dtype=np.int64
    )
    group = Group(np.arange(len(lengths)), int(lengths.max()))
    packed = packed_group(group, lengths)
    rows = np.array([group.num_rows, packed.num_rows])
    seq = np.full(2, group.seqlen)
    fwd, bwd, _, _ = any_costs.stage_costs_many(rows, seq)
    saved = np.array([0.0, packed.attention_saved])
    fwd, bwd = any_costs.packed_times(fwd, bwd, rows, seq, saved)
    assert np.all(fwd >= 0) and np.all(bwd >= 0), (fwd, bwd)
    total = (fwd + bwd).sum(axis=1)
    assert total[1] <= total[0] * (1 + 1e-12), total


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data())
def test_a_packed_row_costs_at_most_the_tables_point_of_the_same_work(any_costs, data) -> None:
    """k samples of l tokens packed in one row of k x l cost at most what the tables measured
    (or the model priced) for k sequences of l tokens: the same tokens, the same attention."""
    k = data.draw(st.sampled_from([int(b) for b in any_costs.b_grid if b > 1]))
    fits = [int(s) for s in any_costs.s_grid if k * s <= any_costs.s_grid[-1]]
    assume(fits)
    l = data.draw(st.sampled_from(fits))  # noqa: E741
    row = k * l
    fwd, bwd, _, _ = any_costs.stage_costs_many(np.array([1]), np.array([row]))
    saved = np.array([float(row * row - k * l * l)])
    fwd, bwd = any_costs.packed_times(fwd, bwd, np.array([1]), np.array([row]), saved)
    same_f, same_b, _, _ = any_costs.stage_costs_many(np.array([k]), np.array([l]))
    assert np.all(fwd <= same_f * (1 + 1e-9)) and np.all(bwd <= same_b * (1 + 1e-9))


def test_profiled_attention_coefficient_is_bounded_by_what_the_tables_give_back(tmp_path):
    """The overfitted table's s^2 term (1e-8 x 3 passes x 2 layers a stage) is cut to what
    its tables give back at their tightest point: a row of 512 tokens of one-token samples is
    then priced at >= 0 on every stage and pass, exactly 0 where the bound is tight."""
    costs = load(tmp_path, overfitted_table_entries(), stages=2).pipeline_costs()
    b, s = np.meshgrid(costs.b_grid, costs.s_grid, indexing="ij")
    room = np.minimum(3 * costs.forward, 1.5 * costs.backward)[..., 0] / (b * s**2)
    np.testing.assert_allclose(costs.attention_coef, room.min(axis=(1, 2)), rtol=1e-12)
    assert np.all(costs.attention_coef < 6e-8)  # the fit to single samples
    at = (slice(None), -1, -1, 0)  # 32 rows of 512
    fwd, bwd = costs.packed_times(
        costs.forward[at][None],
        costs.backward[at][None],
        np.array([32]),
        np.array([512]),
        np.array([32 * (512**2 - 512)]),
    )
    assert np.all(fwd >= 0) and np.all(bwd >= 0)


def test_an_invalid_price_is_an_error_naming_the_candidate() -> None:
    """A cost table whose attention coefficient gives back more than a packed row costs (one
    no cost model of ours builds) fails planning in one error naming the candidate, instead of
    the candidate being dropped."""
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 80)
    costs = planner.costs("none", np.array([4096]), 4096)
    broken = dataclasses.replace(costs, attention_coef=costs.attention_coef * 1e3)
    planner.costs = lambda *_args, **_kw: broken
    lengths = np.array([100, 200, 300, 4000] * 8)
    with pytest.raises(
        CostModelError, match=r"candidate .*: micro-batch \d+, \d+ rows of \d+ tokens"
    ):
        planner.plan(lengths)


def test_a_cpu_clock_table_is_read_as_lines_over_the_microbatch_size(tmp_path):
    """One rank's CPU seconds are affine in the samples at each length: a table timed with
    `--clock cpu` gives the planner each length's least-squares line over b (a noisy point
    at b = 2 no longer makes micro-batches of 2 look cheaper per sample); a wall-clock
    table is read as measured."""
    entries = gpt_entries()
    b = np.array(B_GRID, dtype=float)[:, None]
    for e in entries:
        line = 1e-3 + 2e-3 * b * np.ones((1, len(S_GRID)))  # fixed + per sample
        noisy = line.copy()
        noisy[1] *= 0.7  # b = 2 read 30% low
        e["forward_s"], e["backward_s"] = noisy.tolist(), (2 * noisy).tolist()
    path = write_table(tmp_path, entries)
    cluster = ClusterSpec(A100, num_stages=1)
    as_measured = ProfiledCostModel.load(path, TINY_GPT, cluster).pipeline_costs()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "profile": {"clock": "cpu"}}))
    lines = ProfiledCostModel.load(path, TINY_GPT, cluster).pipeline_costs()
    layers = TINY_GPT.num_layers + 2  # every layer, the embedding and the head alike here
    fit = np.polyfit(B_GRID, [(1 + 2 * x) * (0.7 if x == 2 else 1) for x in B_GRID], 1)
    expected = 1e-3 * np.polyval(fit, B_GRID) * layers
    np.testing.assert_allclose(lines.forward[0, :, 0, 0], expected, rtol=1e-9)
    np.testing.assert_allclose(
        as_measured.forward[0, :, 0, 0], (1e-3 + 2e-3 * b[:, 0]) * [1, 0.7, 1] * layers
    )
