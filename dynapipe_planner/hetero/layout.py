"""What a HexiScale plan is: pipelines of different depth, each stage its own TP group of devices
and its own layer range, each pipeline its own number of micro-batches (seed hexiscale.txt §3.2
"asymmetric partition of the computation load", §4.1 "one parallel execution plan").

The layout converts to `plan.ReplicaLayout` / `plan.StageLayout`, the heterogeneous part of the
ExecutionPlan contract the runtime consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanningError
from ..plan import ReplicaLayout, StageLayout


@dataclass(frozen=True)
class HeteroStage:
    """One pipeline stage: a tensor-parallel group (its devices, TP = their number) holding the
    transformer layers [first, end)."""

    devices: tuple[int, ...]
    layers: tuple[int, int]

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class HeteroPipeline:
    """One data-parallel pipeline: stages in order and the micro-batches it runs per iteration."""

    stages: tuple[HeteroStage, ...]
    micro_batches: int

    @property
    def devices(self) -> list[int]:
        return [d for s in self.stages for d in s.devices]


@dataclass
class HeteroPlan:
    """Pipelines of one iteration, plus what they were planned for and what they cost."""

    pipelines: list[HeteroPipeline]
    micro_batch_size: int
    seqlen: int
    model: str = ""
    cluster: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * sum(p.micro_batches for p in self.pipelines)

    def replica_layouts(self) -> list[ReplicaLayout]:
        """The runtime's view: one ReplicaLayout per pipeline (ExecutionPlan "replicas")."""
        return [
            ReplicaLayout(
                i,
                len(p.stages),
                [StageLayout(list(s.devices), s.tp, s.layers) for s in p.stages],
            )
            for i, p in enumerate(self.pipelines)
        ]

    def check(self, num_layers: int, num_devices: int) -> None:
        """Structural invariants: every pipeline holds every layer once, in order; each device
        is used at most once in the whole plan; every pipeline runs at least one micro-batch."""
        seen: dict[int, str] = {}
        for i, p in enumerate(self.pipelines):
            if p.micro_batches < 1:
                raise PlanningError(f"pipeline {i}: needs at least one micro-batch")
            if not p.stages:
                raise PlanningError(f"pipeline {i}: has no stages")
            expect = 0
            for j, s in enumerate(p.stages):
                where = f"pipeline {i} stage {j}"
                if s.layers[0] != expect or s.layers[1] <= s.layers[0]:
                    raise PlanningError(
                        f"{where}: layers {list(s.layers)} do not continue from layer {expect}"
                    )
                expect = s.layers[1]
                if not s.devices:
                    raise PlanningError(f"{where}: has no devices")
                for d in s.devices:
                    if not 0 <= d < num_devices:
                        raise PlanningError(f"{where}: device {d} is not in the cluster")
                    if d in seen:
                        raise PlanningError(f"{where}: device {d} is already used by {seen[d]}")
                    seen[d] = where
            if expect != num_layers:
                raise PlanningError(f"pipeline {i}: holds layers [0, {expect}) of {num_layers}")
