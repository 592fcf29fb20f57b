"""The cost profiler: measured memory means what the table says it means, and its tables are what
the planner reads.

A tiny GPT is profiled on a 2x2 grid in one forked gloo rank. The table loads through
`ProfiledCostModel` and plans; a point left out (null) is infeasible; the activation bytes of
each component equal the tensors its forward saved for backward plus its output (counted with
`saved_tensors_hooks`, a second instrument). No timing is asserted.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402

from dynapipe_planner.cluster import ClusterSpec, get_gpu  # noqa: E402
from dynapipe_planner.cost import ProfiledCostModel  # noqa: E402
from dynapipe_planner.model_spec import ModelSpec  # noqa: E402
from dynapipe_planner.planner import IterationPlanner, PlannerConfig  # noqa: E402
from megatron.dynapipe.profile_grid import default_seqlens, local_grid  # noqa: E402

SPEC = ModelSpec("tiny", "gpt", 4, 32, 4, 128, 384, max_position_embeddings=64)
GRID = ((1, 2), (32, 64))


def _in_one_rank(fn):
    """Run `fn()` with megatron's parallel state for a single CPU rank."""

    def body(rank: int, world: int):
        from megatron.dynapipe import cpu_compat
        from megatron.dynapipe import parallel_state as ps

        cpu_compat.install()
        ps.initialize(1, 1, 1)
        try:
            return fn()
        finally:
            ps.destroy()

    return run_ranks(body, 1, timeout_s=180)[0]


def _args(*flags: str):
    from megatron.dynapipe.model_flags import spec_args

    return spec_args(SPEC, 64, *flags)


def _profile(max_tokens: int, *flags: str) -> dict:
    from megatron.dynapipe.cost_profiler import ProfileGrid, profile_cost_table

    grid = ProfileGrid(*GRID, max_tokens=max_tokens)
    return profile_cost_table(
        _args(*flags), SPEC.vocab_size, grid, ("none",), torch.device("cpu"), warmup=0, repeats=1
    )


@pytest.fixture(scope="module")
def table_path(tmp_path_factory) -> Path:
    # b * s > 64 is skipped: the (2, 64) point is null.
    path = tmp_path_factory.mktemp("profile") / "costs.json"
    path.write_text(json.dumps(_in_one_rank(lambda: _profile(max_tokens=64))))
    return path


def _cluster(num_stages: int) -> ClusterSpec:
    return ClusterSpec(
        get_gpu("A100-80GB"), num_stages=num_stages, num_replicas=1, tp=1, memory_limit_bytes=2**30
    )


def test_profiled_table_loads_and_plans(table_path: Path) -> None:
    table = json.loads(table_path.read_text())
    assert {e["component"] for e in table["entries"]} == {"embedding", "decoder_layer", "lm_head"}
    # measured on a CPU: the cores it ran on and its passes' CPU share (the search's bound)
    assert table["host_cores"] == len(os.sched_getaffinity(0))
    assert set(table["cpu_busy_fraction"]) == {"1"} and table["cpu_busy_fraction"]["1"] > 0
    model = ProfiledCostModel.load(table_path, SPEC, _cluster(2))
    costs = model.pipeline_costs("none")
    statics = {e["component"]: e["static_bytes"] for e in table["entries"]}
    assert costs.static.tolist() == [
        statics["embedding"] + 2 * statics["decoder_layer"],
        statics["lm_head"] + 2 * statics["decoder_layer"],
    ]
    planner = IterationPlanner(model, 2, PlannerConfig(recompute="none", dtype="fp32"))
    plan = planner.plan(np.array([60, 12, 30, 64, 7, 41]))
    assert sorted(s for mb in plan.microbatches for s in mb.samples) == list(range(6))
    assert all(0 < p < 2**30 for p in plan.stats["peak_memory_bytes"])
    assert plan.stats["predicted_iteration_s"] > 0


