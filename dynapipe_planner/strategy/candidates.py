"""The candidate strategies a `--dynamic-strategies` job switches between, and their layouts.

Hydraulis (seed `hydraulis.txt` §7) proposes a few heterogeneous strategies from the dataset's
length distribution before training and selects one per iteration (§4). The runtime must build
every candidate's process groups before the first iteration (§5.2: a switch creates nothing),
so the candidate set is fixed at start-up. It is chosen here, without torch, from what the
runtime derives from its flags (`megatron.dynapipe.layouts.training.hetero_job`: the model spec,
the data's lengths, the world size): the strategies of a `dynapipe-strategy propose --output`
file, or (no file) the proposals for this job's data and model plus each scheme's homogeneous
strategy. A strategy the job cannot run is dropped with a log line: one needing
more ranks than the job has, or one leaving ranks without a stage. Each remaining strategy's
layout is the one `StrategySelector.to_plan` gives its plans (pipelines in the strategy's
order, devices dealt out contiguously, layers split evenly), so a plan names its strategy by
its layouts alone (`CandidateSet.index_of`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import PlanningError
from ..input_files import load_json_file
from ..model_spec import ModelSpec
from ..plan import ExecutionPlan, ReplicaLayout
from .mixed import PlacedSchemeModels, group_candidates, typed_scheme_space
from .proposal import Proposal, RelaxedSolution, Strategy, interval_work, propose_strategies
from .schemes import (
    AnalyticSchemeModels,
    ParallelScheme,
    SchemeProfile,
    profile_schemes,
    scheme_space,
    scheme_tables,
)
from .selection import contiguous_layouts

LayoutKey = tuple[tuple[tuple[tuple[int, ...], int, tuple[int, int]], ...], ...]


class CandidateError(PlanningError):
    """A candidate file or strategy the job cannot use; names the file, scheme or strategy."""


def check_scheme(scheme: ParallelScheme, spec: ModelSpec, where: str) -> None:
    """TP must divide the heads and the FFN width, PP at most the layers (split evenly)."""
    if spec.num_heads % scheme.tp or spec.ffn_hidden_size % scheme.tp:
        raise CandidateError(
            f"{where}: scheme {scheme} has TP {scheme.tp}, which does not divide the model's "
            f"{spec.num_heads} heads and FFN width {spec.ffn_hidden_size}"
        )
    if scheme.pp > spec.num_layers:
        raise CandidateError(
            f"{where}: scheme {scheme} has {scheme.pp} stages for {spec.num_layers} layers"
        )


def load_candidates(
    path: str | Path, spec: ModelSpec, num_gpus: int
) -> tuple[list[SchemeProfile], list[Proposal]]:
    """Scheme profiles and proposals from a `dynapipe-strategy propose --output` file, checked
    against this job: the file must have been made for `num_gpus` GPUs, and each scheme must be
    realisable on `spec` (errors name the file and the item)."""
    path = Path(path)
    data = load_json_file(path, "strategy candidates file", CandidateError)
    try:
        schemes, raw = data["schemes"], data["proposals"]
    except KeyError as err:
        raise CandidateError(
            f"{path} is not a `dynapipe-strategy propose --output` file ({err!r})"
        ) from err
    profiles = []
    for k, item in enumerate(schemes):
        scheme = ParallelScheme(int(item["tp"]), int(item["pp"]))
        check_scheme(scheme, spec, f"{path} schemes[{k}]")
        profiles.append(
            SchemeProfile(
                scheme,
                int(item["max_len"]),
                int(item["util_len"]),
                tuple(float(c) for c in item["latency_coef"]),
                np.zeros(0),
                np.zeros(0),
            )
        )
    known = {p.scheme for p in profiles}
    proposals, made_for = [], set()
    for k, item in enumerate(raw):
        strategies = []
        for s, entry in enumerate(item["strategies"]):
            where = f"{path} proposals[{k}].strategies[{s}]"
            counts = {}
            for pipe in entry["pipelines"]:
                scheme = ParallelScheme(int(pipe["tp"]), int(pipe["pp"]))
                if scheme not in known:
                    raise CandidateError(f"{where}: scheme {scheme} is not in the file's schemes")
                counts[scheme] = counts.get(scheme, 0) + int(pipe["count"])
            strategies.append(Strategy.of(counts))
            made_for.add(int(entry.get("num_gpus", strategies[-1].num_gpus)))
        estimates = [float(e.get("estimated_s", 0.0)) for e in item["strategies"]]
        relaxed = RelaxedSolution(
            float(item.get("relaxed_latency_s", 0.0)), np.zeros(0), np.zeros(0)
        )
        proposals.append(
            Proposal(int(item["max_len"]), relaxed, tuple(strategies), tuple(estimates))
        )
    if not proposals:
        raise CandidateError(f"{path} proposes no strategies")
    if max(made_for) != num_gpus:
        raise CandidateError(
            f"{path} was proposed for {max(made_for)} GPUs but this job has {num_gpus} ranks; "
            f"run `dynapipe-strategy propose --num-gpus {num_gpus}` again"
        )
    return profiles, proposals


def propose_candidates(
    spec: ModelSpec,
    lengths: np.ndarray,
    models: AnalyticSchemeModels,
    *,
    max_seqlen: int,
    tokens_per_iteration: int,
    recompute: str = "none",
    step: int = 128,
    keep: int = 3,
) -> tuple[list[SchemeProfile], list[Proposal]]:
    """Hydraulis §7 at start-up, from the job's own data and the analytic cost model (every
    rank computes the same, deterministically)."""
    schemes = scheme_space(spec, models.num_gpus, max_tp=models.num_gpus)
    profiles = profile_schemes(schemes, scheme_tables(models, max_seqlen, recompute))
    iw = interval_work(
        np.minimum(lengths, max_seqlen),
        profiles,
        step=min(step, max_seqlen),
        tokens_per_iteration=tokens_per_iteration,
    )
    return profiles, propose_strategies(iw, models.num_gpus, keep=keep)


def mixed_candidates(
    models: PlacedSchemeModels,
    lengths: np.ndarray,
    *,
    max_seqlen: int,
    recompute: str = "none",
    dropped: list[str] | None = None,
) -> tuple[list[SchemeProfile], CandidateSet]:
    """Candidates for ranks of different speeds (`--device-speed`): schemes typed by speed
    class and profiled where they run, each class filled with one scheme
    (`strategy.mixed.group_candidates`), each pipeline laid out on ranks of its class. A
    combination that leaves ranks idle (a class none of whose schemes fits) is dropped with a
    line."""
    dropped = [] if dropped is None else dropped
    spec, cluster = models.model, models.cluster
    schemes = typed_scheme_space(spec, cluster, max_tp=cluster.num_devices)
    for scheme in schemes:
        check_scheme(scheme, spec, "emulated mixed cluster")
    profiles = profile_schemes(schemes, scheme_tables(models, max_seqlen, recompute))
    kept = []
    for strategy in group_candidates(profiles, cluster, np.minimum(lengths, max_seqlen)):
        if strategy.num_gpus == models.num_gpus:
            kept.append(strategy)
        else:
            dropped.append(
                f"strategy {strategy} uses {strategy.num_gpus} of the job's {models.num_gpus} "
                "ranks (no scheme of the rest fits): not a candidate"
            )
    if not kept:
        raise CandidateError(f"no mixed-speed candidate uses all the job's {models.num_gpus} ranks")
    layouts = [models.layouts(k.schemes) for k in kept]
    return profiles, CandidateSet([str(k) for k in kept], layouts, kept)


def strategy_layouts(strategy: Strategy, num_layers: int) -> list[ReplicaLayout]:
    """The layouts `StrategySelector.to_plan` gives a strategy's plans."""
    return contiguous_layouts(strategy.schemes, num_layers)


