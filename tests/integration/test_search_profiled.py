"""`dynapipe-search --cost-table`: the Galvatron-BMW search priced from profiled cost tables.

A hand-written TP-1 and TP-2 table of a small GPT: the estimator's per-layer time and memory
equal the tables' entries scaled as `profiled_inputs` documents (times: the least-squares line
over the measured micro-batch sizes; memory: the value at the largest measured micro-batch / that
size, per sample), the plan the CLI writes predicts what `price_plan` gives
for those inputs, and bad tables (another model, a missing TP degree, negative or NaN values,
an unprofiled sequence length, a missing bandwidth) end the CLI with exit 2 and one line naming
the entry.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.schedule.one_f_one_b import one_f_one_b_passes
from dynapipe_planner.search import LayerStrategy, price_plan
from dynapipe_planner.search.cli import search_main
from dynapipe_planner.search.estimator import (
    Estimator,
    StageWork,
    core_shares,
    shared_host_time,
    stage_times,
    stage_work,
)
from dynapipe_planner.search.plan_file import load_plan
from dynapipe_planner.search.profiled_inputs import (
    affine_time,
    profiled_cost_inputs,
    read_cost_tables,
)

MODEL = ModelSpec("tiny", "gpt", 4, 64, 4, 256, 512, max_position_embeddings=128)
SEQ = 128
SIZES = [1, 2, 4]
SEQLENS = [64, 128]
LAYER_STATIC = 16 * MODEL.layer_params("decoder")  # fp32 weights, gradients, Adam m and v


def _grid(at_128: list[float | None], at_64: float = 1.0) -> list[list[float | None]]:
    return [[at_64, v] for v in at_128]


def _entry(tp: int, component: str, scale: float, static: int) -> dict:
    return {
        "tp": tp,
        "recompute": "none",
        "component": component,
        "microbatch_sizes": SIZES,
        "seqlens": SEQLENS,
        # b=4 out of memory at TP 1: b_ref is then 2
        "forward_s": _grid([0.011 * scale, 0.02 * scale, None if tp == 1 else 0.039 * scale]),
        "backward_s": _grid([0.025 * scale, 0.046 * scale, None if tp == 1 else 0.09 * scale]),
        "activation_bytes": _grid([3e6 * scale, 6e6 * scale, None if tp == 1 else 12e6 * scale]),
        "transient_bytes": _grid([1e6 * scale, 2e6 * scale, None if tp == 1 else 4e6 * scale]),
        "static_bytes": static,
    }


def _table(tp: int, bandwidth: float) -> dict:
    scale = 1.0 if tp == 1 else 0.6
    entries = [_entry(tp, "decoder_layer", scale, LAYER_STATIC // tp)]
    if tp == 1:
        entries += [_entry(1, "embedding", 0.1, 800_000), _entry(1, "lm_head", 0.5, 600_000)]
    return {
        "format": "dynapipe-cost-table",
        "version": 1,
        "device": "cpu (1 threads)",
        "dtype": "fp32",
        "model": {**MODEL.to_dict(), "num_layers": 2, "name": "profiled_gpt"},
        "allreduce_bus_bandwidth": {str(tp): bandwidth} if tp > 1 else {},
        "allreduce_latency_s": {str(tp): 1e-4} if tp > 1 else {},
        # FSDP2 on a TP-1 decoder layer over the table's ranks: forward +3 ms, backward +7 ms
        **(
            {"sdp_layer_forward_s": {"2": 0.003}, "sdp_layer_backward_s": {"2": 0.007}}
            if tp > 1
            else {}
        ),
        "entries": entries,
    }


@pytest.fixture
def tables(tmp_path):
    paths = []
    for tp, bw in ((1, 0.0), (2, 2e9)):
        path = tmp_path / f"tp{tp}.json"
        path.write_text(json.dumps(_table(tp, bw)))
        paths.append(path)
    return paths


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL.to_dict()))
    return path


def _inputs(paths, **kw):
    return profiled_cost_inputs(MODEL, read_cost_tables(paths), 2, seq_length=SEQ, **kw)


def test_layer_costs_are_the_tables_entries_scaled(tables):
    inputs = _inputs(tables)
    dp2 = LayerStrategy(1, ("dp",), (2,), False)
    tp2 = LayerStrategy(1, ("tp",), (2,), False)
    dp2_ckpt = LayerStrategy(1, ("dp",), (2,), True)
    est = Estimator(inputs, [dp2, tp2, dp2_ckpt])
    t = est.stage_tables(range(4), 0, 4, 1)  # micro-batch of 4, one micro-batch
    # TP 1: b_ref = 2 (b = 4 is null), per sample = value / 2; DP2 gives each rank 2 samples.
    fwd1, bwd1 = 0.02 / 2, 0.046 / 2
    act1, work1 = 6e6 / 2, 2e6 / 2
    assert t.nosync[0, 0] == pytest.approx(2 * (fwd1 + bwd1), rel=1e-12)
    assert t.fwd_bytes[0, 0] == pytest.approx(2 * act1, rel=1e-12)
    assert t.bwd_bytes[0, 0] == pytest.approx(2 * work1, rel=1e-12)
    assert t.state_bytes[0, 0] == pytest.approx(LAYER_STATIC, rel=1e-12)
    # DP's gradient all-reduce on the last micro-batch: 2 (N-1)/N x fp32 weights / bus bandwidth
    # + the measured latency
    grads = 4.0 * MODEL.layer_params("decoder")
    allreduce = grads / 2e9 + 1e-4
    assert inputs.link_latency_s == 1e-4
    assert t.sync[0, 0] == pytest.approx(
        2 * fwd1 + 1.3 * min(2 * bwd1, allreduce) + abs(2 * bwd1 - allreduce), rel=1e-12
    )
    # TP 2: the whole micro-batch of 4 on both ranks, TP's all-reduce inside the times. The
    # least-squares lines through b = 1, 2, 4 (mean b 7/3, sum of squared deviations 14/3):
    # forward 0.6 (0.0015 + 0.131 / 14 b), backward 0.6 (0.003 + 0.304 / 14 b) -- a fixed time
    # per micro-batch that the per-sample value at b_ref (0.6 x 0.039 / 4 per sample) leaves out
    fwd2 = 0.6 * (0.0015 + 0.131 / 14 * 4)
    bwd2 = 0.6 * (0.003 + 0.304 / 14 * 4)
    assert inputs.layer_types[0].forward_s_per_microbatch[2] == pytest.approx(0.6 * 0.0015)
    assert t.nosync[0, 1] == pytest.approx(fwd2 + bwd2, rel=1e-12)
    # TP 1: two measured sizes, the line through both: forward 0.002 + 0.009 b, which at the
    # 2 samples a DP2 rank holds is the b_ref = 2 value, as above
    assert t.fwd_bytes[0, 1] == pytest.approx(4 * 12e6 * 0.6 / 4, rel=1e-12)
    assert t.state_bytes[0, 1] == pytest.approx(LAYER_STATIC / 2, rel=1e-12)
    # CKPT keeps the layer's input (fp32, s x h per sample) and recomputes the forward
    assert t.fwd_bytes[0, 2] == pytest.approx(2 * 4 * SEQ * MODEL.hidden_size, rel=1e-12)
    assert t.nosync[0, 2] == pytest.approx(2 * (2 * fwd1 + bwd1), rel=1e-12)
    assert t.bwd_bytes[0, 2] == pytest.approx(2 * (work1 + act1), rel=1e-12)
    # SDP2: each rank runs 2 samples at TP 1 as DP2 does, and FSDP2's measured times replace
    # the gathers' and reduce-scatter's bytes over the bandwidth
    sdp2 = Estimator(inputs, [LayerStrategy(1, ("sdp",), (2,), False)])
    t_sdp = sdp2.stage_tables(range(4), 0, 4, 1)
    assert t_sdp.nosync[0, 0] == pytest.approx(2 * (fwd1 + bwd1) + 0.003 + 0.007, rel=1e-12)
    assert t_sdp.sync[0, 0] == pytest.approx(t_sdp.nosync[0, 0], rel=1e-12)
    # the ends: embedding and output states split over the stage's 2 ranks, head time measured
    factor = LAYER_STATIC / (4.0 * MODEL.layer_params("decoder"))
    assert inputs.model_state_factor == pytest.approx(factor)
    # lm_head forward + backward: 0.5 x (0.036, 0.066) at b = 1, 2: the line 0.003 + 0.015 b
    assert 3 * inputs.output_forward_s_per_sample == pytest.approx(0.015)
    assert 3 * inputs.output_forward_s_per_microbatch == pytest.approx(0.003)
    assert t.extra_bytes == pytest.approx((800_000 + 600_000) / 2 + 6e6 * 0.5 / 2 * 4 / 2)


def test_the_output_layer_is_priced_at_the_last_layers_tp_degree(tables, tmp_path):
    """A TP-2 table's own output layer (vocabulary-parallel, its all-reduces inside) prices
    the last layer of a TP-2 strategy on the last stage; a strategy whose TP degree has none
    takes the TP-1 layer's time split over the stage's ranks."""

    def measured(data):
        data[1]["entries"].append(_entry(2, "lm_head", 1.5, 300_000))

    inputs = _inputs(_edited(tables, tmp_path, measured))
    # lm_head at TP 2: 1.5 x (0.036, 0.066, 0.129) forward + backward at b = 1, 2, 4
    line = affine_time([(b, 1.5 * x / 3) for b, x in ((1, 0.036), (2, 0.066), (4, 0.129))])
    assert inputs.output_forward_s_per_microbatch_by_tp[2] == pytest.approx(line[0])
    assert inputs.output_forward_s_per_sample_by_tp[2] == pytest.approx(line[1])
    tp2, dp2 = LayerStrategy(1, ("tp",), (2,), False), LayerStrategy(1, ("dp",), (2,), False)
    t = Estimator(inputs, [tp2, dp2]).stage_tables(range(4), 0, 4, 1)
    head = t.nosync[3] - t.nosync[2]  # the decoder layers are alike: the last adds the head
    assert head[0] == pytest.approx(3 * (line[0] + line[1] * 4))
    assert head[1] == pytest.approx(3 * (0.001 + 0.005 * 4 / 2))  # TP 1's, over 2 ranks
    assert t.forward[3] - t.forward[2] == pytest.approx(head / 3)
    assert (t.sync[3] - t.sync[2]) == pytest.approx(head)


def test_affine_time_is_the_least_squares_line_kept_non_negative():
    assert affine_time([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
    assert affine_time([(2, 4.0)]) == pytest.approx((0.0, 2.0))  # one size: per sample (§V)
    # a negative intercept: the line through the origin, sum(b t) / sum(b^2)
    assert affine_time([(1, 0.5), (2, 3.0)]) == pytest.approx((0.0, 6.5 / 5))
    # a negative slope (noise): the mean, per micro-batch
    assert affine_time([(1, 4.0), (2, 3.0)]) == pytest.approx((3.5, 0.0))


def test_cli_searches_with_tables_and_predicts_what_they_imply(tables, model_file, tmp_path):
    plan_path = tmp_path / "plan.json"
    argv = [
        "--model", str(model_file), "--num-gpus", "2", "--seq-length", str(SEQ),
        "--memory-limit-gib", "0.05", "--global-batch-size", "8", "--quiet",
        "--cost-table", *map(str, tables), "--output", str(plan_path),
    ]  # fmt: skip
    assert search_main(argv) == 0
    plan = json.loads(plan_path.read_text())
    assert plan["gpu"] == "cpu (1 threads)"
    searched = load_plan(plan_path)
    price = price_plan(
        _inputs(tables),
        searched.strategies,
        searched.partition,
        searched.num_microbatches,
        searched.global_batch_size,
    )
    assert plan["predicted"]["iteration_time_s"] == pytest.approx(price.iteration_time_s)
    assert plan["predicted"]["stage_memory_bytes"] == pytest.approx(price.stage_memory_bytes)
    assert max(price.stage_memory_bytes) <= 0.05 * 2**30


def _edited(tables, tmp_path, edit) -> list:
    data = [json.loads(p.read_text()) for p in tables]
    edit(data)
    out = []
    for i, d in enumerate(data):
        path = tmp_path / f"edited{i}.json"
        path.write_text(json.dumps(d))
        out.append(path)
    return out


def _set(table: int, entry: int, field: str, value, b: int = 1, s: int = 1):
    def edit(data):
        data[table]["entries"][entry][field][b][s] = value

    return edit


def _hidden(data):
    data[0]["model"]["hidden_size"] = 128


def _no_tp2(data):
    data[1]["entries"][0]["tp"] = 4


def _no_bandwidth(data):
    data[1]["allreduce_bus_bandwidth"] = {}


def _negative_sdp_time(data):
    data[1]["sdp_layer_backward_s"] = {"2": -0.001}


def _bad_runtime(data):
    data[0]["runtime_s_per_microbatch"] = {"128": -1}


def _bad_contention(data):
    data[0]["cpu_contention_factor"] = {"2": {"1": 0}}


def _contention_of_one_size(data):  # the format before factors per micro-batch size
    data[0]["cpu_contention_factor"] = {"2": 1.2}


def _bad_host_cores(data):
    for d in data:
        d["host_cores"] = 0


def _seqlens(data):
    for d in data:
        for e in d["entries"]:
            e["seqlens"] = [64, 96]


@pytest.mark.parametrize(
    "edit, named",
    [
        (_hidden, "edited0.json was profiled for a model with hidden_size 128; tiny has 64"),
        (_no_tp2, "no decoder_layer entry for tp=2 (recompute none; profiled TP degrees [1, 4])"),
        (
            _set(0, 2, "forward_s", -0.5),
            "entry 2 (tp=1, lm_head): forward_s at micro-batch 2, sequence length 128 is -0.5",
        ),
        (
            _set(1, 0, "activation_bytes", -1.0, b=0),
            "edited1.json entry 0 (tp=2, decoder_layer): activation_bytes at micro-batch 1",
        ),
        (  # JSON's NaN is refused as the file is read (issue 34)
            _set(1, 0, "activation_bytes", float("nan"), b=0),
            "edited1.json: not valid JSON (NaN is not a number JSON allows)",
        ),
        (_no_bandwidth, "no all-reduce bandwidth measured for groups of [2] ranks"),
        (_seqlens, "sequence length 128 was not profiled (profiled: [64, 96])"),
        (_negative_sdp_time, "sdp_layer_backward_s['2'] must be a number >= 0, got -0.001"),
        (_bad_host_cores, "edited0.json host_cores must be a positive integer, got 0"),
        (_bad_runtime, "runtime_s_per_microbatch['128'] must be a finite number >= 0, got -1"),
        (_bad_contention, "edited0.json cpu_contention_factor['2']['1'] must be a positive"),
        (_contention_of_one_size, "cpu_contention_factor['2'] must map micro-batch sizes"),
    ],
)
def test_bad_tables_are_refused_in_one_line(tables, model_file, tmp_path, capsys, edit, named):
    edited = _edited(tables, tmp_path, edit)
    argv = [
        "--model", str(model_file), "--num-gpus", "2", "--seq-length", str(SEQ),
        "--memory-limit-gib", "1", "--quiet", "--cost-table", *map(str, edited),
    ]  # fmt: skip
    assert search_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynapipe-search: error: ")
    assert named in err


def _on_cores(tables, tmp_path, cores: list[int | None], busy: float) -> list:
    """The tables as measured on CPUs of `cores` cores (None: a table without them)."""

    def edit(data):
        for d, n, tp in zip(data, cores, (1, 2), strict=True):
            if n is not None:
                d["host_cores"], d["cpu_busy_fraction"] = n, {str(tp): busy}

    return _edited(tables, tmp_path, edit)


def test_ranks_outnumbering_the_cores_take_the_cpu_seconds_they_need(tables, tmp_path):
    """PP2 on 2 ranks: Eq. 9 runs the stages side by side, which one shared core cannot; with
    ranks on the core all their time, some pass is always ready, so the estimate is every
    stage's time summed over the one core, plus the receiving end of each transfer (a
    stage's time holds its sends only)."""
    pp2 = [LayerStrategy(2, (), (), False)] * 4

    def price(paths):
        return price_plan(_inputs(paths), pp2, [2, 2], 4, 8)

    alone = price(tables)  # GPU-like tables: no host, Eq. 9
    assert _inputs(tables).host_cores == 0
    on_one_core = _on_cores(tables, tmp_path, [1, 1], 1.0)
    one_core = price(on_one_core)
    assert one_core.stage_time_s == alone.stage_time_s
    assert sum(alone.stage_time_s) > alone.iteration_time_s  # the bound is the larger
    est = Estimator(_inputs(on_one_core), pp2[:1])
    stages = [est.stage_tables(range(2 * i, 2 * i + 2), i, 2, 4) for i in (0, 1)]
    receives = [t.extra_cpu - t.extra_time_nosync for t in stages]
    assert receives[0] == receives[1] > 0  # one transfer each way per micro-batch
    expected = sum(alone.stage_time_s) + 4 * sum(receives)
    assert one_core.iteration_time_s == pytest.approx(expected, rel=1e-9)
    assert one_core.throughput == pytest.approx(8 / one_core.iteration_time_s)
    # as many cores as ranks, or one table without host cores: Eq. 9 alone
    assert price(_on_cores(tables, tmp_path, [2, 4], 0.9)) == alone
    assert price(_on_cores(tables, tmp_path, [1, None], 0.9)) == alone
    # ranks on the core a small enough share of their time pass at their speed alone: the
    # 1F1B run of equal stages then takes Eq. 9's time
    low = price(_on_cores(tables, tmp_path, [1, 1], 0.3))
    assert low.iteration_time_s == pytest.approx(alone.iteration_time_s, rel=1e-9)


