"""Process groups of an asymmetric job: pipelines of different depth, a TP degree per stage.

HexiScale (seed `hexiscale.txt` §3.2, "Asymmetric partition of the computation load") gives
every pipeline its own number of stages, every stage its own tensor-parallel degree and layer
range, and a leader per stage that talks to the neighbouring stages' leaders. Hydraulis
(`hydraulis.txt` §5.1) runs such pipelines side by side as one data-parallel job. A plan's
`replicas` layouts (`dynapipe_planner.plan.ReplicaLayout`) say all of this; here they become:

* `HeteroTopology`: pure bookkeeping, no torch.distributed. Which (replica, stage, TP rank) each
  global rank runs, the leader of every stage, and which stages hold each model part (for the
  gradient sync). Built and checked against the world size before any collective, so a plan
  that does not fit the job fails on every rank with the same message instead of hanging.
* `HeteroGroups`: every process group of the job, created once and in the same order on every
  rank (gloo and NCCL need identical `new_group` calls everywhere): each stage's TP group, the
  pipeline groups megatron-core reads stage ranks from, each pipeline's model-parallel group,
  and the groups of ranks sharing a gradient chunk (`grad_sync`).
* `HeteroGroups.pg_collection`: this rank's groups as megatron-core's `ProcessGroupCollection`
  (TP group of *its* stage, *its* pipeline, a data-parallel and context-parallel group of
  itself alone, because cross-pipeline reduction is `grad_sync`'s job), handed to the model
  builder and anything else megatron-core builds for the layout. megatron.core.parallel_state's
  globals are left alone: each strategy of a switching job has its own collection, and
  switching strategy only switches which one the next build is given.

Device indices of the layouts are global ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from dynapipe_planner.plan import ReplicaLayout


class LayoutMismatch(ValueError):
    """The plan's layouts do not describe this job; raised before any collective."""


@dataclass(frozen=True)
class StagePlace:
    """Where one global rank sits: pipeline `replica`, its `stage` (of `num_stages`) and its
    index in that stage's tensor-parallel group."""

    replica: int
    stage: int
    num_stages: int
    tp_rank: int
    tp: int
    layers: tuple[int, int]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


# Model parts other than transformer layers, named as grad_sync names them.
EMBEDDING = "embedding"  # word embeddings (and the tied output layer)
POSITION = "position"  # learned absolute position embeddings
FINAL_NORM = "final_norm"
OUTPUT = "output"  # the output layer when it is not tied to the embedding