def layout_key(layouts: Sequence[ReplicaLayout]) -> LayoutKey:
    """A hashable form of a job layout (what the executor compares plans against)."""
    return tuple(
        tuple((tuple(s.devices), s.tp, (int(s.layers[0]), int(s.layers[1]))) for s in r.stages)
        for r in layouts
    )


@dataclass
class CandidateSet:
    """The strategies this job built groups for, in one order on every rank: `names[k]` for
    the logs, `layouts[k]` for `parallel_state.initialize_strategies`, `strategies[k]` for the
    selector (None for a static `--hetero-plan` layout)."""

    names: list[str]
    layouts: list[list[ReplicaLayout]]
    strategies: list[Strategy | None]

    def __post_init__(self) -> None:
        self._index = {layout_key(layouts): k for k, layouts in enumerate(self.layouts)}

    def index_of(self, plan: ExecutionPlan) -> int:
        """The strategy whose layouts `plan` has."""
        key = layout_key(plan.replicas)
        if key not in self._index:
            raise CandidateError(
                f"the plan's layouts {[r.to_dict() for r in plan.replicas]} are none of the "
                f"{len(self.layouts)} strategies this job built groups for"
            )
        return self._index[key]

    @property
    def tp_degrees(self) -> list[int]:
        return sorted({s.tp for layouts in self.layouts for r in layouts for s in r.stages})

    @property
    def vocab_multiple_tp(self) -> int:
        """The TP degree the vocabulary is padded for: every strategy's shards must divide it."""
        return math.lcm(*self.tp_degrees)


def realisable(
    profiles: Sequence[SchemeProfile],
    proposals: Sequence[Proposal],
    num_gpus: int,
    num_layers: int,
    *,
    homogeneous: bool,
    dropped: list[str] | None = None,
) -> CandidateSet:
    """Every proposed strategy (and, with `homogeneous`, each scheme's homogeneous strategy)
    that uses exactly `num_gpus` ranks, in first-proposed order; the others are logged and
    dropped (a line each appended to `dropped`, for the job's log). The selector prices
    nothing else (`SelectionConfig.allowed`)."""
    dropped = [] if dropped is None else dropped
    offered = [s for p in sorted(proposals, key=lambda p: p.max_len) for s in p.strategies]
    if homogeneous:
        offered += [Strategy.homogeneous(p.scheme, num_gpus) for p in profiles]
    kept = []
    for strategy in dict.fromkeys(offered):
        if strategy.num_gpus > num_gpus:
            dropped.append(
                f"strategy {strategy} needs {strategy.num_gpus} ranks, the job has "
                f"{num_gpus}: not a candidate"
            )
        elif strategy.num_gpus < num_gpus:
            dropped.append(
                f"strategy {strategy} uses {strategy.num_gpus} of the job's {num_gpus} ranks "
                "(the rest would idle): not a candidate"
            )
        else:
            kept.append(strategy)
    if not kept:
        raise CandidateError(f"no candidate strategy uses exactly the job's {num_gpus} ranks")
    return CandidateSet(
        [str(s) for s in kept], [strategy_layouts(s, num_layers) for s in kept], kept
    )