def test_cpu_contention_scales_the_strategies_whose_processes_had_a_core(tables, tmp_path):
    """2 ranks on 1 core: a TP-1 strategy (its profile's one process had the core) pays the
    TP-1 table's factor for 2 ranks at its samples per rank, interpolated between the
    measured micro-batch sizes; a TP-2 strategy (2 processes on 1 core: already contended)
    does not; a factor for another rank count is not used."""

    def measured(ranks: str):
        def edit(data):
            for d, tp in zip(data, (1, 2), strict=True):
                d["host_cores"], d["cpu_busy_fraction"] = 1, {str(tp): 0.8}
            data[0]["cpu_contention_factor"] = {ranks: {"1": 1.1, "4": 1.4}}

        return edit

    inputs = _inputs(_edited(tables, tmp_path, measured("2")))
    assert inputs.cpu_contention_factor == {1: 1.1, 4: 1.4}
    assert _inputs(_edited(tables, tmp_path, measured("4"))).cpu_contention_factor == {}
    dp2, tp2 = LayerStrategy(1, ("dp",), (2,), False), LayerStrategy(1, ("tp",), (2,), False)
    dp2_ckpt = LayerStrategy(1, ("dp",), (2,), True)
    t = Estimator(inputs, [dp2, tp2, dp2_ckpt]).stage_tables(range(4), 0, 4, 1)
    # DP2 at b=4: 2 samples a rank, a third of the way from 1 to 4
    assert t.cpu_nosync[0, 0] == pytest.approx(0.8 * 1.2 * t.nosync[0, 0])
    assert t.cpu_nosync[0, 1] == pytest.approx(0.8 * t.nosync[0, 1])
    # the recomputed forward runs warm, right before its backward: the factor spares it
    recompute = t.forward[0, 2]
    assert t.nosync[0, 2] == pytest.approx(t.nosync[0, 0] + recompute)
    assert t.cpu_nosync[0, 2] == pytest.approx(0.8 * (1.2 * t.nosync[0, 0] + recompute))
    t = Estimator(inputs, [dp2]).stage_tables(range(4), 0, 16, 1)  # 8 a rank: flat beyond 4
    assert t.cpu_nosync[0, 0] == pytest.approx(0.8 * 1.4 * t.nosync[0, 0])