@dataclass(frozen=True)
class HeteroTopology:
    """The job's layouts, checked against its world size."""

    layouts: tuple[ReplicaLayout, ...]
    world_size: int

    @classmethod
    def from_layouts(cls, layouts: Sequence[ReplicaLayout], world_size: int) -> HeteroTopology:
        """Check that the layouts use exactly ranks 0..world_size-1, each once, hold the same
        layers [0, L) in every pipeline, and that each pipeline's stages run on increasing
        ranks (megatron-core reads a stage's index from its rank order in the pipeline group);
        errors name the replica, stage or rank."""
        if not layouts:
            raise LayoutMismatch("the plan has no replica layouts; it is not heterogeneous")
        owner: dict[int, str] = {}
        num_layers = None
        for k, rep in enumerate(layouts):
            if rep.id != k or len(rep.stages) != rep.num_stages or rep.num_stages < 1:
                raise LayoutMismatch(
                    f"replica layout {k} (id {rep.id}) lists {len(rep.stages)} stage(s) for "
                    f"num_stages {rep.num_stages}"
                )
            end = 0
            for j, stage in enumerate(rep.stages):
                where = f"replica {k} stage {j}"
                if stage.tp != len(stage.devices) or stage.tp < 1:
                    raise LayoutMismatch(f"{where} has tp {stage.tp} on devices {stage.devices}")
                if stage.layers[0] != end or stage.layers[1] <= end:
                    raise LayoutMismatch(
                        f"{where} holds layers {list(stage.layers)}; expected to start at {end}"
                    )
                end = stage.layers[1]
                for device in stage.devices:
                    if not 0 <= device < world_size:
                        raise LayoutMismatch(
                            f"{where} runs on rank {device}, but the job has {world_size} "
                            f"rank(s) (0..{world_size - 1})"
                        )
                    if device in owner:
                        raise LayoutMismatch(
                            f"{where}: rank {device} is also used by {owner[device]}"
                        )
                    owner[device] = where
            for t in range(max(stage.tp for stage in rep.stages)):
                ranks = [stage.devices[min(t, stage.tp - 1)] for stage in rep.stages]
                for j in range(1, len(ranks)):
                    if ranks[j] <= ranks[j - 1]:
                        # torch numbers a group's members in rank order and megatron-core
                        # reads a stage's index from its rank in the pipeline group.
                        raise LayoutMismatch(
                            f"replica {k} stage {j} runs on rank {ranks[j]}, not above rank "
                            f"{ranks[j - 1]} of stage {j - 1}: a pipeline's stages must run on "
                            "increasing ranks (renumber the plan: dynapipe-hetero --bind-ranks)"
                        )
            if num_layers is not None and end != num_layers:
                raise LayoutMismatch(
                    f"replica {k} holds layers [0, {end}) but replica 0 holds [0, {num_layers})"
                )
            num_layers = end
        idle = sorted(set(range(world_size)) - set(owner))
        if idle:
            raise LayoutMismatch(
                f"the plan's layouts use {len(owner)} rank(s) but the job has {world_size}; "
                f"rank(s) {idle} have no stage"
            )
        return cls(tuple(layouts), world_size)

    @property
    def num_layers(self) -> int:
        return self.layouts[0].stages[-1].layers[1]

    def place(self, rank: int) -> StagePlace:
        """The (replica, stage, TP rank) that global `rank` runs."""
        for rep in self.layouts:
            for j, stage in enumerate(rep.stages):
                if rank in stage.devices:
                    return StagePlace(
                        rep.id, j, rep.num_stages, stage.devices.index(rank), stage.tp, stage.layers
                    )
        raise LayoutMismatch(f"rank {rank} has no stage in the plan's layouts")

    def leader(self, replica: int, stage: int) -> int:
        """The global rank that sends and receives a stage's boundary tensors (HexiScale's
        fixed leader: the stage's first device)."""
        return self.layouts[replica].stages[stage].devices[0]

    def stages(self) -> list[tuple[int, int]]:
        """Every (replica, stage) in the one order all ranks use."""
        return [(rep.id, j) for rep in self.layouts for j in range(rep.num_stages)]

    def holders(self, part: str | int, tied_embeddings: bool) -> list[tuple[int, int]]:
        """(replica, stage) of every stage holding model `part`: a transformer layer index, or
        EMBEDDING / POSITION / FINAL_NORM / OUTPUT. A tied output layer is the embedding, so
        the last stages hold the embedding too."""
        found = []
        for rep in self.layouts:
            for j, stage in enumerate(rep.stages):
                first, last = j == 0, j == rep.num_stages - 1
                if isinstance(part, int):
                    held = stage.layers[0] <= part < stage.layers[1]
                elif part == EMBEDDING:
                    held = first or (last and tied_embeddings)
                elif part == POSITION:
                    held = first
                elif part in (FINAL_NORM, OUTPUT):
                    held = last and (part == FINAL_NORM or not tied_embeddings)
                else:
                    raise ValueError(f"unknown model part {part!r}")
                if held:
                    found.append((rep.id, j))
        return found

    def parts(self) -> list[str | int]:
        """Every model part, in the one order all ranks use."""
        return [EMBEDDING, POSITION, *range(self.num_layers), FINAL_NORM, OUTPUT]

    def chunk_holders(self, holders: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
        """For a TP-sharded tensor held by `holders`: split it into lcm(TP degrees) chunks along
        its partition dim; chunk c is held by one rank per holding stage (the TP rank whose
        shard contains it). HexiScale §3.2: chunks at the granularity of the smallest shard."""
        degrees = [self.layouts[r].stages[s].tp for r, s in holders]
        chunks = math.lcm(*degrees)
        result = []
        for c in range(chunks):
            ranks = []
            for (r, s), tp in zip(holders, degrees, strict=True):
                ranks.append(self.layouts[r].stages[s].devices[c * tp // chunks])
            result.append(tuple(sorted(ranks)))
        return result

    def replicated_holders(self, holders: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Every rank of every holding stage: a tensor TP does not shard lives on all of them."""
        return tuple(sorted(d for r, s in holders for d in self.layouts[r].stages[s].devices))


class HeteroGroups:
    """All process groups of an asymmetric job, created in one order on every rank.

    `tp[(replica, stage)]`, `pipeline[rank]` (this rank's pipeline group, one rank per stage,
    ordered by stage), `model_parallel[replica]`, `self_group` (this rank alone),
    `shared[ranks]` for every set of ranks that shares a gradient chunk (more than one rank),
    and `pg_collection`, this rank's groups as megatron-core takes them.
    """

    def __init__(self, topology: HeteroTopology, rank: int, tied_embeddings: bool) -> None:
        self.topology = topology
        self.rank = rank
        self.tp: dict[tuple[int, int], dist.ProcessGroup] = {}
        for replica, stage in topology.stages():
            devices = topology.layouts[replica].stages[stage].devices
            self.tp[(replica, stage)] = dist.new_group(devices)
        self.pipeline_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for rep in topology.layouts:
            # One pipeline group per TP index: stage j contributes its rank min(t, tp_j - 1),
            # so every rank is in a group where its group rank is its stage.
            for t in range(max(s.tp for s in rep.stages)):
                ranks = tuple(s.devices[min(t, s.tp - 1)] for s in rep.stages)
                if ranks not in self.pipeline_ranks:
                    self.pipeline_ranks[ranks] = dist.new_group(list(ranks))
        self.model_parallel = {
            rep.id: dist.new_group(sorted(d for s in rep.stages for d in s.devices))
            for rep in topology.layouts
        }
        self.self_group = None
        for r in range(topology.world_size):
            group = dist.new_group([r])
            if r == rank:
                self.self_group = group
        self.shared: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for part in topology.parts():
            holders = topology.holders(part, tied_embeddings)
            if not holders:
                continue
            for ranks in [*topology.chunk_holders(holders), topology.replicated_holders(holders)]:
                if len(ranks) > 1 and ranks not in self.shared:
                    self.shared[ranks] = dist.new_group(list(ranks))
        self.pg_collection = self._collection()

    def my_pipeline(self) -> tuple[tuple[int, ...], dist.ProcessGroup]:
        """This rank's pipeline group and its ranks by stage."""
        place = self.topology.place(self.rank)
        rep = self.topology.layouts[place.replica]
        ranks = tuple(s.devices[min(place.tp_rank, s.tp - 1)] for s in rep.stages)
        return ranks, self.pipeline_ranks[ranks]

    def _collection(self) -> ProcessGroupCollection:
        """This rank's groups for megatron-core's models (and DDP, optimiser, schedules, where a
        caller builds them): its stage's TP group, its pipeline, its pipeline's model-parallel
        group. Data and context parallelism of megatron-core's own modules are trivial (this
        rank alone): the cross-pipeline gradient reduction is grad_sync's, since the holders of
        a parameter shard it differently. No experts: expert parallelism of one, expert TP the
        stage's TP. No embedding groups: grad_sync also keeps tied and position embeddings in
        step, so megatron-core's own embedding sync is skipped (it checks for None)."""
        place = self.topology.place(self.rank)
        tp = self.tp[(place.replica, place.stage)]
        _, pp = self.my_pipeline()
        mp = self.model_parallel[place.replica]
        alone = self.self_group
        return ProcessGroupCollection(
            tp=tp,
            pp=pp,
            mp=mp,
            embd=None,
            pos_embd=None,
            cp=alone,
            tp_cp=tp,
            hcp=None,
            ep=alone,
            expt_tp=tp,
            tp_ep=tp,
            tp_ep_pp=mp,
            tp_ep_pp_with_egtp_remat=mp,
            tp_dp_cp=tp,
            dp=alone,
            dp_cp=alone,
            dp_cp_gtp_remat=alone,
            expt_dp=alone,
            expt_dp_gtp_remat=alone,
            intra_dp_cp=alone,
            intra_expt_dp=alone,
            intra_dist_opt=alone,  # one optimiser instance per rank
        )
