"""Galvatron-BMW search end to end: results, infeasible budgets, plan file, flags, CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re

import pytest

from dynapipe_planner.cluster import GiB, get_gpu
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search import (
    analytic_cost_inputs,
    balance_partitions,
    price_plan,
    search,
    strategy_space,
)
from dynapipe_planner.search.cli import search_main
from dynapipe_planner.search.optimizer import _pipeline_searches
from dynapipe_planner.search.plan_file import (
    PlanFileError,
    check_job,
    load_plan,
    megatron_flags,
    parallel_plan_flags,
    parallel_plan_refusal,
    runtime_flags,
    write_plan,
)
from dynapipe_planner.search.runnable import runnable_search, runs_in_runtime

MODEL = MODEL_PRESETS["gpt-350m"]
GPU = get_gpu("A100-40GB")


@pytest.fixture(scope="module")
def inputs():
    return analytic_cost_inputs(MODEL, GPU, 8, seq_length=1024)


def _check(result, budget):
    assert sum(result.partition) == MODEL.num_layers == len(result.strategies)
    assert len(result.partition) == result.pp == len(result.stage_memory_bytes)
    assert all(s.pp == result.pp and s.group_size * s.pp == 8 for s in result.strategies)
    assert max(result.stage_memory_bytes) <= budget
    assert result.throughput == pytest.approx(result.global_batch_size / result.iteration_time_s)
    assert result.global_batch_size % result.num_microbatches == 0
    for s in result.strategies:
        assert result.microbatch_size % s.data_degree == 0


def test_search_returns_a_consistent_plan_and_bmw_is_no_worse_than_base(inputs):
    budget = 3 * GiB
    base = search(MODEL, inputs, 8, budget, bi_objective=False, pp_degrees=[2, 4])
    bmw = search(MODEL, inputs, 8, budget, pp_degrees=[2, 4])
    _check(base, budget)
    _check(bmw, budget)
    assert bmw.throughput >= base.throughput
    assert bmw.base_throughput >= base.throughput * (1 - 1e-12)


def test_fixed_batch_and_limited_space(inputs):
    only_tp = search(
        MODEL, inputs, 8, 20 * GiB, global_batch_size=32, strategy_filter=lambda s: s.dp == 1
        and s.sdp == 1,
    )  # fmt: skip
    assert only_tp.global_batch_size == 32
    fixed = search(MODEL, inputs, 8, 20 * GiB, global_batch_size=32, num_microbatches=4)
    assert fixed.num_microbatches == 4
    assert all(s.dp == s.sdp == 1 for s in only_tp.strategies)
    full = search(MODEL, inputs, 8, 20 * GiB, global_batch_size=32)
    assert full.throughput >= only_tp.throughput


def test_infeasible_budget_names_the_smallest_that_works(inputs):
    with pytest.raises(PlanningError) as err:
        search(MODEL, inputs, 8, 0.5 * GiB, global_batch_size=8)
    message = str(err.value)
    assert "gpt-350m" in message and "0.50 GiB" in message
    smallest = float(re.search(r"smallest budget that works is ([0-9.]+) GiB", message)[1])
    assert smallest > 0.5
    # One memory figure besides the budget: no "least" that is more than what works (here the
    # per-layer least-memory guess is 1.44 GiB while 0.98 GiB works).
    assert re.findall(r"([0-9.]+) GiB", message) == ["0.50", f"{smallest:.2f}"]
    assert f"--memory-limit-gib {smallest:.2f})" in message
    ok = search(MODEL, inputs, 8, smallest * GiB, global_batch_size=8)
    assert max(ok.stage_memory_bytes) <= smallest * GiB
    with pytest.raises(PlanningError):
        search(MODEL, inputs, 8, (smallest - 0.01) * GiB, global_batch_size=8)


def test_full_microbatch_range_reaches_plans_the_doubling_range_cannot(inputs):
    """Every micro-batch count dividing the batch is searched: at 1 GiB per GPU nothing with
    m = P, 2P, 4P or 8P micro-batches fits, while more, smaller micro-batches do (without PP:
    TP8 over 64 micro-batches of one sample). The search equals the best of the searches at
    each fixed count (brute force over counts; even partitions keep each one exact)."""
    budget, batch = 1.0 * GiB, 64
    kwargs = dict(global_batch_size=batch, pp_degrees=[1, 2], even_partition=True)
    with pytest.raises(PlanningError, match="does not fit"):
        search(MODEL, inputs, 8, budget, microbatch_counts=4, **kwargs)
    wide = search(MODEL, inputs, 8, budget, **kwargs)
    _check(wide, budget)
    assert wide.num_microbatches > 8 * wide.pp
    no_pp = search(MODEL, inputs, 8, budget, global_batch_size=batch, pp_degrees=[1])
    assert no_pp.num_microbatches == batch and {s.tp for s in no_pp.strategies} == {8}
    counts = [m for m in range(1, batch + 1) if batch % m == 0]
    base_kwargs = dict(global_batch_size=batch, pp_degrees=[1, 2], bi_objective=False)
    for options in (kwargs, base_kwargs):
        each = []
        for m in counts:
            with contextlib.suppress(PlanningError):
                each.append(search(MODEL, inputs, 8, budget, num_microbatches=m, **options))
        got = search(MODEL, inputs, 8, budget, **options)
        assert got.throughput == max(r.throughput for r in each) == got.base_throughput
    assert search(MODEL, inputs, 8, budget, global_batch_size=batch).throughput >= wide.throughput


def test_negative_budget_is_refused_in_gib(inputs, capsys):
    with pytest.raises(PlanningError) as err:
        search(MODEL, inputs, 8, -1.5 * GiB, global_batch_size=8)
    assert str(err.value) == "memory budget must be positive, got -1.5 GiB per GPU"
    with pytest.raises(SystemExit) as refused:
        search_main(["--model", "gpt-350m", "--num-gpus", "8", "--memory-limit-gib", "-1",
                     "--global-batch-size", "8", "--quiet"])  # fmt: skip
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and err_lines == [
        "dynapipe-search: error: argument --memory-limit-gib: -1 GiB per GPU: a memory size "
        "must not be negative"
    ]


def test_bad_arguments_are_named(inputs):
    with pytest.raises(PlanningError, match="PP degree"):
        search(MODEL, inputs, 8, GiB, pp_degrees=[3])
    with pytest.raises(PlanningError, match="layers"):
        search(MODEL_PRESETS["gpt-125m"], inputs, 8, GiB)


def test_plan_file_and_megatron_flags(inputs, tmp_path):
    uniform = search(
        MODEL, inputs, 8, 20 * GiB, global_batch_size=64, pp_degrees=[2],
        strategy_filter=lambda s: s.order == ("dp", "tp") and s.tp == 2 and not s.ckpt,
    )  # fmt: skip
    flags = megatron_flags(uniform, MODEL)
    assert flags.expressible
    line = flags.command_line()
    assert "--tensor-model-parallel-size 2" in line
    assert "--pipeline-model-parallel-size 2" in line
    assert f"--global-batch-size {uniform.global_batch_size}" in line
    assert f"--micro-batch-size {uniform.microbatch_size // 2}" in line
    if uniform.partition[0] != uniform.partition[1]:
        assert f"--decoder-first-pipeline-num-layers {uniform.partition[0]}" in line
    path = tmp_path / "plan.json"
    data = write_plan(uniform, path, MODEL, seq_length=1024, gpu=GPU.name)
    assert json.loads(path.read_text()) == data
    assert data["partition"] == uniform.partition and len(data["layers"]) == MODEL.num_layers
    assert data["layers"][0]["tp"] == 2 and data["megatron"]["expressible"]
    assert not list(tmp_path.glob(".*tmp"))
    varied = search(
        MODEL, inputs, 8, 20 * GiB, global_batch_size=64, pp_degrees=[1],
        strategy_filter=lambda s: not s.ckpt,
    )  # fmt: skip
    varied.strategies[0] = next(
        s for s in _space_pp1() if s.tp != varied.strategies[1].tp and not s.ckpt
    )
    out = megatron_flags(varied, MODEL)
    assert not out.expressible and any("TP varies" in n for n in out.notes)
    assert not runtime_flags(varied, MODEL, 1024).expressible


def _space_pp1():
    from dynapipe_planner.search import strategy_space

    return strategy_space(8)[1]


def test_cli_prints_a_summary_and_writes_the_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code = search_main(
        ["--model", "gpt-125m", "--num-gpus", "4", "--memory-limit-gib", "8", "--seq-length",
         "512", "--global-batch-size", "32", "--output", str(path), "--quiet"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "throughput" in out and "Megatron-LM" in out and "stage" in out
    assert json.loads(path.read_text())["global_batch_size"] == 32
    code = search_main(
        ["--model", "gpt-125m", "--num-gpus", "4", "--memory-limit-gib", "8", "--seq-length",
         "512", "--global-batch-size", "32", "--pipeline-model-parallel-size", "4",
         "--even-partition", "--output", str(path), "--quiet"]
    )  # fmt: skip
    capsys.readouterr()
    assert code == 0 and json.loads(path.read_text())["partition"] == [3, 3, 3, 3]
    code = search_main(["--model", "gpt-350m", "--num-gpus", "8", "--memory-limit-gib", "0.2",
                        "--global-batch-size", "8", "--quiet"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "smallest budget that works" in err


@pytest.fixture(scope="module")
def dp_only(inputs):
    """A DP x PP=2 plan whose recomputed layers are no prefix of their stage: Megatron's
    flags and the runtime's cannot say it, the plan file can."""
    result = search(
        MODEL, inputs, 8, 20 * GiB, global_batch_size=64, pp_degrees=[2],
        strategy_filter=lambda s: s.order == ("dp",) and not s.ckpt,
    )  # fmt: skip
    result.strategies[1] = dataclasses.replace(result.strategies[1], ckpt=True)
    return result


