"""Planner-core cost tables of one pipeline whose stages sit on different GPU types: the bridge
from a HexiScale layout (seed hexiscale.txt §3.2: each stage its own devices, TP degree and
layer range) to the planner core, which then prices variable-length micro-batches on it.

`hetero.cost` prices a plan for one fixed sequence length (App. A); a batch of variable-length
sequences needs the planner core's tables instead. Stage j here is stage j of the analytic
model of its slowest GPU at its TP degree (App. A assumes one type per stage; `hetero.cost`
takes the slowest too), with its own layer count, its TP all-reduces over the slowest link
inside its group and the smallest memory limit among its GPUs; the hop to the next stage takes
the fastest link between the two groups (Eq. 5's best leader pair). Optimiser states are
sharded over `num_replicas` pipelines (HexiScale §3.2's FSDP hooks, Hydraulis §5.2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..cluster import ClusterSpec, GpuSpec
from ..cost import AnalyticCostModel, PipelineCosts
from ..cost.analytic import RECOMPUTE_MODES
from ..devices import HeteroCluster
from ..model_spec import ModelSpec
from .layout import HeteroPipeline


@dataclass(frozen=True)
class StagePlacement:
    """What prices one stage: its GPU type (with its TP group's link as the intra-node
    bandwidth), TP degree, per-GPU memory limit and number of layers."""

    gpu: GpuSpec
    tp: int
    memory_limit_bytes: int
    layers: int


@dataclass(frozen=True)
class MixedPipelineCostModel:
    """A `planner.CostModel` for one pipeline of `stages`; `p2p_bandwidth[j]` links stage j to
    j + 1 (bytes/s). Picklable, like the homogeneous models."""

    model: ModelSpec
    stages: tuple[StagePlacement, ...]
    p2p_bandwidth: tuple[float, ...]
    p2p_latency_s: float
    num_replicas: int = 1
    flash_attention: bool = True
    distributed_optimizer: bool = True
    sequence_parallel: bool = True
    dtype: str = "bf16"

    def recompute_modes(self) -> list[str]:
        return list(RECOMPUTE_MODES)

    def describe(self) -> dict:
        return {
            "kind": "mixed-pipeline",
            "model": self.model.name,
            "stages": [
                {"gpu": s.gpu.name, "tp": s.tp, "layers": s.layers, "memory": s.memory_limit_bytes}
                for s in self.stages
            ],
        }

    def stage_model(self, stage: int) -> AnalyticCostModel:
        """The analytic model whose stage `stage` this pipeline's stage is."""
        s = self.stages[stage]
        cluster = ClusterSpec(
            s.gpu,
            num_stages=len(self.stages),
            num_replicas=self.num_replicas,
            tp=s.tp,
            gpus_per_node=s.tp,  # TP inside its group, over the group's own link
            memory_limit_bytes=s.memory_limit_bytes,
        )
        return AnalyticCostModel(
            self.model,
            cluster,
            flash_attention=self.flash_attention,
            distributed_optimizer=self.distributed_optimizer,
            dtype=self.dtype,
            sequence_parallel=self.sequence_parallel,
        )

    def pipeline_costs(self, recompute: str = "none", **grid_hints: int) -> PipelineCosts:
        """Row j of stage j's analytic tables, stacked (stages of one kind share a table)."""
        counts = [s.layers for s in self.stages]
        tables: dict[StagePlacement, PipelineCosts] = {}
        rows = []
        for j, s in enumerate(self.stages):
            key = replace(s, layers=0)
            if key not in tables:
                tables[key] = self.stage_model(j).pipeline_costs(
                    recompute, layer_counts=counts, **grid_hints
                )
            rows.append(tables[key])
        first = rows[0]

        def stacked(name: str) -> np.ndarray:
            return np.stack([getattr(t, name)[j] for j, t in enumerate(rows)])

        return PipelineCosts(
            b_grid=first.b_grid,
            s_grid=first.s_grid,
            t_grid=first.t_grid,
            forward=stacked("forward"),
            backward=stacked("backward"),
            activation=stacked("activation"),
            transient=stacked("transient"),
            static=stacked("static"),
            attention_coef=stacked("attention_coef"),
            hidden_size=first.hidden_size,
            memory_limit=np.array([float(s.memory_limit_bytes) for s in self.stages]),
            p2p_bandwidth=np.array(self.p2p_bandwidth, dtype=np.float64),
            p2p_latency=self.p2p_latency_s,
            recompute=recompute,
            dtype=self.dtype,
            boundary_seq=first.boundary_seq,
        )


def stage_placement(
    cluster: HeteroCluster, devices: tuple[int, ...], layers: int
) -> StagePlacement:
    """A stage on `devices`: the slowest GPU type among them, TP over their slowest link."""
    gpus = [cluster.gpu(d) for d in devices]
    gpu = min(gpus, key=lambda g: g.peak_flops)
    limit = min(cluster.memory_limit(d) for d in devices)
    if len(devices) > 1:
        idx = np.array(devices)
        off = ~np.eye(len(devices), dtype=bool)
        link = float(cluster.bandwidth[np.ix_(idx, idx)][off].min())
        latency = float(cluster.latency[np.ix_(idx, idx)][off].max())
        gpu = replace(gpu, intra_node_bandwidth=link, link_latency_s=latency)
    return StagePlacement(gpu, len(devices), int(limit), layers)


def pipeline_cost_model(
    cluster: HeteroCluster,
    model: ModelSpec,
    pipeline: HeteroPipeline,
    *,
    num_replicas: int = 1,
) -> MixedPipelineCostModel:
    """The cost model of `pipeline` as laid out on `cluster` (its stages' devices and layers)."""
    stages = tuple(stage_placement(cluster, s.devices, s.num_layers) for s in pipeline.stages)
    bandwidth, latency = [], 0.0
    for a, b in zip(pipeline.stages, pipeline.stages[1:], strict=False):
        bw = cluster.bandwidth[np.ix_(a.devices, b.devices)]
        i, j = np.unravel_index(int(np.argmax(bw)), bw.shape)
        bandwidth.append(float(bw[i, j]))
        latency = max(latency, float(cluster.latency[a.devices[i], b.devices[j]]))
    return MixedPipelineCostModel(model, stages, tuple(bandwidth), latency, num_replicas)
