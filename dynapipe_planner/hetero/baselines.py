"""Baselines HexiScale is compared with (seed hexiscale.txt §5.1, §5.4, App. C), priced by the
same cost model (`hetero.cost`) so that only the plan differs.

- `megatron_symmetric`: Megatron's one TP x PP x DP layout for every GPU, exhaustive over the
  degrees; ranks in Megatron's order (TP fastest, then DP, then PP) over the devices as the
  cluster file lists them; layers split evenly; every pipeline runs the same batch.
- `galvatron_symmetric`: an approximation of Galvatron(-BMW) on this problem, stated: the same
  symmetric degrees and placement with one strategy for every layer, but layers assigned to
  stages by Galvatron's partition (§5.1: "flexible transformer layer assignment"), which
  balances time as if every GPU were the same (it profiles one device type) and respects
  each stage's memory. Its per-layer strategy mix (sharded DP, per-layer checkpointing) is not
  searched.
- `metis_style`: App. C: one pipeline, one stage per machine (machines by total FLOPS, fastest
  first), each stage data- and tensor-parallel inside its machine, so a micro-batch must split
  over the stage's DP replicas; every uniform (TP, micro-batch size) choice is priced.
- `homogeneous_reference`: the A800 PCIe cluster of (rounded) equal peak FLOPS in whole 8-GPU
  machines (§5.1 rents two and four 8 x A800 PCIe) on the same network, planned by HexiScale
  and by Megatron, the better of the two; MFU is over that cluster's own peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..cost.table import split_layers
from ..devices import Machine, homogeneous_cluster
from .cost import Estimate, HeteroCostModel, StageOption, fastest_holding, pipeline_time
from .layer_assign import StageShape, assign_layers, stage_shapes
from .layout import HeteroPipeline, HeteroPlan, HeteroStage
from .search import SearchConfig, hexiscale_search


@dataclass
class BaselineResult:
    name: str
    mfu: float
    iteration_s: float
    layout: str
    plan: HeteroPlan | None = None


def symmetric_layouts(cost: HeteroCostModel):
    """Every (TP, PP, DP) that tiles the cluster and divides the job's micro-batches."""
    n, layers = cost.cluster.num_devices, cost.job.model.num_layers
    for tp in (1, 2, 4, 8, 16):
        if n % tp or not cost.valid_tp(tp):
            continue
        for pp in range(1, min(layers, n // tp) + 1):
            if (n // tp) % pp:
                continue
            dp = n // tp // pp
            if cost.job.num_micro_batches % dp:
                continue
            yield tp, pp, dp


def _megatron_stages(tp: int, pp: int, dp: int, replica: int) -> list[tuple[int, ...]]:
    return [tuple(tp * (replica + dp * j) + t for t in range(tp)) for j in range(pp)]


def symmetric_plan(
    cost: HeteroCostModel, tp: int, pp: int, dp: int, balance_layers: bool = False
) -> HeteroPlan | None:
    """One symmetric TP x PP x DP layout in Megatron's rank order: layers split evenly, or
    (`balance_layers`) by Galvatron-style heterogeneity-blind balancing; None when that
    balancing finds no split within memory."""
    m = cost.job.num_micro_batches // dp
    pipes = []
    for r in range(dp):
        stages = _megatron_stages(tp, pp, dp, r)
        if balance_layers:
            # Heterogeneity-blind times (one profiled GPU type), true memory capacities:
            # every stage's times over its own last mode's layer time.
            shapes = [
                StageShape(s.devices, _blind(s.options)) for s in stage_shapes(cost, stages, dp)
            ]
            counts = assign_layers(shapes, cost.job.model.num_layers)
            if counts is None:
                return None
        else:
            counts = split_layers(cost.job.model.num_layers, pp)
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        pipes.append(
            HeteroPipeline(
                tuple(
                    HeteroStage(s, (int(a), int(b)))
                    for s, a, b in zip(stages, bounds[:-1], bounds[1:], strict=True)
                ),
                m,
            )
        )
    return HeteroPlan(
        pipes, cost.job.micro_batch_size, cost.job.seqlen, cost.job.model.name, cost.cluster.name
    )


def _blind(options: tuple[StageOption, ...]) -> tuple[StageOption, ...]:
    """Times in units of the stage's own layer time (its last mode's), as if every GPU were
    the same type; capacities kept."""
    unit = options[-1].per_layer_s
    return tuple(
        replace(o, per_layer_s=o.per_layer_s / unit, fixed_s=o.fixed_s / unit) for o in options
    )


def _best_symmetric(cost: HeteroCostModel, balance_layers: bool, name: str) -> BaselineResult:
    best: tuple[HeteroPlan, Estimate, str] | None = None
    for tp, pp, dp in symmetric_layouts(cost):
        plan = symmetric_plan(cost, tp, pp, dp, balance_layers)
        if plan is None:
            continue
        est = cost.estimate(plan)
        if est.fits and (best is None or est.iteration_s < best[1].iteration_s):
            plan.stats = est.as_stats()
            best = (plan, est, f"TP={tp} PP={pp} DP={dp}")
    if best is None:
        return BaselineResult(name, 0.0, math.inf, "out of memory for every TP/PP/DP")
    return BaselineResult(name, best[1].mfu, best[1].iteration_s, best[2], best[0])


def megatron_symmetric(cost: HeteroCostModel) -> BaselineResult:
    """Best symmetric Megatron layout, exhaustive over TP, PP and DP."""
    return _best_symmetric(cost, False, "megatron")


def galvatron_symmetric(cost: HeteroCostModel) -> BaselineResult:
    """Symmetric degrees with layers balanced by time under memory (see module docstring)."""
    return _best_symmetric(cost, True, "galvatron-style")


def metis_style(cost: HeteroCostModel) -> BaselineResult:
    """App. C: a single pipeline of one stage per machine with in-stage DP x TP."""
    cluster, job = cost.cluster, cost.job
    machines = sorted(cluster.machines, key=lambda m: (-m.gpu.peak_flops * m.count, m.first_device))
    layers_total = job.model.num_layers
    if len(machines) > layers_total:
        return BaselineResult("metis-style", 0.0, math.inf, "more machines than layers")
    best: BaselineResult | None = None
    for tp in (1, 2, 4, 8):
        if not cost.valid_tp(tp):
            continue
        tps = [tp if m.count % tp == 0 else 1 for m in machines]
        dps = [m.count // t for m, t in zip(machines, tps, strict=True)]
        lcm = math.lcm(*dps)
        for factor in (1, 2, 4):
            micro = lcm * factor
            if job.global_batch % micro:
                continue
            found = _metis_price(cost, machines, tps, dps, micro)
            if found and (best is None or found[0] < best.iteration_s):
                iteration = found[0]
                mfu = (
                    job.flops_per_sample()
                    * job.global_batch
                    / (iteration * cluster.total_peak_flops)
                )
                desc = ", ".join(
                    f"{m.name}:(DP={d},TP={t},L={n})"
                    for m, d, t, n in zip(machines, dps, tps, found[1], strict=True)
                )
                best = BaselineResult("metis-style", mfu, iteration, f"micro-batch {micro}; {desc}")
    return best or BaselineResult("metis-style", 0.0, math.inf, "out of memory")


def _metis_price(
    cost: HeteroCostModel,
    machines: list[Machine],
    tps: list[int],
    dps: list[int],
    micro: int,
    layers: list[int] | None = None,
) -> tuple[float, list[int]] | None:
    """Iteration time and layers per stage of one Metis-style layout, or None (memory).
    `layers` fixes the layers per stage (a published plan, App. C Table 5) instead of
    balancing them; memory is then not checked."""
    job = cost.job
    depth = len(machines)
    stage_models, stages = [], []
    for m, t, d in zip(machines, tps, dps, strict=True):
        per_replica = replace(job, micro_batch_size=micro // d, global_batch=micro // d)
        stage_models.append(
            HeteroCostModel(cost.cluster, per_replica, share_links=cost.share_links)
        )
        stages.append(tuple(range(m.first_device, m.first_device + t)))
    shapes = []
    for j, (cm, devs) in enumerate(zip(stage_models, stages, strict=True)):
        options = cm.stage_options(devs, j == 0, j == depth - 1, depth - j, dps[j])
        sends = 0.0
        # The micro-batch moves between machines as one transfer per replica of the narrower
        # side, all sharing the machines' network link.
        if j + 1 < depth:
            narrow = j if dps[j] <= dps[j + 1] else j + 1
            sends += stage_models[narrow].hop_s(devs, stages[j + 1], float(dps[narrow])) / 2
        if j > 0:
            narrow = j if dps[j] <= dps[j - 1] else j - 1
            sends += stage_models[narrow].hop_s(stages[j - 1], devs, float(dps[narrow])) / 2
        shapes.append(StageShape.sending(devs, options, sends))
    counts = layers or assign_layers(shapes, job.model.num_layers)
    if counts is None:
        return None
    # As the cost model prices a stage (a published plan's stage may not fit its memory).
    modes = [fastest_holding(s.options, n) for s, n in zip(shapes, counts, strict=True)]
    busy = [o.fixed_s + n * o.per_layer_s for o, n in zip(modes, counts, strict=True)]
    pipe = pipeline_time(busy, job.global_batch // micro)
    # In-stage DP sync of each stage's gradients inside its machine (App. A Eq. 4), slowest.
    sync = 0.0
    grad_bytes = 2.0
    params = job.model.layer_params("decoder")
    for m, t, d, n in zip(machines, tps, dps, counts, strict=True):
        if d < 2:
            continue
        members = np.array([m.first_device + t * r for r in range(d)])
        bw = cost.cluster.bandwidth[np.ix_(members, members)]
        lat = cost.cluster.latency[np.ix_(members, members)]
        per_peer = lat + n * params / t * grad_bytes / (d * bw)
        np.fill_diagonal(per_peer, 0.0)
        sync = max(sync, 2.0 * float(per_peer.sum(1).max()))
    return pipe + sync, counts


_A800_BOX = 8


def equal_flops_a800(cost: HeteroCostModel) -> HeteroCostModel:
    """The homogeneous A800 PCIe cluster with the (rounded) same peak FLOPS, in whole 8-GPU
    machines once it is that large, on the same default network between machines."""
    c = cost.cluster
    a800 = homogeneous_cluster("A800-PCIe", 1)
    n = max(1, round(c.total_peak_flops / a800.total_peak_flops))
    if n >= _A800_BOX:
        # Whole 8-GPU machines, as §5.1's references are rented (two and four 8 x A800 PCIe
        # for settings 1-2 and 3): rounding GPUs instead gave setting 3 a prime 29-GPU cluster
        # with a 5-GPU machine, whose only layouts are 29 one-GPU stages or 29 replicas.
        n = _A800_BOX * max(1, round(n / _A800_BOX))
    inter = c.bandwidth[
        ~np.eye(c.num_devices, dtype=bool)
        & (c.device_machine[:, None] != c.device_machine[None, :])
    ]
    lat = c.latency[c.device_machine[:, None] != c.device_machine[None, :]]
    bw_gbs = float(np.median(inter)) / 1e9 if inter.size else 25.0
    lat_us = float(np.median(lat)) * 1e6 if lat.size else 50.0
    homo = homogeneous_cluster(
        "A800-PCIe",
        n,
        inter_bandwidth_gbs=bw_gbs,
        inter_latency_us=lat_us,
        name=f"{n}xA800-PCIe",
    )
    return HeteroCostModel(homo, cost.job, share_links=cost.share_links)


def homogeneous_reference(
    cost: HeteroCostModel, config: SearchConfig | None = None
) -> BaselineResult:
    """Best of HexiScale and Megatron on the equal-FLOPS A800 cluster (MFU is over that
    cluster's own peak)."""
    homo = equal_flops_a800(cost)
    ours = hexiscale_search(homo, config)
    mega = megatron_symmetric(homo)
    if mega.iteration_s < ours.estimate.iteration_s:
        return replace(mega, name=f"homogeneous {homo.cluster.name} (megatron)")
    return BaselineResult(
        f"homogeneous {homo.cluster.name} (hexiscale)",
        ours.estimate.mfu,
        ours.estimate.iteration_s,
        f"DP={len(ours.plan.pipelines)}",
        ours.plan,
    )
