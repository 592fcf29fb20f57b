"""Per-iteration strategies on a mixed GPU cluster: Hydraulis's selection and dispatch (seed
hydraulis.txt §5-6) over pipelines that know their GPU type, as HexiScale's planner does
(seed hexiscale.txt §3-4).

Hydraulis profiles one GPU type: its schemes <TP, PP> are priced as if every GPU were alike,
so on a mixed cluster a pipeline placed on slower GPUs straggles. HexiScale knows every GPU but
fixes one plan, and one token share per pipeline, before training. Here a scheme carries its
GPU type (`ParallelScheme.gpu`) and is profiled on where it runs: the first GPUs of that type
(`PlacedSchemeModels`, the cost model of that placement, `hetero.pipeline_costs`). MaxLen,
UtilLen and T(l) then differ by type, so dispatch (§6.2, already per pipeline profile) sends
long sequences to pipelines that are fast and roomy enough, and Eq. 1 packing (§6.1) runs
inside each pipeline with its own profile. A scheme is priced where its first pipeline sits,
which is exact for all its pipelines when each type's machines hold whole pipelines.

Candidates (`group_candidates`): a pipeline never spans GPU types (mixing types in a TP group
or across stages paces them to the slowest), so each type's GPUs are filled with pipelines of
one scheme of that type (GPUs its size leaves over go to the cheapest smaller schemes that fit
them); a strategy picks one filling per type. Each type keeps the `keep`
fillings that process the dataset's tokens they can hold in the fewest GPU-seconds (§7's
ranking by GPU-seconds, per type) and the cheapest one that holds the longest sequence; the
candidates are every combination of those. `mixed_selector` prices every candidate each
iteration (§4 steps 1-4) and plans the winner.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..cost import split_layers
from ..devices import HeteroCluster
from ..errors import PlanningError
from ..hetero.layout import HeteroPipeline, HeteroStage
from ..hetero.pipeline_costs import MixedPipelineCostModel, pipeline_cost_model
from ..model_spec import ModelSpec
from ..plan import ReplicaLayout, StageLayout
from ..planner import IterationPlanner, PlannerConfig
from .proposal import Strategy, interval_work
from .schemes import ParallelScheme, SchemeProfile, scheme_space
from .selection import SelectionConfig, StrategySelector


def gpu_groups(cluster: HeteroCluster) -> dict[str, list[int]]:
    """The devices of each GPU type, in cluster order."""
    groups: dict[str, list[int]] = {}
    for m in cluster.machines:
        groups.setdefault(m.gpu.name, []).extend(m.devices)
    return groups


def typed_scheme_space(
    model: ModelSpec, cluster: HeteroCluster, *, max_tp: int = 8
) -> list[ParallelScheme]:
    """`scheme_space` of each GPU type's devices, TP within one of its machines."""
    schemes = []
    for gpu, devices in gpu_groups(cluster).items():
        machine = max(m.count for m in cluster.machines if m.gpu.name == gpu)
        for s in scheme_space(model, len(devices), max_tp=min(max_tp, machine)):
            schemes.append(ParallelScheme(s.tp, s.pp, gpu))
    return schemes


def place_pipelines(
    cluster: HeteroCluster, model: ModelSpec, schemes: Sequence[ParallelScheme]
) -> list[HeteroPipeline]:
    """Devices and layers of each pipeline, in order: a typed scheme takes the next free GPUs
    of its type, an untyped one (a homogeneous planner's) the next free GPUs of the cluster;
    stage by stage, TP groups contiguous, layers split evenly (as the planner core does)."""
    groups = gpu_groups(cluster)
    free = {"": list(range(cluster.num_devices)), **{g: list(d) for g, d in groups.items()}}
    taken: set[int] = set()
    out = []
    for scheme in schemes:
        if scheme.gpu not in free:
            raise PlanningError(f"{scheme}: cluster {cluster.name!r} has no {scheme.gpu} GPUs")
        devices = [d for d in free[scheme.gpu] if d not in taken][: scheme.num_gpus]
        if len(devices) < scheme.num_gpus:
            raise PlanningError(
                f"{scheme}: needs {scheme.num_gpus} GPUs, only {len(devices)} "
                f"{scheme.gpu or 'GPUs'} left on cluster {cluster.name!r}"
            )
        taken.update(devices)
        counts = split_layers(model.num_layers, scheme.pp)
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        stages = tuple(
            HeteroStage(tuple(devices[j * scheme.tp : (j + 1) * scheme.tp]), (a, b))
            for j, (a, b) in enumerate(itertools.pairwise(bounds))
        )
        out.append(HeteroPipeline(stages, 1))
    return out


