"""Run one hetu-galvatron 2.4.0 search inside the throwaway environment; print JSON.

This file is executed by the throwaway venv's interpreter (`env.py` builds it), never imported
by our package: it needs only the standard library and the installed `galvatron` package.

Usage: `python runner.py JOBS.json` where each job names the profile directory written by
`profiles.py` and the search settings; the results (chosen plan, predicted throughput, timings)
are printed as one JSON object on the last line of stdout. Everything Galvatron prints while it
searches goes to `<work_dir>/galvatron_stdout.log` instead, so the JSON line stays parseable.

GPU-only modules. `from galvatron.core import GalvatronSearchEngine` (the entry point the
package's own `search_dist.py` scripts use) imports the training runtime too, which imports
NVIDIA Apex's fused kernels (`apex`, `amp_C`). Those are CUDA builds with no CPU wheel, and the
search never calls them, so `_install_gpu_only_stubs` registers placeholder modules for them:
any attribute is a class that raises if it is ever instantiated or called. Galvatron stubs
`transformer_engine` itself; flash-attn is imported under try/except and left absent. Torch is
the real CPU build: the runtime subclasses `torch.nn.Module` and decorates with `torch.jit` at
import time, which a stub cannot honour faithfully.

Pricing given plans. `job["evaluate"]` may list plans (PP degree, partition, micro-batch count,
per layer `[tp, sdp, tp_consecutive, ckpt]`); each is priced with Galvatron's own cost model the
way its search prices a candidate (`pipeline_costmodel` on the per-layer `TimeCostModel`s,
per-stage `MemoryCostModel` sums against its budget), so another engine's plan can be compared
with Galvatron's choice on Galvatron's terms. Galvatron's chosen plan is priced the same way as
a self-check.

Search space. The search runs with Galvatron's own defaults except the settings `_search_args`
lists: in particular vocabulary TP stays on (`disable_vtp=0`), so it searches every layer TP
range [lo, hi] of 1, 2, 4, 8 (each layer's TP in it, the vocabulary TP degree one of lo..hi),
every chunk count dividing the batch and the embedding with and without SDP: its full space
for one global batch (with `disable_vtp=1` only [1, 1] is left: no TP > 1 strategy at all).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import json
import math
import os
import re
import sys
import time
import types

# Top-level modules that exist only as CUDA builds and are imported, not used, by the search.
GPU_ONLY_MODULES = ("apex", "amp_C")


class _GpuOnlyPlaceholder:
    """Stands for any class or function of a stubbed GPU-only module."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a GPU-only module stubbed by the search benchmark was used")


class _GpuOnlyModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _GpuOnlyPlaceholder