def test_fsdp2_measured_peak_replaces_the_gathered_weights(tables, tmp_path):
    def measured(data):
        data[1]["sdp_layer_transient_bytes"] = {"2": 5_000_000}

    sdp2 = [LayerStrategy(1, ("sdp",), (2,), False)]
    plain = Estimator(_inputs(tables), sdp2).stage_tables(range(4), 0, 4, 1)
    traced = Estimator(_inputs(_edited(tables, tmp_path, measured)), sdp2)
    t = traced.stage_tables(range(4), 0, 4, 1)
    weights = 4.0 * MODEL.layer_params("decoder")  # fp32: what §V's gather holds
    assert t.bwd_bytes[0, 0] == pytest.approx(plain.bwd_bytes[0, 0] - weights + 5_000_000)


def test_fsdp2_time_counts_at_its_own_cpu_share(tables, tmp_path):
    """An SDP layer's CPU seconds: its compute at the TP degree's busy share, the time FSDP2
    adds at the share measured for it (its collectives wait on the other ranks)."""

    def shares(data):
        for d, tp in zip(data, (1, 2), strict=True):
            d["host_cores"], d["cpu_busy_fraction"] = 1, {str(tp): 0.9}
        data[1]["sdp_layer_cpu_busy_fraction"] = {"2": 0.25}

    inputs = _inputs(_edited(tables, tmp_path, shares))
    assert inputs.sdp_cpu_busy_fraction == {2: 0.25}
    t = Estimator(inputs, [LayerStrategy(1, ("sdp",), (2,), False)]).stage_tables(range(4), 0, 4, 1)
    fsdp = 0.003 + 0.007  # the table's FSDP2 forward + backward over 2 ranks
    assert t.cpu_nosync[0, 0] == pytest.approx(0.9 * (t.nosync[0, 0] - fsdp) + 0.25 * fsdp)
    # profiled on 2 ranks and 1 core, FSDP2 kept the core busy 2 x 0.25 of its time: the
    # other half of it the core stood idle waiting for a rank's collective
    assert t.sync_idle[0, 0] == pytest.approx(0.5 * fsdp)


