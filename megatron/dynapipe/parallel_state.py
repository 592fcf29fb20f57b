"""Process groups of a DynaPipe job; the one module that owns them.

Ranks follow Megatron's order, tensor-parallel fastest, then data-parallel (replica), then
pipeline (stage): `rank = tp_rank + tp * (replica + num_replicas * stage)`, the same layout as
`dynapipe_planner.cluster.ClusterSpec.rank`, so a plan's (replica, stage) names the rank that
runs it.

The layout is homogeneous here, so `initialize` lets megatron-core's own
`initialize_model_parallel` build the groups: that fills every global of
`megatron.core.parallel_state` on each rank and unmodified megatron-core modules (models, DDP,
optimiser, schedules) find their groups. Everything in megatron.dynapipe asks this module for
stage, replica and peer ranks instead of computing them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


@dataclass(frozen=True)
class _Layout:
    tp: int
    pp: int
    dp: int
    rank: int
    owns_world_group: bool

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def replica(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def stage(self) -> int:
        return self.rank // (self.tp * self.dp)

    def rank_of(self, replica: int, stage: int, tp_rank: int) -> int:
        return tp_rank + self.tp * (replica + self.dp * stage)


_layout: _Layout | None = None


def initialize(
    tp: int, pp: int, dp: int, *, backend: str | None = None, timeout_s: float = 600.0
) -> None:
    """Build the TP, PP and DP groups of a `dp` x `pp` x `tp` job and fill megatron's globals.

    If torch.distributed is not initialised yet, initialise it from the usual environment
    (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`) with `backend` (default: nccl when CUDA
    is available, else gloo); `destroy()` then tears it down again. Sub-groups use the world
    group's backend. Collectives of every group built here fail after `timeout_s` instead of
    waiting for a dead peer forever (a world group the caller made keeps the caller's timeout).
    """
    global _layout
    if _layout is not None:
        raise RuntimeError("megatron.dynapipe.parallel_state is already initialised")
    if min(tp, pp, dp) < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tp={tp} pp={pp} dp={dp}")
    owns_world_group = not dist.is_initialized()
    if owns_world_group:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # one GPU per process, as torchrun numbers them on each node
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            backend,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=timeout_s),
        )
    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ValueError(f"world size {world} != tp {tp} x pp {pp} x dp {dp}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        order="tp-cp-ep-dp-pp",  # tensor-parallel fastest, pipeline slowest: ClusterSpec.rank
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta inside: fractions hold
    )
    _layout = _Layout(tp, pp, dp, dist.get_rank(), owns_world_group)


def is_initialized() -> bool:
    """Whether `initialize` has run (and `destroy` has not)."""
    return _layout is not None


def _get() -> _Layout:
    if _layout is None:
        raise RuntimeError("megatron.dynapipe.parallel_state is not initialised")
    return _layout


def stage() -> int:
    """This rank's pipeline stage."""
    return _get().stage


def num_stages() -> int:
    """Pipeline depth."""
    return _get().pp


def replica() -> int:
    """This rank's data-parallel replica (pipeline index)."""
    return _get().replica


def num_replicas() -> int:
    """Number of data-parallel replicas."""
    return _get().dp


def tp_rank() -> int:
    """This rank's index in its tensor-parallel group."""
    return _get().tp_rank


def tp_size() -> int:
    """Tensor-parallel degree."""
    return _get().tp


def peer_rank(stage: int) -> int:
    """Global rank holding the same replica and tensor-parallel shard at pipeline `stage`."""
    layout = _get()
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage {stage} outside 0..{layout.pp - 1}")
    return layout.rank_of(layout.replica, stage, layout.tp_rank)


def destroy() -> None:
    """Destroy megatron's groups (and the world group if `initialize` created it)."""
    global _layout
    if _layout is None:
        return
    mpu.destroy_model_parallel()
    if _layout.owns_world_group and dist.is_initialized():
        dist.destroy_process_group()
    _layout = None