def _runtime_overhead(table: dict, scale: float) -> dict[str, float]:
    """`runtime_overhead_s` against `table` with its times scaled by `scale`."""
    from megatron.dynapipe.cost_profiler import runtime_overhead_s

    edited = copy.deepcopy(table)
    for entry in edited["entries"]:
        for name in ("forward_s", "backward_s"):
            entry[name] = [[None if v is None else v * scale for v in row] for row in entry[name]]
    return _in_one_rank(
        lambda: runtime_overhead_s(
            _args(), SPEC.vocab_size, torch.device("cpu"), edited, warmup=1, repeats=3
        )
    )


def test_runtime_overhead_is_the_whole_step_less_the_priced_layer_and_head(table_path) -> None:
    table = json.loads(table_path.read_text())
    whole = _runtime_overhead(table, 0.0)  # nothing priced: the whole one-sample step
    assert set(whole) == {"32", "64"} and min(whole.values()) > 0
    # priced above what the step takes: kept at 0, not negative
    assert _runtime_overhead(table, 1e6) == {"32": 0.0, "64": 0.0}


def test_cpu_busy_fraction_is_cpu_seconds_over_wall_seconds() -> None:
    from megatron.dynapipe.cost_profiler import PointCost, cpu_busy_fraction

    passes = [PointCost(0.1, 0.3, 0, 0, cpu_s=0.2), PointCost(0.2, 0.4, 0, 0, cpu_s=0.6)]
    assert cpu_busy_fraction(passes) == pytest.approx(0.8)


def test_null_point_is_infeasible(table_path: Path) -> None:
    table = json.loads(table_path.read_text())
    for entry in table["entries"]:
        assert entry["forward_s"][1][1] is None and entry["activation_bytes"][1][1] is None
        assert entry["forward_s"][0][1] is not None
    costs = ProfiledCostModel.load(table_path, SPEC, _cluster(2)).pipeline_costs("none")
    assert not costs.stage_costs(2, 64).feasible
    assert costs.stage_costs(1, 64).feasible


def _activation_against_saved_tensors() -> list[tuple[str, int, int, int]]:
    """(component, measured activation bytes, saved-for-backward bytes + output bytes, slack)."""
    from megatron.dynapipe.cost_profiler import _components, measure_point

    device = torch.device("cpu")
    args = _args("--hidden-dropout", "0.1")
    components, built = _components(args, SPEC.vocab_size, device, "none")
    params = {p.untyped_storage().data_ptr() for b in built for p in b.model.parameters()}
    # megatron's RNG tracker swaps in a new generator state at each dropout fork; the one it
    # replaces predates the trace, so its free is not seen (memory.py): one state of slack.
    slack = torch.get_rng_state().nbytes
    rows = []
    for component in components:
        measured = measure_point(component, 2, 32, device, warmup=1, repeats=1).activation_bytes
        args, _grad = component.make_inputs(2, 32)
        inputs = [  # a THD decoder's inputs include its sample boundaries
            t
            for a in args
            for t in ([a] if torch.is_tensor(a) else [a.cu_seqlens_q, a.cu_seqlens_kv])
        ]
        skip = params | {t.untyped_storage().data_ptr() for t in inputs}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, skip=skip, saved=saved) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = component.forward(*args)
        saved.setdefault(out.untyped_storage().data_ptr(), out.untyped_storage().nbytes())
        rows.append((component.name, measured, sum(saved.values()), slack))
    return rows


def test_activation_bytes_are_saved_tensors_plus_output() -> None:
    for name, measured, saved, slack in _in_one_rank(_activation_against_saved_tensors):
        assert saved <= measured <= saved + slack, (name, measured, saved)


def test_cpu_contention_factor_times_a_layer_as_the_first_of_forked_pipeline_stages() -> None:
    import multiprocessing

    from megatron.dynapipe.cost_profiler import cpu_contention_factor

    def factor() -> tuple[float, int]:
        ratio = cpu_contention_factor(
            _args(), SPEC.vocab_size, torch.device("cpu"), 3, 2, 64, rounds=1
        )
        return ratio, len(multiprocessing.active_children())

    ratio, left = _in_one_rank(factor)
    # CPU seconds of the same passes, as stage 0 of 3 and alone: of one order (a stage that
    # missed its hand-offs would have hung), the forked stages all gone
    assert 0.5 < ratio < 4.0 and left == 0