class _GpuOnlyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of `GPU_ONLY_MODULES` and their submodules with `_GpuOnlyModule`s."""

    def find_spec(self, fullname: str, path: object, target: object = None):
        if fullname.split(".")[0] in GPU_ONLY_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _GpuOnlyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _install_gpu_only_stubs() -> None:
    sys.meta_path.insert(0, _GpuOnlyFinder())


def _search_args(job: dict, work_dir: str):
    """The engine's own argument namespace (its argparse defaults), then the job's settings."""
    from galvatron.core.search_engine.arguments import galvatron_search_args

    parser = galvatron_search_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    settings = {
        "num_nodes": job["num_nodes"],
        "num_gpus_per_node": job["gpus_per_node"],
        "memory_constraint": job["memory_gb"],
        "settle_bsz": job["global_batch"],
        "max_tp_deg": job["max_tp"],
        "max_pp_deg": job["max_pp"],
        "mixed_precision": job.get("mixed_precision", "bf16"),
        "pipeline_type": job.get("pipeline_type", "pipedream_flush"),
        "default_dp_type": "ddp",
        "sp_space": "tp",
        # Galvatron's default: every layer TP range [lo, hi] of powers of two, the vocabulary
        # TP degree in it (`disable_vtp=1` leaves only [1, 1]: no TP > 1 strategy at all).
        "disable_vtp": 0,
        "time_profile_mode": "static",
        "memory_profile_mode": "static",
        "memory_profiling_path": job["profile_dir"],
        "time_profiling_path": job["profile_dir"],
        "allreduce_bandwidth_config_path": job["profile_dir"],
        "p2p_bandwidth_config_path": job["profile_dir"],
        "overlap_coe_path": job["profile_dir"],
        "sp_time_path": job["profile_dir"],
        "output_config_path": work_dir,
        "log_dir": os.path.join(work_dir, "logs"),
    }
    settings.update(job.get("extra_args", {}))
    for key, value in settings.items():
        if not hasattr(args, key):
            raise SystemExit(f"galvatron 2.4.0 has no search argument {key!r}")
        setattr(args, key, value)
    # Read from the namespace by the engine although the model's argparse group defines them.
    args.hidden_size = job["hidden_size"]
    return args


def _read_plan(work_dir: str) -> dict | None:
    configs = [f for f in os.listdir(work_dir) if f.startswith("galvatron_config_")]
    if not configs:
        return None
    with open(os.path.join(work_dir, configs[0])) as f:
        return json.load(f)


def _galvatron_strategy(pp: int, group: int, tp: int, sdp: int, consec: int, ckpt: int) -> list:
    """Galvatron's `[pp, tp, dp, info]` strategy list for one layer, with the info keys its
    strategy generator uses: `fsdp` when there is data parallelism, `tp` (TP consecutive)
    only when TP and data parallelism share the stage, `cpt` for checkpointed layers."""
    dp = group // tp
    info: dict[str, int] = {}
    if 1 < tp < group:
        info = {"tp": int(consec), "fsdp": int(sdp)}
    elif dp > 1:
        info = {"fsdp": int(sdp)}
    if ckpt:
        info["cpt"] = 1
    return [pp, tp, dp, info]


def _chosen_tp_range(log_path: str) -> list[int] | None:
    """The layer TP range Galvatron's search chose: its config file does not record it (only
    the vocabulary TP degree), its final report line `Min_tp=<lo> Max_tp=<hi>` does."""
    with open(log_path) as f:
        found = re.findall(r"^Min_tp=(\d+) Max_tp=(\d+)", f.read(), flags=re.MULTILINE)
    return [int(x) for x in found[-1]] if found else None


def _plan_from_config(config: dict, tp_range: list[int] | None) -> dict:
    def ints(key: str) -> list[int]:
        return [int(x) for x in str(config[key]).split(",")]

    layers = zip(
        ints("tp_sizes_enc"),
        ints("dp_types_enc"),
        ints("tp_consecutive_flags"),
        ints("checkpoint"),
        strict=True,
    )
    return {
        "pp": int(config["pp_deg"]),
        "partition": ints("pp_division"),
        "chunks": int(config["chunks"]),
        "layers": [list(layer) for layer in layers],
        "tp_range": tp_range,
        "embed_sdp": int(config.get("embed_sdp", 0)),
    }


def _price_plan(engine, args, plan: dict) -> dict:
    """Galvatron's predicted throughput and per-stage memory of `plan` (PP, chunks, per-layer
    strategies), as its search prices it. Its search runs once per TP range [lo, hi] (every
    layer's TP in it, the vocabulary TP degree v one of lo, 2 lo, ..., hi): `plan["tp_range"]`
    when given (Galvatron's own plan: the range its search chose), else every range holding
    the plan's layer TPs. The fastest (range, v) that fits is taken, as its search takes it;
    `tp_range` and `vocab_tp` say which (`fits` is false when none fits)."""
    if plan.get("tp_range"):
        ranges = [tuple(plan["tp_range"])]
    else:
        tps = [layer[0] for layer in plan["layers"]]
        degrees = [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= args.max_tp_deg]
        group, chunk = args.gpu_num // plan["pp"], plan["chunks"]

        def runs(lo: int) -> bool:  # the search's own rule: `chunk` must be the real count
            per_group = args.settle_bsz // (group // lo)
            return chunk <= per_group and -(-per_group // -(-per_group // chunk)) == chunk

        ranges = [
            (lo, hi)
            for lo in degrees
            for hi in degrees
            if lo <= min(tps) and hi >= max(tps) and runs(lo)
        ]
    priced = [p for lo, hi in ranges for p in _price_in_range(engine, args, plan, lo, hi)]
    over, cost, tp_range, vocab_tp, stage_mib = min(priced)
    return {
        "throughput": args.settle_bsz / cost,
        "stage_memory_mib": stage_mib,
        "fits": not over,
        "tp_range": list(tp_range),
        "vocab_tp": vocab_tp,
    }


def _price_in_range(engine, args, plan: dict, min_tp: int, max_tp: int) -> list[tuple]:
    """(over the budget, time, (min_tp, max_tp), vocabulary TP, per-stage MiB) of `plan` for
    each vocabulary TP degree of the search over layer TPs in [min_tp, max_tp]."""
    from galvatron.core.search_engine.cost_model import (
        MemoryCostModel,
        OtherTimeCostModel,
        TimeCostModel,
        pipeline_costmodel,
    )

    world, pp, batch, chunk = args.gpu_num, plan["pp"], args.settle_bsz, plan["chunks"]
    group = world // pp
    embed_sdp = plan.get("embed_sdp", 0)
    strategies = [_galvatron_strategy(pp, group, *layer) for layer in plan["layers"]]
    # The micro-batch size and chunk count exactly as the search derives them for (bsz, chunk).
    mbsz = (batch // (world // pp // min_tp) + chunk - 1) // chunk
    chunks = [
        pa.optimal_chunk_func(batch * min_tp // group, [pp, min_tp, group], mbsz, min_tp)
        for pa in engine.parallel_args_list
    ]
    lists = (
        engine.model_args_list,
        engine.train_args_list,
        engine.parallel_args_list,
        engine.profile_model_args_list,
        engine.profile_hardware_args_list,
    )
    first = {
        "model_args": lists[0][0],
        "train_args": lists[1][0],
        "parallel_args": lists[2][0],
        "profile_model_args": lists[3][0],
    }
    other_time = OtherTimeCostModel(
        mbsz, pp, world, 0, embed_sdp, min_tp, max_tp, engine.seqlen_list,
        profile_hardware_args=lists[4][0], **first,
    ).gen_result()  # fmt: skip
    limit = engine.memory_constraint
    if limit // 1024 > 20:
        limit -= int(limit * 0.2)  # the search's allocator-cache reserve
    layer_mib, other_mib, start = [], [], 0
    for stage, count in enumerate(plan["partition"]):
        layer_mib.append(0)
        for i, s in enumerate(strategies[start : start + count]):
            mem = MemoryCostModel(
                s, batch, mbsz=mbsz, min_tp=min_tp, max_tp=max_tp, stage_idx=stage,
                embed_sdp=embed_sdp, **first,
            ).get_memory_cost()  # fmt: skip
            layer_mib[-1] += math.ceil(mem["enc_total"])
            if i == 0:
                other_mib.append(mem["other"])
        start += count
    priced = []
    for vocab_tp, other in other_time[1].items():
        cost = pipeline_costmodel(
            TimeCostModel, engine.layernum_list, *lists, strategies, plan["partition"], chunks,
            batch, min_tp, other,
        )  # fmt: skip
        stage_mib = [
            total + math.ceil(extra[vocab_tp][stage])
            for stage, (total, extra) in enumerate(zip(layer_mib, other_mib, strict=True))
        ]
        priced.append((max(stage_mib) > limit, cost, (min_tp, max_tp), vocab_tp, stage_mib))
    return priced


def _run_job(engine_class: type, job: dict) -> dict:
    """One search (and the pricing of `job["evaluate"]`); Galvatron's prints go to a log file."""
    work_dir = job["work_dir"]
    os.makedirs(work_dir, exist_ok=True)
    args = _search_args(job, work_dir)
    layer = {"hidden_size": job["hidden_size"], "layer_num": job["num_layers"]}
    layer_configs = [{**layer, "seq_len": job["seq_len"]}]
    log_path = os.path.join(work_dir, "galvatron_stdout.log")
    with (
        open(log_path, "w") as log,
        contextlib.redirect_stdout(log),
    ):
        start, cpu_start = time.perf_counter(), time.process_time()
        engine = engine_class(args)
        engine.set_search_engine_info(job["profile_dir"], layer_configs, job["model_name"])
        engine.set_model_type("gpt")
        engine.initialize_search_engine()
        init_s = time.perf_counter() - start
        start_opt = time.perf_counter()
        throughput = engine.parallelism_optimization()
        optimize_s = time.perf_counter() - start_opt
        cpu_s = time.process_time() - cpu_start
    plan = _read_plan(work_dir)
    own = _plan_from_config(plan, _chosen_tp_range(log_path)) if plan else None
    return {
        "throughput": float(throughput),
        "plan": plan,
        "search_s": init_s + optimize_s,
        "search_cpu_s": cpu_s,
        "init_s": init_s,
        "optimize_s": optimize_s,
        "num_strategies": len(engine.strategies),
        "priced": [_price_plan(engine, args, p) for p in job.get("evaluate", [])],
        "self_check": _price_plan(engine, args, own) if own else None,
    }


def main() -> None:
    """`runner.py JOBS.json`: a job object or `{"jobs": [...]}`, run one after another in this
    process, so the interpreter start and imports are paid once."""
    start_total = time.perf_counter()
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    jobs = spec.get("jobs", [spec])
    start_import = time.perf_counter()
    _install_gpu_only_stubs()
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        from galvatron.core import GalvatronSearchEngine
    import_s = time.perf_counter() - start_import
    results = [_run_job(GalvatronSearchEngine, job) for job in jobs]
    summary = {
        "results": results,
        "import_s": import_s,
        "total_s": time.perf_counter() - start_total,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