def _work(forward: float, backward: float, busy: float = 1.0) -> StageWork:
    """A stage's passes taking `forward` / `backward` seconds alone, on a core `busy` of it."""
    return StageWork(forward, backward, backward, forward * busy, backward * busy, backward * busy)


def test_one_f_one_b_warms_up_by_the_stages_after_it():
    assert one_f_one_b_passes(3, 4)[0] == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)
    ]  # fmt: skip
    assert one_f_one_b_passes(3, 2)[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b_passes(4, 2)[0] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # m < P - 1


def test_cores_go_max_min_fair():
    assert core_shares([1.0, 1.0, 1.0, 1.0], 1, 2) == [0.5] * 4
    # a rank on a core a quarter of its time leaves the rest to the other two
    assert core_shares([1.0, 0.25, 1.0], 1, 2) == pytest.approx([0.875, 0.25, 0.875])
    assert core_shares([0.5, 2.0], 2, 8) == [0.5, 1.0]  # never more than one core a rank


def test_shared_cores_run_the_1f1b_passes_as_their_inputs_arrive(tables):
    inputs = dataclasses.replace(_inputs(tables), host_cores=2)
    # one stage of 4 ranks on 2 cores, nothing to wait for: their CPU seconds over the cores
    assert shared_host_time(inputs, [_work(1.0, 2.0)], 4, 2) == pytest.approx(4 * 6 / 2)
    # one micro-batch through 4 stages: one pass at a time, so one of the 2 cores is idle
    # throughout (the total over the cores would say 4)
    assert shared_host_time(inputs, [_work(1.0, 1.0)] * 4, 1, 1) == pytest.approx(8.0)
    # 4 stages, 2 micro-batches, passes of 1 s: worked through on paper, 1F1B runs F0 on
    # stage 0 (t=1), F0 on 1 beside F1 on 0 (2), F0 on 2 (3), F0 on 3 (4), B0 on 3 beside
    # F1 on 2 (5), B0 on 2 beside F1 on 3 (6), B0 on 1 beside B1 on 3 (7), B0 on 0 beside
    # B1 on 2 (8), B1 on 1 (9), B1 on 0 (10): never more passes ready than cores
    assert shared_host_time(inputs, [_work(1.0, 1.0)] * 4, 1, 2) == pytest.approx(10.0)
    assert shared_host_time(inputs, [_work(1.0, 2.0)] * 2, 1, 4) == 0.0  # no more ranks than cores
    # stages whose SDP collectives leave the cores idle: the longest idle is added
    assert shared_host_time(inputs, [_work(1.0, 2.0)], 4, 2, [0.1, 0.3]) == pytest.approx(12.3)


def test_shared_cores_pass_at_the_speed_alone_where_cores_are_left(tables):
    """Ranks on a core part of the time (waiting on TP peers) take their time alone while
    the cores go round; four ranks wanting more than the cores share their CPU seconds."""
    inputs = dataclasses.replace(_inputs(tables), host_cores=2)
    assert shared_host_time(inputs, [_work(1.0, 2.0, 0.4)], 4, 1) == pytest.approx(3.0)
    assert shared_host_time(inputs, [_work(1.0, 2.0, 0.8)], 4, 1) == pytest.approx(3 * 0.8 * 2)


def test_stage_work_splits_a_micro_batch_into_its_forward_and_backward(tables):
    ckpt = LayerStrategy(2, ("tp",), (2,), True)
    est = Estimator(dataclasses.replace(_inputs(tables), host_cores=1), [ckpt])
    t = est.stage_tables(range(2, 4), 1, 4, 4)
    nosync, sync = stage_times(t, [0, 0])
    work = stage_work(t, [0, 0])
    assert work.forward_s + work.backward_s == pytest.approx(nosync)
    assert work.forward_s + work.last_backward_s == pytest.approx(sync)
    # the layers' forwards (the last with the output layer's) and a third of the extras
    assert work.forward_s == pytest.approx(t.forward[:, 0].sum() + t.extra_time_nosync / 3)
    # under CKPT the backward recomputes the forward: more than twice the forward's layers
    assert work.backward_s > 2 * 2 * t.forward[0, 0]
    busy = float(t.busy[0])
    # a transfer's CPU at both ends: the stage's time holds its one send, its CPU the receive
    assert t.extra_cpu > t.extra_time_nosync
    own = nosync - t.extra_time_nosync + t.extra_cpu
    assert work.forward_cpu_s + work.backward_cpu_s == pytest.approx(busy * own)


def test_the_runtime_per_micro_batch_is_added_to_every_stage(tables, tmp_path):
    def measured(data):  # the TP-1 table's, at the job's sequence length (128) only
        data[0]["runtime_s_per_microbatch"] = {"64": 9.0, "128": 0.004}

    pp2 = [LayerStrategy(2, (), (), False)] * 4
    alone = price_plan(_inputs(tables), pp2, [2, 2], 4, 8)
    priced = price_plan(_inputs(_edited(tables, tmp_path, measured)), pp2, [2, 2], 4, 8)
    # (m - 1) micro-batches without sync plus the last: 4 micro-batches of each stage
    assert priced.stage_time_s == pytest.approx([t + 4 * 0.004 for t in alone.stage_time_s])


def test_max_tp_names_the_degree_no_table_holds(tables):
    with pytest.raises(PlanningError, match="no decoder_layer entry for tp=2"):
        _inputs(tables[:1], max_tp=2)
    narrowed = _inputs(tables[:1] + tables[1:], max_tp=1)
    assert set(narrowed.layer_types[0].forward_s_per_sample) == {1}
    with pytest.raises(PlanningError, match="a second entry for tp=1, decoder_layer"):
        profiled_cost_inputs(MODEL, read_cost_tables([tables[0], tables[0]]), 2, seq_length=SEQ)


def test_a_file_that_is_not_a_cost_table_is_named(tmp_path):
    other = copy.deepcopy(_table(1, 0.0))
    other["format"] = "other"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    with pytest.raises(PlanningError, match=r"other.json: expected format 'dynapipe-cost-table'"):
        read_cost_tables([path])