def test_memory_trace_replays_allocations() -> None:
    from megatron.dynapipe.memory import MemoryTrace, live_tensor_bytes

    cpu = torch.device("cpu")
    before = live_tensor_bytes(cpu)
    kept = torch.empty(1000, dtype=torch.float32)
    view = kept[10:20]
    assert live_tensor_bytes(cpu) - before == 4000  # a view is not counted twice
    with MemoryTrace(cpu) as trace:
        with trace.phase("first"):
            a = torch.empty(2000, dtype=torch.float32)
            b = torch.empty(3000, dtype=torch.float32)
            del b
        with trace.phase("second"):
            del a
            c = torch.empty(500, dtype=torch.float32)
    assert trace.phases["first"].peak == 20000 and trace.phases["first"].end == 8000
    assert trace.phases["second"].peak == 8000 and trace.phases["second"].end == 2000
    del kept, view, c


def _collective_blocks_freed_elsewhere(rank: int, world: int) -> tuple[int, int]:
    """Ten 1 MiB all-reduces whose tensors the last reference leaves on another thread (as
    gloo's worker releases a collective's tensors when the caller has dropped them)."""
    import threading

    import torch.distributed as dist

    from megatron.dynapipe.memory import MemoryTrace

    cpu = torch.device("cpu")
    with MemoryTrace(cpu) as trace, trace.phase("region"):
        for _ in range(10):
            block = [torch.ones(2**18)]  # 1 MiB
            dist.all_reduce(block[0])
            dropper = threading.Thread(target=block.clear)  # the free happens there
            dropper.start()
            dropper.join()
    return trace.phases["region"].peak, trace.phases["region"].end


def test_memory_trace_counts_frees_of_collective_blocks_on_other_threads() -> None:
    for peak, end in run_ranks(_collective_blocks_freed_elsewhere, 2):
        assert peak == 2**20 and end == 0, (peak, end)  # 10 MiB and 10 MiB without the repair


def _reduce_scatters(rank: int, world: int) -> tuple[int, int, int]:
    """Ten reduce-scatters of about 1 MiB (as FSDP2's backward makes), each a little larger
    than the last so that no block's address is reused: gloo copies the input for its worker
    inside the op and the worker frees the copy."""
    import torch.distributed as dist

    from megatron.dynapipe.memory import MemoryTrace

    cpu = torch.device("cpu")
    with MemoryTrace(cpu) as trace, trace.phase("region"):
        for i in range(10):
            unsharded = torch.ones(2**18 + 1024 * i)
            shard = torch.empty(unsharded.numel() // world)
            dist.reduce_scatter_tensor(shard, unsharded)
            largest = unsharded.nbytes
            del unsharded, shard
    return trace.phases["region"].peak, trace.phases["region"].end, largest


def test_memory_trace_frees_the_buffers_a_collective_allocates() -> None:
    for peak, end, largest in run_ranks(_reduce_scatters, 2):
        # one reduce-scatter's tensors and gloo's copy at a time (measured without the repair:
        # 1-2 MiB of copies left at the end, peak 3.5 x the input)
        assert peak <= 3 * largest and end == 0, (peak, end, largest)


def _fsdp2_overhead(rank: int, world: int) -> tuple[float, float]:
    from megatron.dynapipe.cost_profiler import sdp_layer_overhead_s

    return sdp_layer_overhead_s([(256, 64), (256,), (64, 256)], torch.device("cpu"))


def test_sdp_layer_overhead_is_what_fsdp2_adds_to_each_pass() -> None:
    # sharded, the forward waits for an all-gather and the backward for a second one and a
    # reduce-scatter; replicated, neither does anything but the (negligible) arithmetic. Which
    # pass adds more is a race on 2 loaded cores (a CI run saw 4.1 ms forward, 3.4 backward).
    for added in run_ranks(_fsdp2_overhead, 2):
        assert 0 < added.forward_s < 1.0 and 0 < added.backward_s < 1.0
        assert 0 <= added.cpu_busy_fraction <= 1.0
        # at its peak FSDP2 holds at least the gathered weights (fp32) beside the shard
        assert added.transient_bytes >= 4 * (256 * 64 + 256 + 64 * 256)


def _tool():
    spec = importlib.util.spec_from_file_location("profile_costs", ROOT / "tools/profile_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--seqlens", "64,512"], "--seqlens"),
        (["--microbatch-sizes", "2,4"], "--microbatch-sizes"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--hidden-size", "30"], "--num-attention-heads"),
        (["--cpu-contention-ranks", "-1"], "--cpu-contention-ranks"),
        (["--sequence-parallel"], "--sequence-parallel"),  # DynaPipe's tools refuse it always
    ],
)
def test_tool_names_the_offending_flag(extra, flag, capsys, tmp_path) -> None:
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"]
    base += ["--seq-length", "256"]
    with pytest.raises(SystemExit):
        _tool().parse_args([*base, *extra, "--output", str(tmp_path / "t.json")])
    assert flag in capsys.readouterr().err