def test_the_runtime_runs_what_the_flags_cannot_say(dp_only, tmp_path):
    assert not megatron_flags(dp_only, MODEL).expressible
    assert not runtime_flags(dp_only, MODEL, 1024).expressible
    path = tmp_path / "plan.json"
    flags = parallel_plan_flags(dp_only, MODEL, 1024, str(path))
    assert flags.expressible and flags.command_line().endswith(f"--parallel-plan {path}")
    written = write_plan(dp_only, path, MODEL, seq_length=1024, num_gpus=8, gpu="A100-40GB")
    # the file says how the runtime runs it, as the CLI prints it: with itself
    assert written["runtime"] == {"expressible": True, "flags": flags.flags, "notes": []}
    plan = load_plan(path)
    # the job's iteration line gives the search's prediction and what it priced
    assert (plan.predicted_iteration_s, plan.priced_on) == (dp_only.iteration_time_s, "A100-40GB")
    assert plan.partition == tuple(dp_only.partition) and plan.checkpointed_layers == (1,)
    assert plan.strategies == tuple(dp_only.strategies) and plan.data_degree == 8 // dp_only.pp
    check_job(plan, MODEL, 8, 1024)
    with pytest.raises(PlanFileError, match="is for 8 GPUs; this job has 4"):
        check_job(plan, MODEL, 4, 1024)
    sdp = dataclasses.replace(dp_only, strategies=list(dp_only.strategies))
    sdp.strategies[3] = dataclasses.replace(sdp.strategies[3], order=("sdp",))
    assert "the runtime shards SDP layers (ZeRO-3) under --parallel-plan only" in (
        runtime_flags(sdp, MODEL, 1024).notes
    )
    assert parallel_plan_flags(sdp, MODEL, 1024, str(path)).expressible
    hybrid = dataclasses.replace(sdp.strategies[3], order=("dp", "sdp"), degrees=(2, 2))
    sdp.strategies[3] = hybrid
    refused = parallel_plan_flags(sdp, MODEL, 1024, str(path))
    assert not refused.expressible and refused.notes[0].startswith(
        "layer 3 (PP2+DP2+SDP2): SDP over 2 of its 4 data-parallel ranks (hybrid DP x SDP)"
    )


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(version=7), "not a dynapipe-search plan of version 1"),
        (lambda d: d["layers"].pop(), "23 layer strategies and partition"),
        (lambda d: d.update(partition=[1, 23]), "layers[1] must be layer 1 of stage 1"),
        (lambda d: d["layers"][5].update(sdp=2), "layers[5]: sdp 2 disagrees with its order"),
        (lambda d: d["layers"][5].update(ckpt="yes"), "layers[5]: 'ckpt' must be true or"),
        (lambda d: d.update(num_microbatches=0), "'num_microbatches' must be a positive"),
        (lambda d: d.update(num_gpus=16), "layer 0 (PP2+DP4) uses 4 GPU(s) per stage"),
        (
            lambda d: d["predicted"].update(iteration_time_s=-1),
            "predicted iteration_time_s must be a positive number, got -1",
        ),
    ],
    ids=["version", "layers", "partition", "degree", "ckpt", "microbatches", "gpus", "predicted"],
)
def test_a_bad_plan_file_is_named(dp_only, tmp_path, edit, named):
    data = json.loads(json.dumps(write_plan(dp_only, tmp_path / "p.json", MODEL, seq_length=1024)))
    data["num_gpus"] = 8
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=re.escape(named)):
        load_plan(path)


