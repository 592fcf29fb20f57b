"""Process groups of a DynaPipe job; the one module that owns them.

Ranks follow Megatron's order, tensor-parallel fastest, then data-parallel (replica), then
pipeline (stage): `rank = tp_rank + tp * (replica + num_replicas * stage)`, the same layout as
`dynapipe_planner.cluster.ClusterSpec.rank`, so a plan's (replica, stage) names the rank that
runs it.

For a homogeneous layout `initialize` lets megatron-core's own `initialize_model_parallel`
build the groups: that fills the globals of `megatron.core.parallel_state` on each rank and
unmodified megatron-core modules (models, DDP, optimiser, schedules) find their groups. For the
asymmetric layouts of a heterogeneous plan (pipelines of different depth, a TP degree per
stage; seed `hexiscale.txt` §3.2) `initialize_heterogeneous` builds them with `layout_groups`,
one `ProcessGroupCollection` per strategy for this rank, and leaves megatron-core's globals
alone: they describe one layout per process, and a switching job has several. Whatever
megatron-core builds for the current layout is handed `pg_collection()` explicitly.
Everything in megatron.dynapipe asks this module for stage, replica and peer ranks instead of
computing them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection

from dynapipe_planner.plan import ReplicaLayout

from .layout_groups import (
    HeteroGroups,
    HeteroTopology,
    LayoutMismatch,
    StagePlace,
)


@dataclass(frozen=True)
class _Layout:
    tp: int
    pp: int
    dp: int
    rank: int
    owns_world_group: bool
    layer_counts: tuple[int, ...] | None = None  # a searched plan's partition; None: even

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


@dataclass(frozen=True)
class _HeteroLayout:
    """An asymmetric job: this rank's place in the plan's layouts and the job's groups."""

    topology: HeteroTopology
    groups: HeteroGroups
    place: StagePlace
    owns_world_group: bool

    @property
    def tp(self) -> int:
        return self.place.tp

    @property
    def pp(self) -> int:
        return self.place.num_stages

    @property
    def dp(self) -> int:
        return len(self.topology.layouts)

    @property
    def tp_rank(self) -> int:
        return self.place.tp_rank

    @property
    def replica(self) -> int:
        return self.place.replica

    @property
    def stage(self) -> int:
        return self.place.stage


_layout: _Layout | _HeteroLayout | None = None


def _init_world(backend: str | None, timeout_s: float) -> bool:
    """Initialise torch.distributed from the environment unless the caller did; returns
    whether this module owns the world group."""
    if dist.is_initialized():
        return False
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
    return True


def initialize(
    tp: int,
    pp: int,
    dp: int,
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    layer_counts: list[int] | None = None,
) -> None:
    """Build the TP, PP and DP groups of a `dp` x `pp` x `tp` job and fill megatron's globals.

    `layer_counts` (transformer layers per stage, any split) replaces the planner's even split
    of the layers over the `pp` stages: a searched plan's pipeline partition.

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
    if layer_counts is not None and (len(layer_counts) != pp or min(layer_counts) < 1):
        raise ValueError(f"layers per stage {layer_counts}: need {pp} counts, each >= 1")
    owns_world_group = _init_world(backend, timeout_s)
    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ValueError(f"world size {world} != tp {tp} x pp {pp} x dp {dp}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        order="tp-cp-ep-dp-pp",  # tensor-parallel fastest, pipeline slowest: ClusterSpec.rank
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta inside: fractions hold
    )
    counts = tuple(layer_counts) if layer_counts is not None else None
    _layout = _Layout(tp, pp, dp, dist.get_rank(), owns_world_group, counts)


def adopt_megatron_groups() -> None:
    """Take the groups megatron.training's initialisation built (a Megatron-LM program's
    `pretrain`), instead of building them. Megatron's default rank order is this module's;
    another order (`--use-tp-pp-dp-mapping`) is refused, naming it."""
    global _layout
    if _layout is not None:
        raise RuntimeError("megatron.dynapipe.parallel_state is already initialised")
    if not mpu.model_parallel_is_initialized():
        raise RuntimeError("megatron.training has not built its groups yet")
    layout = _Layout(
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_data_parallel_world_size(),
        dist.get_rank(),
        owns_world_group=False,
    )
    megatron_place = (
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_data_parallel_rank(),
        mpu.get_pipeline_model_parallel_rank(),
    )
    if (layout.tp_rank, layout.replica, layout.stage) != megatron_place:
        raise ValueError(
            f"rank {layout.rank}: Megatron placed it at (tp, dp, pp) = {megatron_place}; "
            "DynaPipe's plans need Megatron's default rank order (drop --use-tp-pp-dp-mapping)"
        )
    _layout = layout


def initialize_heterogeneous(
    layouts: list[ReplicaLayout],
    *,
    tied_embeddings: bool = True,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Build the groups of the asymmetric job a heterogeneous plan's `layouts` describe
    (`layout_groups`); `pg_collection()` hands this rank's to megatron-core.

    The layouts are checked against the world size before any group exists: a mismatch raises
    `layout_groups.LayoutMismatch` naming the replica, stage or rank on every rank, so nothing
    hangs. `tied_embeddings` decides which stages share the word embeddings (gradient groups).
    torch.distributed is initialised as `initialize` does.
    """
    initialize_strategies(
        [layouts], tied_embeddings=tied_embeddings, backend=backend, timeout_s=timeout_s
    )