def test_tool_default_grid() -> None:
    assert default_seqlens(256) == [32, 48, 64, 96, 128, 192, 256]
    # a job's local profile: sizes while 32-token samples fill at most the cap, lengths to 256
    assert local_grid(256, 512) == ([1, 2, 4, 8, 16], default_seqlens(256), 512)
    assert local_grid(1024, 10**6)[0] == [1, 2, 4, 8, 16, 32, 64]
    # the cap is at least one sample of --seq-length
    assert local_grid(1024, 100) == ([1, 2, 4, 8, 16, 32], default_seqlens(1024), 1024)


def test_a_tp2_table_from_two_ranks_feeds_the_search(table_path: Path) -> None:
    """Two TP ranks profile their shards: every entry says TP 2, the decoder layer's model
    states are about half of TP 1's (its GEMMs split, norms and some biases replicated), and the
    measured all-reduce bandwidth with both tables prices a search of 2 ranks."""
    from dynapipe_planner.search import profiled_cost_inputs, read_cost_tables

    def body(rank: int, world: int):
        from megatron.dynapipe import cpu_compat
        from megatron.dynapipe import parallel_state as ps
        from megatron.dynapipe.cost_profiler import allreduce_bus_bandwidth

        cpu_compat.install()
        ps.initialize(2, 1, 1)
        try:
            torch.manual_seed(0)
            table = _profile(64, "--tensor-model-parallel-size", "2")
            table["allreduce_bus_bandwidth"] = {"2": allreduce_bus_bandwidth(torch.device("cpu"))}
            return table
        finally:
            ps.destroy()

    tp2 = run_ranks(body, 2, timeout_s=180)[0]
    tp1 = json.loads(table_path.read_text())
    assert {e["tp"] for e in tp2["entries"]} == {2}

    def layer_static(table: dict) -> int:
        layer = [e for e in table["entries"] if e["component"] == "decoder_layer"]
        return layer[0]["static_bytes"]

    assert 0.45 < layer_static(tp2) / layer_static(tp1) < 0.6
    bandwidth = tp2["allreduce_bus_bandwidth"]["2"]
    assert 0 < bandwidth < float("inf")
    path = table_path.parent / "costs_tp2.json"
    path.write_text(json.dumps(tp2))
    inputs = profiled_cost_inputs(SPEC, read_cost_tables([table_path, path]), 2, seq_length=32)
    assert set(inputs.layer_types[0].forward_s_per_sample) == {1, 2}
    assert inputs.allreduce_bandwidth[2, 1] == bandwidth
