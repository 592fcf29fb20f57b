"""The cost table of this machine's device for DynaPipe's planner: profiled on first use, kept on
disk, reused by later runs (plans priced with the costs of the device that runs them).

DynaPipe prices micro-batches from per-layer forward and backward times profiled offline over
micro-batch sizes and sequence lengths (seed `dynapipe.txt` §3 "Cost models"). A model of
another device prices the wrong trade-offs: on the CPU a larger micro-batch is no cheaper per
token, and attention's share of a layer differs 2-3x from an A100's. So `--dynapipe-cost-model
local` (the default) profiles the job's model on this device with
`cost_profiler.profile_cost_table`: the path the runtime runs (THD sequences, per-sample
attention), one layer at TP 1 in a process of its own (the job's parallel state is untouched),
passes timed in CPU seconds on the CPU (what a rank with its own core spends, whatever else
runs) and in synchronised wall time on a GPU. The table is written atomically under
`$DYNAPIPE_CACHE_DIR` (default `~/.cache/megatron-dynapipe`), named by a hash of what it
depends on: the device, the model's shape, dropout and dtype, a rank's threads, the grid, the
recomputation profiled and the versions of torch, megatron-core and this package. It is plain
JSON (`dynapipe_planner.cost.profiled`'s format), which `dynapipe-plan` reads too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from dynapipe_planner.megatron_model import spec_from_args
from dynapipe_planner.plan import atomic_write

from .job_config import JobConfig
from .profile_grid import local_grid
from .world_of_one import WORLD_OF_ONE

CACHE_ENV = "DYNAPIPE_CACHE_DIR"
# Flags beyond the model's shape that change what a layer's passes cost.
_COST_FLAGS = ("attention_dropout", "hidden_dropout", "bf16", "fp16", "transformer_impl")


class CostTableError(RuntimeError):
    """This machine's cost table could not be profiled or kept."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatron-dynapipe")


def profile_description(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """Everything the local table depends on (its cache key is a hash of this)."""
    per_microbatch = (
        args.tokens_per_global_batch
        if args.tokens_per_global_batch is not None
        else args.global_batch_size * args.seq_length
    )
    sizes, seqlens, cap = local_grid(args.seq_length, min(per_microbatch, 16 * args.seq_length))
    recompute = JobConfig.of(args).recompute
    mode = recompute if recompute != "auto" else "none"
    return {
        "device": _device_name(),
        "threads": torch.get_num_threads(),
        "model": spec_from_args(args, vocab_size, "local").to_dict(),
        "flags": {name: getattr(args, name, None) for name in _COST_FLAGS},
        "grid": {"microbatch_sizes": sizes, "seqlens": seqlens, "max_tokens": cap},
        "recompute": [mode],
        "versions": _versions(),
    }


def local_cost_table(
    args: argparse.Namespace, vocab_size: int, say: Callable[[str], None] = print
) -> Path:
    """The path of this machine's cost table for the job `args` describes, profiled now (in a
    child process, one line before and after on `say`) when no earlier run kept it."""
    description = profile_description(args, vocab_size)
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    path = cache_dir() / f"cost-table-{digest[:20]}.json"
    if path.is_file():
        return path
    if path.exists() or path.is_symlink():
        raise CostTableError(f"cost table cache {path} exists but is not a regular file")
    grid = description["grid"]
    say(
        f"profiling this machine's costs for the planner ({description['device']}; "
        f"{len(grid['microbatch_sizes'])} x {len(grid['seqlens'])} shapes, first use only), "
        f"kept in {path}"
    )
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    child = context.Process(
        target=_profile_in_child,
        args=(vars(args), vocab_size, description, str(path)),
        name="dynapipe-cost-profile",
    )
    # The memory trace runs torch's profiler, whose kineto logs two lines a point on stderr.
    quiet = {"KINETO_LOG_LEVEL": "6"} if "KINETO_LOG_LEVEL" not in os.environ else {}
    os.environ.update(quiet)
    try:
        child.start()
    finally:
        for name in quiet:
            del os.environ[name]
    child.join()
    if child.exitcode != 0 or not path.is_file():
        raise CostTableError(
            f"profiling this machine's costs failed (exit status {child.exitcode}); profile "
            "them with tools/profile_costs.py and give --dynapipe-cost-model, or plan with "
            "--dynapipe-cost-model analytic"
        )
    say(f"profiled in {time.perf_counter() - started:,.0f} s: {path}")
    return path


def _profile_in_child(
    flags: dict[str, Any], vocab_size: int, description: dict[str, Any], output: str
) -> None:
    """One process, one rank, TP 1: the job's model measured as `profile_cost_table` measures
    it, written to `output` with the description it was made for."""
    from . import cpu_compat
    from . import parallel_state as ps
    from .cost_profiler import ProfileGrid, profile_cost_table

    args = argparse.Namespace(**flags)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    torch.set_num_threads(description["threads"])
    os.environ.update(WORLD_OF_ONE)  # a world of its own, beside the job's
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # torchrun's store is the job's
    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        sizes, seqlens, cap = (
            description["grid"][k] for k in ("microbatch_sizes", "seqlens", "max_tokens")
        )
        device = ps.device()
        table = profile_cost_table(
            args,
            vocab_size,
            ProfileGrid(tuple(sizes), tuple(seqlens), cap),
            tuple(description["recompute"]),
            device,
            clock="cpu",
        )
    finally:
        ps.destroy()
    table["local_profile"] = description
    atomic_write(Path(output), (json.dumps(table, indent=1) + "\n").encode())


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for package in ("megatron-core", "megatron-dynapipe"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return versions