def test_cli_prints_the_parallel_plan_command(tmp_path, capsys):
    """A plan only the plan file can say (3 of 4 layers recomputed): the CLI prints the
    pretrain_gpt.py command that runs the file it writes."""
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(dict(name="tiny", arch="gpt", num_layers=4, hidden_size=32,
                                     num_heads=4, ffn_hidden_size=64, vocab_size=64)))  # fmt: skip
    path = tmp_path / "plan.json"
    argv = ["--model", str(model), "--num-gpus", "4", "--memory-limit-gib", "0.002",
            "--seq-length", "64", "--quiet"]  # fmt: skip
    assert search_main([*argv, "--output", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DP4+CKPT x3, DP4 x1" in out
    line = next(x for x in out.splitlines() if x.startswith("pretrain_gpt.py: "))
    assert "--num-layers 4 --hidden-size 32" in line and line.endswith(f"--parallel-plan {path}")
    assert load_plan(path).checkpointed_layers == (0, 1, 2)
    assert search_main(argv) == 0
    assert "--parallel-plan FILE\n  note: write FILE with --output FILE" in capsys.readouterr().out


def test_runnable_search_keeps_the_best_plan_the_runtime_runs():
    """LLaMA-7B on 8 GPUs at 24 GiB: the runnable search returns a plan the runtime accepts, no
    slower than any single-TP-degree search's plan the runtime runs, no faster than the free
    search's."""
    model = MODEL_PRESETS["llama-7b"]
    inputs = analytic_cost_inputs(model, GPU, 8, seq_length=2048)
    free = search(model, inputs, 8, 24 * GiB)
    runnable = runnable_search(model, inputs, 8, 24 * GiB)
    assert parallel_plan_refusal(runnable.strategies, runnable.partition) is None
    assert len({s.tp for s in runnable.strategies}) == 1
    per_degree = []
    for tp in (1, 2, 4, 8):
        try:
            per_degree.append(
                search(model, inputs, 8, 24 * GiB, strategy_filter=lambda s, t=tp: s.tp == t)
            )
        except PlanningError:
            continue
    runs = [r for r in per_degree if parallel_plan_refusal(r.strategies, r.partition) is None]
    assert runnable.throughput >= max(r.throughput for r in runs)
    assert runnable.throughput <= free.throughput
    assert all(runs_in_runtime(s, runnable.strategies[0].tp) for s in runnable.strategies)


def test_runnable_search_names_every_degree_when_nothing_fits(inputs):
    with pytest.raises(PlanningError, match=r"runs fits: TP 1: .*; TP 2: .*; TP 4: .*; TP 8: "):
        runnable_search(MODEL, inputs, 8, 0.01 * GiB)


def test_cli_runnable_flag_prints_a_command_the_runtime_runs(capsys):
    argv = ["--model", "llama-7b", "--num-gpus", "8", "--memory-limit-gib", "24",
            "--seq-length", "2048", "--quiet"]  # fmt: skip
    assert search_main([*argv, "--runnable"]) == 0
    out = capsys.readouterr().out
    assert "pretrain_gpt.py: --num-layers 32" in out and "--parallel-plan FILE" in out


def test_six_gpus_use_non_power_of_two_degrees():
    model = MODEL_PRESETS["gpt-125m"]  # 12 heads: TP 3 and 6 split it
    inputs = analytic_cost_inputs(model, GPU, 6, seq_length=512)
    assert {3, 6} <= set(inputs.layer_types[0].forward_s_per_sample)
    result = search(model, inputs, 6, 4 * GiB, global_batch_size=36, pp_degrees=[1, 3])
    assert result.pp in (1, 3)
    assert all(s.group_size * s.pp == 6 for s in result.strategies)
    tp3 = search(
        model, inputs, 6, 4 * GiB, global_batch_size=36, strategy_filter=lambda s: s.tp == 3
    )
    assert {s.tp for s in tp3.strategies} == {3}


def test_bi_objective_partition_beats_memory_balanced_on_two_nodes():
    """16 GPUs on two nodes: PP=2 puts the pipeline boundary on the network; the memory-
    balanced start gives the last stage more layers, and Alg. 2 moves one back."""
    model = MODEL_PRESETS["bert-huge-32"]
    inputs = analytic_cost_inputs(model, GPU, 16, seq_length=512)
    budget = 8 * GiB
    kw = {"global_batch_size": 256, "pp_degrees": [2]}
    base = search(model, inputs, 16, budget, bi_objective=False, **kw)
    bmw = search(model, inputs, 16, budget, **kw)
    assert base.partition[0] < base.partition[1]
    assert bmw.partition != base.partition
    assert bmw.throughput > base.throughput * 1.01
    assert max(bmw.stage_time_s) <= max(base.stage_time_s)
    assert max(bmw.stage_memory_bytes) <= budget


def _result(partition, strategies, batch=64, micro=8):
    from dynapipe_planner.search import SearchResult

    return SearchResult(
        throughput=1.0, iteration_time_s=1.0, global_batch_size=batch, num_microbatches=micro,
        pp=len(partition), partition=partition, strategies=strategies,
        stage_memory_bytes=[0.0] * len(partition), stage_time_s=[1.0] * len(partition),
        memory_budget_bytes=8 * GiB, bi_objective=True,
    )  # fmt: skip


def test_megatron_flags_for_uneven_split_block_recompute_and_sdp():
    from dynapipe_planner.search import LayerStrategy

    plain = LayerStrategy(2, ("dp", "tp"), (2, 2), False)
    ckpt = LayerStrategy(2, ("dp", "tp"), (2, 2), True)
    layers = [ckpt] * 3 + [plain] * 7 + [ckpt] * 3 + [plain] * 11
    flags = megatron_flags(_result([10, 14], layers), MODEL)
    assert flags.expressible, flags.notes
    assert flags.flags == [
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
        "--num-layers 24",
        "--micro-batch-size 4",
        "--global-batch-size 64",
        "--decoder-first-pipeline-num-layers 10",
        "--decoder-last-pipeline-num-layers 14",
        "--recompute-granularity full",
        "--recompute-method block",
        "--recompute-num-layers 3",
    ]
    # CKPT on the last layers of a stage: Megatron's block method cannot say that.
    late = [plain] * 7 + [ckpt] * 3 + [ckpt] * 3 + [plain] * 11
    out = megatron_flags(_result([10, 14], late), MODEL)
    assert not out.expressible and "not the first layers" in out.notes[0]
    # Every layer recomputed: the uniform method; SDP: Megatron FSDP with full sharding.
    sdp = LayerStrategy(1, ("sdp",), (8,), True)
    out = megatron_flags(_result([24], [sdp] * 24), MODEL)
    assert out.expressible
    assert "--recompute-method uniform" in out.flags and "--recompute-num-layers 1" in out.flags
    assert "--data-parallel-sharding-strategy optim_grads_params" in out.flags
    assert any("ZeRO-3" in n for n in out.notes)
    # Strided TP (TP at the root of the tree) is not Megatron's rank order.
    strided = LayerStrategy(1, ("tp", "dp"), (2, 4), False)
    out = megatron_flags(_result([24], [strided] * 24), MODEL)
    assert not out.expressible and any("strided" in n for n in out.notes)
    # Unequal middle stages.
    four = LayerStrategy(4, ("dp",), (2,), False)
    out = megatron_flags(_result([5, 6, 7, 6], [four] * 24), MODEL)
    assert not out.expressible and any("middle" in n for n in out.notes)


def test_price_plan_reprices_a_search_result_and_rejects_bad_plans(inputs):
    result = search(MODEL, inputs, 8, 6 * GiB, global_batch_size=32, pp_degrees=[2])
    price = price_plan(inputs, result.strategies, result.partition, result.num_microbatches, 32)
    assert price.throughput == pytest.approx(result.throughput, rel=1e-12)
    assert price.stage_memory_bytes == pytest.approx(result.stage_memory_bytes, rel=1e-12)
    assert price.fits(6 * GiB)
    assert not price.fits(min(price.stage_memory_bytes) / 2)
    with pytest.raises(PlanningError, match="does not describe"):
        price_plan(inputs, result.strategies[:-1], result.partition, 4, 32)
    with pytest.raises(PlanningError, match="do not split"):
        price_plan(inputs, result.strategies, result.partition, 5, 32)


def test_even_partition_option_splits_layers_evenly(inputs):
    result = search(MODEL, inputs, 8, 6 * GiB, global_batch_size=32, pp_degrees=[4],
                    even_partition=True)  # fmt: skip
    assert result.partition == [6, 6, 6, 6]
    free = search(MODEL, inputs, 8, 6 * GiB, global_batch_size=32, pp_degrees=[4])
    assert free.throughput >= result.throughput


def test_bi_objective_reaches_plans_the_memory_balanced_start_misses():
    """The llama-7b / 64-GPU case of issue #5 at small scale: one GPU per stage, so the only
    choice per layer is CKPT. The memory-balanced start [3, 4, 6, 11] leaves the last stage
    twice as slow as the even split, and moving a layer off it with every layer's strategy
    frozen overflows the receiving stage; with the receiving stage's layer DP re-solved it
    checkpoints instead, and the search ends at least as fast as the even split."""
    model = MODEL_PRESETS["gpt-350m"]
    inputs = analytic_cost_inputs(model, GPU, 4, seq_length=2048)
    budget = 5 * GiB
    kw = dict(global_batch_size=16, pp_degrees=[4], num_microbatches=16)
    base = search(model, inputs, 4, budget, bi_objective=False, **kw)
    even = search(model, inputs, 4, budget, even_partition=True, **kw)
    assert base.partition == [3, 4, 6, 11]
    assert even.throughput > 1.5 * base.throughput
    frozen = price_plan(inputs, base.strategies, [3, 4, 7, 10], 16, 16)
    assert not frozen.fits(budget)  # the frozen-strategy check rejects the first move
    bmw = search(model, inputs, 4, budget, **kw)
    assert bmw.throughput >= even.throughput
    assert max(bmw.stage_memory_bytes) <= budget
    # Algorithm 2 from the memory-balanced start alone already gets past that first move.
    ps = _pipeline_searches(inputs, 4, budget, 256, [4], None, None, True)[0]
    start, balanced = ps.opening(1, 16, even=False, bmw=False)
    assert balanced
    adjusted, _ = ps.adjust([start], 1, 16, 48)
    assert adjusted.partition[-1] < 11 and adjusted.time < start.time


def test_balance_partitions_bracket_memory_and_time():
    """p_m and p_t of an encoder-decoder (T5-512/4: 4-token decoder layers are light): p_m
    has the lower peak stage memory, p_t the lower slowest stage, each against the other and
    against the even split, when both are priced by the estimator."""
    model = MODEL_PRESETS["t5-large-32"]
    inputs = analytic_cost_inputs(model, GPU, 4, seq_length=512, tgt_seq_length=4)
    pure_pp = [s for s in strategy_space(4)[4] if not s.ckpt]
    p_m, p_t = balance_partitions(inputs, pure_pp, 64, 8)
    layers = len(model.layer_kinds())
    assert sum(p_m) == sum(p_t) == layers and len(p_m) == len(p_t) == 4

    def priced(partition):
        return price_plan(inputs, pure_pp * layers, partition, 8, 64)

    even = [layers // 4] * 4
    assert max(priced(p_m).stage_memory_bytes) < max(priced(p_t).stage_memory_bytes)
    assert max(priced(p_m).stage_memory_bytes) < max(priced(even).stage_memory_bytes)
    assert max(priced(p_t).stage_time_s) < max(priced(p_m).stage_time_s)
    assert max(priced(p_t).stage_time_s) <= max(priced(even).stage_time_s)
    with pytest.raises(PlanningError, match="3 micro-batches do not split a global batch of 64"):
        balance_partitions(inputs, pure_pp, 64, 3)