@dataclass(frozen=True)
class PlacedSchemeModels:
    """The cost model of each typed scheme placed on the first GPUs of its type, optimiser
    states sharded over the job's `num_gpus` (Hydraulis §5.2). Picklable."""

    cluster: HeteroCluster
    model: ModelSpec
    num_gpus: int

    def layouts(self, schemes: Sequence[ParallelScheme]) -> list[ReplicaLayout]:
        """Where pipelines of `schemes` (in order) run: `place_pipelines` as plan layouts."""
        return [
            ReplicaLayout(
                index,
                len(pipeline.stages),
                [StageLayout(list(st.devices), st.tp, st.layers) for st in pipeline.stages],
            )
            for index, pipeline in enumerate(place_pipelines(self.cluster, self.model, schemes))
        ]

    def __call__(self, scheme: ParallelScheme) -> MixedPipelineCostModel:
        if not scheme.gpu:
            raise PlanningError(f"{scheme}: a mixed cluster needs schemes with a GPU type")
        (pipeline,) = place_pipelines(self.cluster, self.model, [scheme])
        replicas = max(1, self.num_gpus // scheme.num_gpus)
        return pipeline_cost_model(self.cluster, self.model, pipeline, num_replicas=replicas)


def group_candidates(
    profiles: Sequence[SchemeProfile],
    cluster: HeteroCluster,
    lengths: np.ndarray,
    *,
    keep: int = 2,
    step: int = 128,
) -> list[Strategy]:
    """Every combination of one filling per GPU type (module docstring): the `keep` cheapest
    per token and the cheapest that holds the longest of `lengths`, each topped up with the
    cheapest schemes that fit the GPUs it leaves over; a type none of whose schemes fits in
    memory stays idle."""
    groups = gpu_groups(cluster)
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max())
    by_scheme = {p.scheme: p for p in profiles}
    per_type = []
    for gpu, devices in groups.items():
        mine = [p for p in profiles if p.scheme.gpu == gpu]
        ranked = []
        for p in mine:
            held = lengths[lengths <= p.max_len]
            if len(held) == 0:
                continue
            work = interval_work(held, [p], step=step).work[:, 0]
            seconds_per_token = float(np.sum(work)) * p.scheme.num_gpus / float(held.sum())
            ranked.append((seconds_per_token, p.scheme))
        ranked.sort()
        chosen = [s for _, s in ranked[:keep]]
        # And the cheapest scheme that holds the longest sequence, so that some combination
        # holds every batch (the cheapest per token are often the ones with a short MaxLen).
        holder = next((s for _, s in ranked if by_scheme[s].max_len >= longest), None)
        if holder is not None and holder not in chosen:
            chosen.append(holder)
        fillings = [_fill(s, len(devices), [t for _, t in ranked]) for s in chosen]
        per_type.append(fillings or [Strategy(())])
    return [
        Strategy(tuple(sorted(pair for part in combo for pair in part.pipelines)))
        for combo in itertools.product(*per_type)
    ]


def _fill(first: ParallelScheme, gpus: int, cheapest: list[ParallelScheme]) -> Strategy:
    """`first`'s pipelines over a type's `gpus`; the GPUs they leave over (its size does not
    divide them) go in turn to the cheapest schemes that fit, so only GPUs no scheme fits idle."""
    counts: dict[ParallelScheme, int] = {}
    left = gpus
    for scheme in (first, *cheapest):
        k = left // scheme.num_gpus
        if k:
            counts[scheme] = counts.get(scheme, 0) + k
            left -= k * scheme.num_gpus
    return Strategy.of(counts)


def mixed_selector(
    profiles: Sequence[SchemeProfile],
    candidates: Sequence[Strategy],
    cost_model_of: PlacedSchemeModels,
    config: SelectionConfig | None = None,
) -> StrategySelector:
    """A `StrategySelector` that prices exactly `candidates` every iteration: neither the
    one-scheme strategies nor per-batch proposals (which assume interchangeable GPUs) are
    added."""
    if not candidates:
        raise PlanningError("no candidate strategies for the mixed cluster")
    settings = replace(config or SelectionConfig(), homogeneous=False, batch_candidates=0)
    return StrategySelector(
        list(profiles),
        [],
        cost_model_of,
        cost_model_of.num_gpus,
        settings,
        fixed=candidates,
        placement=cost_model_of.layouts,
    )


class ClusterPricer:
    """Prices pipelines as laid out on the real cluster: the planner core's 1F1B timeline of
    given micro-batches on each pipeline's `pipeline_cost_model`, with the cheapest
    recomputation mode that fits them; a planner per layout."""

    def __init__(self, cluster: HeteroCluster, model: ModelSpec, num_gpus: int) -> None:
        self.cluster, self.model, self.num_gpus = cluster, model, num_gpus
        self._planners: dict[HeteroPipeline, IterationPlanner] = {}

    def planner(self, pipeline: HeteroPipeline) -> IterationPlanner:
        key = HeteroPipeline(pipeline.stages, 1)
        if key not in self._planners:
            gpus = len(pipeline.devices)
            costs = pipeline_cost_model(
                self.cluster, self.model, key, num_replicas=max(1, self.num_gpus // gpus)
            )
            self._planners[key] = IterationPlanner(
                costs,
                len(pipeline.stages),
                PlannerConfig(
                    batching="packing", schedule="1f1b", num_replicas=1, dp_work_budget=0
                ),
            )
        return self._planners[key]
