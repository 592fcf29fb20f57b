"""Which launcher rank runs which cluster device of a HexiScale plan (seed hexiscale.txt §3.2:
the asymmetric runtime builds each pipeline's groups from the plan's device ids).

The planner numbers devices machine by machine (`devices.HeteroCluster`) and may put a
pipeline's later stage on a lower device than an earlier one (its stage order, §4.3, follows
speed and bandwidth, not device ids). The runtime cannot run such a plan as it is: torch numbers
a process group's members in rank order and megatron-core reads a stage's index from that
order, so each pipeline's stages must run on increasing ranks
(`megatron.dynapipe.layout_groups.HeteroTopology`). `bind_ranks` renumbers instead of
reordering: ranks are handed out pipeline by pipeline, stage by stage, in each stage's device
order, so every stage's ranks lie above the previous stage's and the plan itself (stages, TP
groups, layers, micro-batches) is unchanged. `device_of_rank[r]` is the cluster device rank r
must stand for: on GPUs the process of rank r is placed on that device, with emulated speeds
(`--device-speed`) rank r takes that device's slowdown (`RankBinding.per_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from ..errors import PlanningError
from .layout import HeteroPipeline, HeteroPlan, HeteroStage

T = TypeVar("T")


@dataclass(frozen=True)
class RankBinding:
    """A plan whose device ids are ranks, and the cluster device behind each rank."""

    plan: HeteroPlan
    device_of_rank: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.device_of_rank)

    def per_rank(self, per_device: Sequence[T]) -> list[T]:
        """A per-device list (speeds, GPU names) reordered to rank order."""
        missing = [d for d in self.device_of_rank if not 0 <= d < len(per_device)]
        if missing:
            raise PlanningError(
                f"the plan runs on device(s) {missing}, but only {len(per_device)} device "
                "value(s) were given"
            )
        return [per_device[d] for d in self.device_of_rank]


def bind_ranks(plan: HeteroPlan) -> RankBinding:
    """Renumber the plan's devices as ranks 0..n-1 in pipeline, stage and TP order (n = the
    devices the plan uses; devices it leaves idle get no rank). A device listed twice is an
    error naming both places."""
    device_of_rank: list[int] = []
    where: dict[int, str] = {}
    pipelines = []
    for i, pipe in enumerate(plan.pipelines):
        stages = []
        for j, stage in enumerate(pipe.stages):
            ranks = []
            for d in stage.devices:
                if d in where:
                    raise PlanningError(
                        f"pipeline {i} stage {j}: device {d} is already used by {where[d]}"
                    )
                where[d] = f"pipeline {i} stage {j}"
                ranks.append(len(device_of_rank))
                device_of_rank.append(d)
            stages.append(HeteroStage(tuple(ranks), stage.layers))
        pipelines.append(HeteroPipeline(tuple(stages), pipe.micro_batches))
    stats = {**plan.stats, "device_of_rank": list(device_of_rank)}
    return RankBinding(replace(plan, pipelines=pipelines, stats=stats), tuple(device_of_rank))