def initialize_strategies(
    strategies: list[list[ReplicaLayout]],
    *,
    tied_embeddings: bool = True,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """`initialize_heterogeneous` for a job that switches between several layouts from one
    iteration to the next (Hydraulis' per-iteration strategies, seed `hydraulis.txt` §5.2):
    every strategy's groups are created up front, in strategy order, so a switch creates
    nothing; strategy 0 is in use until `use_strategy` picks another. Every strategy is
    checked against the world size before the first group exists; errors name the strategy.
    """
    global _layout, _strategies
    if _layout is not None:
        raise RuntimeError("megatron.dynapipe.parallel_state is already initialised")
    owns_world_group = _init_world(backend, timeout_s)
    topologies = []
    try:
        for k, layouts in enumerate(strategies):
            try:
                topologies.append(HeteroTopology.from_layouts(layouts, dist.get_world_size()))
            except LayoutMismatch as err:
                if len(strategies) == 1:
                    raise
                raise LayoutMismatch(f"strategy {k}: {err}") from err
    except LayoutMismatch:
        if owns_world_group:
            dist.destroy_process_group()
        raise
    rank = dist.get_rank()
    # megatron-core's DotProductAttention and sequence-parallel all-gathers take scratch
    # tensors from parallel_state's global buffer; only initialize_model_parallel creates it
    # otherwise, and it holds no group, so one buffer serves every strategy.
    if mpu._GLOBAL_MEMORY_BUFFER is None:
        mpu._set_global_memory_buffer()
    _strategies = [
        _HeteroLayout(t, HeteroGroups(t, rank, tied_embeddings), t.place(rank), owns_world_group)
        for t in topologies
    ]
    use_strategy(0)


_strategies: list[_HeteroLayout] = []


def use_strategy(index: int) -> None:
    """Make strategy `index` (of `initialize_strategies`) this rank's layout: `pg_collection()`
    and the stage and peer queries answer for it. Models built under one strategy keep its
    groups; call this before running that strategy's plan or building its model."""
    global _layout
    if not 0 <= index < len(_strategies):
        raise ValueError(f"strategy {index} does not exist; the job has {len(_strategies)}")
    _layout = _strategies[index]


def pg_collection() -> ProcessGroupCollection:
    """This rank's process groups of the current layout, as megatron-core's models, DDP,
    optimisers and schedules take them: a heterogeneous strategy's own collection
    (`HeteroGroups.pg_collection`), or the groups megatron-core's initialisation built."""
    layout = _get()
    if isinstance(layout, _HeteroLayout):
        return layout.groups.pg_collection
    return ProcessGroupCollection.use_mpu_process_groups()


def num_strategies() -> int:
    """How many layouts the job can switch between (1 for a static heterogeneous plan)."""
    return len(_strategies)


def is_heterogeneous() -> bool:
    """Whether the job runs a heterogeneous plan's asymmetric layouts."""
    return isinstance(_layout, _HeteroLayout)


def _hetero() -> _HeteroLayout:
    layout = _get()
    if not isinstance(layout, _HeteroLayout):
        raise RuntimeError("the job is homogeneous; it has no heterogeneous layouts")
    return layout


def topology() -> HeteroTopology:
    """The asymmetric job's layouts (heterogeneous jobs only)."""
    return _hetero().topology


def topologies() -> list[HeteroTopology]:
    """Every strategy's layouts, in `initialize_strategies` order."""
    return [strategy.topology for strategy in _strategies]


def hetero_groups() -> HeteroGroups:
    """The asymmetric job's process groups (heterogeneous jobs only)."""
    return _hetero().groups


def pipeline_layer_counts() -> list[int] | None:
    """Layers per stage of this rank's pipeline where a plan sets them (a heterogeneous job's
    layouts, a searched plan's partition); None for the planner's even split."""
    layout = _get()
    if not isinstance(layout, _HeteroLayout):
        return None if layout.layer_counts is None else list(layout.layer_counts)
    stages = layout.topology.layouts[layout.replica].stages
    return [s.layers[1] - s.layers[0] for s in stages]


def device() -> torch.device:
    """This rank's device: its current GPU (NCCL reduces and sends device tensors), else the
    CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_initialized() -> bool:
    """Whether `initialize` has run (and `destroy` has not)."""
    return _layout is not None


def _get() -> _Layout | _HeteroLayout:
    if _layout is None:
        raise RuntimeError("megatron.dynapipe.parallel_state is not initialised")
    return _layout


def stage() -> int:
    """This rank's pipeline stage."""
    return _get().stage


def num_stages() -> int:
    """Pipeline depth (of this rank's pipeline)."""
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
    """Tensor-parallel degree (of this rank's stage)."""
    return _get().tp


def peer_rank(stage: int) -> int:
    """Global rank this rank exchanges boundary tensors with at pipeline `stage`: the same
    tensor-parallel shard in a homogeneous job, the stage's leader in a heterogeneous one."""
    layout = _get()
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage {stage} outside 0..{layout.pp - 1}")
    if isinstance(layout, _HeteroLayout):
        return layout.topology.leader(layout.replica, stage)
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
    _strategies.clear()
