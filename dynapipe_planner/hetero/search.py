"""HexiScale's two-phase scheduling with iterative optimisation (seed hexiscale.txt §4.2-4.4).

Phase 1 (§4.2): split the device graph into D_dp pipelines of balanced compute with the
minimum (or, §4.4, maximum) bandwidth between them (`graph_partition`).

Phase 2 (§4.3), per pipeline: (i) split its devices into k_i high-bandwidth groups by the same
partitioner, and groups further by machine, since each group's strategy is searched "within
each machine"; (ii) give each group the TP degree that the cost model says processes its share
of layers fastest, bubbles included, so a group becomes one or more stages; (iii) order the
groups by the top-tau greedy path search (`stage_order`), assign layers within memory
(`layer_assign`), and keep the order whose pipeline is fastest. Micro-batches then go to the
pipelines so they finish together.

Iterations (§4.4) vary D_dp, the cut option and k_i, evaluate each plan with the cost model
(out of memory = infinitely slow) and keep the best. The cut option is chosen by a moving
average of the costs each option produced; a round that brings no improvement, or the time
budget, ends the search.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanningError
from .cost import Estimate, HeteroCostModel
from .graph_partition import partition_graph
from .layer_assign import (
    assign_layers,
    assign_micro_batches,
    pipeline_profile,
    stage_shapes,
)
from .layout import HeteroPipeline, HeteroPlan, HeteroStage
from .stage_order import group_bandwidth, top_tau_orders

Progress = Callable[[str], None]


@dataclass(frozen=True)
class SearchConfig:
    # Plans priced before the search keeps its best (§4.4 searches "within a time budget"; a
    # count of work instead, so a busy machine finds the plan an idle one finds). The searches
    # of examples/clusters converge first: 20-54 plans, 0.3-7.9 s here (240 GPUs: 54).
    max_plans: int = 200
    max_rounds: int = 50
    tau: int = 2
    orders_priced: int = 6
    balance: float = 1.1
    max_dp: int = 0  # 0: as many pipelines as devices and micro-batches allow
    # k_i = round(machines of the pipeline x scale) (§4.3 i, varied by §4.4). 3x lets one
    # machine's GPUs form up to three groups, each with its own local TP and place in the
    # stage order; without it Llama 30B on setting 3 loses a point of MFU (29.9% vs 30.9%).
    k_scales: tuple[float, ...] = (1.0, 2.0, 3.0)
    ema_decay: float = 0.5
    seed: int = 0
    # Device-graph partitioner of phase 1 and of phase 2 (i), called as
    # `partition(weights, adjacency, k, maximize=, balance=, seed=)` -> labels; §4.2's
    # multi-level partition unless an ablation swaps it (Fig. 8's random partition).
    partition: Callable[..., np.ndarray] = partition_graph


@dataclass
class SearchResult:
    plan: HeteroPlan
    estimate: Estimate
    elapsed_s: float
    evaluated: int
    history: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class _Pipeline:
    stages: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    fill_s: float
    bottleneck_s: float


def _tp_degrees(cost: HeteroCostModel, n: int) -> list[int]:
    return [t for t in (1, 2, 4, 8, 16) if t <= n and n % t == 0 and cost.valid_tp(t)]


def _local_tp(cost: HeteroCostModel, group: tuple[int, ...], expected_m: float) -> int:
    """§4.3 (ii): the TP degree with which the group runs a layer-micro-batch cheapest,
    counting the fill a deeper local pipeline adds (1 + (stages - 1) / m)."""
    n = len(group)
    best, best_t = math.inf, 1
    for t in _tp_degrees(cost, n):
        stages = n // t
        layer_s = cost.layer_time_s(group[:t], cost.recompute_modes[-1])
        per_layer = layer_s / stages * (1 + (stages - 1) / expected_m)
        if per_layer < best:
            best, best_t = per_layer, t
    return best_t


def _groups(
    cost: HeteroCostModel, devices: list[int], k: int, config: SearchConfig
) -> list[tuple[int, ...]]:
    """§4.3 (i): k high-bandwidth groups, each then split by machine."""
    c = cost.cluster
    idx = np.array(devices)
    k = max(1, min(k, len(devices)))
    machine = c.device_machine[idx]
    if k == len(np.unique(machine)):
        # Machines are the high-bandwidth cliques the partition would return; skip it.
        return [tuple(int(d) for d in idx[machine == m]) for m in np.unique(machine)]
    labels = config.partition(
        c.peak_flops[idx],
        c.bandwidth[np.ix_(idx, idx)],
        k,
        balance=config.balance,
        seed=config.seed,
    )
    machine = c.device_machine[idx]
    out = []
    for p in range(k):
        for m in np.unique(machine[labels == p]):
            members = idx[(labels == p) & (machine == m)]
            if len(members):
                out.append(tuple(int(d) for d in members))
    return out


def build_pipeline(
    cost: HeteroCostModel,
    devices: list[int],
    k: int,
    num_pipelines: int,
    expected_m: float,
    config: SearchConfig,
) -> _Pipeline | None:
    """Phase 2 for one pipeline's devices; None when no layout holds the model."""
    layers_total = cost.job.model.num_layers
    groups = _groups(cost, devices, k, config)
    # The locally optimal TP per group (§4.3 ii), and every uniform TP as alternatives: the
    # local choice ignores what TP does to memory and to the stage count of the whole pipeline.
    choices = [[_local_tp(cost, g, expected_m) for g in groups]]
    for t in _tp_degrees(cost, max(len(g) for g in groups)):
        uniform = [
            t if t in _tp_degrees(cost, len(g)) else choices[0][i] for i, g in enumerate(groups)
        ]
        if uniform not in choices:
            choices.append(uniform)
    weights = group_bandwidth(cost.cluster.bandwidth, [list(g) for g in groups])
    orders = top_tau_orders(weights, config.tau, config.orders_priced)
    # Other pipelines on the same machines are expected to look like this one, so a machine's
    # link is shared by about (its GPUs / this pipeline's GPUs on it) transfers.
    machines = cost.cluster.machines
    of = cost.cluster.device_machine
    sharing = {}
    for m in {int(of[d]) for d in devices}:
        mine = sum(1 for d in devices if of[d] == m)
        sharing[m] = float(min(num_pipelines, max(1, machines[m].count // mine)))
    best: _Pipeline | None = None
    best_time = math.inf
    for tps in choices:
        if sum(len(g) // t for g, t in zip(groups, tps, strict=True)) > layers_total:
            continue
        local = [
            [g[i : i + t] for i in range(0, len(g) - len(g) % t, t)]
            for g, t in zip(groups, tps, strict=True)
        ]
        for order in orders:
            stages = [s for g in order for s in local[g]]
            shapes = stage_shapes(cost, stages, num_pipelines, sharing)
            layers = assign_layers(shapes, layers_total)
            if layers is None:
                continue
            fill, bottleneck = pipeline_profile(shapes, layers)
            t = fill + (max(expected_m, len(stages)) - 1) * bottleneck
            if t < best_time:
                best_time = t
                best = _Pipeline(tuple(stages), tuple(layers), fill, bottleneck)
    return best


def assemble(cost: HeteroCostModel, pipes: list[_Pipeline]) -> HeteroPlan | None:
    """Micro-batches per pipeline, layer ranges, and the plan."""
    job = cost.job
    micro = assign_micro_batches([(p.fill_s, p.bottleneck_s) for p in pipes], job.num_micro_batches)
    if micro is None:
        return None
    out = []
    for p, m in zip(pipes, micro, strict=True):
        start, stages = 0, []
        for devs, n in zip(p.stages, p.layers, strict=True):
            stages.append(HeteroStage(devs, (start, start + n)))
            start += n
        out.append(HeteroPipeline(tuple(stages), m))
    return HeteroPlan(out, job.micro_batch_size, job.seqlen, job.model.name, cost.cluster.name)


def plan_for_partition(
    cost: HeteroCostModel,
    labels: np.ndarray,
    k_scale: float,
    config: SearchConfig,
    cache: dict | None = None,
) -> tuple[HeteroPlan, Estimate] | None:
    """Phase 2 for every part of a phase-1 partition, then the plan and its estimate."""
    num = int(labels.max()) + 1
    expected_m = cost.job.num_micro_batches / num
    machine = cost.cluster.device_machine
    cache = {} if cache is None else cache
    pipes = []
    for p in range(num):
        devices = [int(d) for d in np.nonzero(labels == p)[0]]
        k = max(1, round(len(np.unique(machine[devices])) * k_scale))
        order, signature = _canonical(cost, devices)
        key = (signature or tuple(devices), k, num)
        if key not in cache:
            pipe = build_pipeline(cost, order, k, num, expected_m, config)
            cache[key] = None if pipe is None else _to_positions(pipe, order)
        if cache[key] is None:
            return None
        pipes.append(_from_positions(cache[key], order))
    plan = assemble(cost, pipes)
    if plan is None:
        return None
    if any(p.micro_batches < len(p.stages) for p in plan.pipelines):
        return None  # fewer micro-batches than stages: outside 1F1B's steady state (Eq. 9)
    est = cost.estimate(plan)
    if not est.fits:
        return None
    plan.stats = est.as_stats()
    return plan, est


def _canonical(cost: HeteroCostModel, devices: list[int]) -> tuple[list[int], tuple | None]:
    """Devices in a canonical order, and a signature shared by every pipeline that is the same
    up to renaming machines: same machine kinds and counts, one bandwidth and latency between
    all of its machines. Such pipelines get the same layout, so phase 2 runs once for them."""
    c = cost.cluster
    machine = c.device_machine
    ms = sorted({int(machine[d]) for d in devices})
    first = [c.machines[m].first_device for m in ms]
    sub_bw = c.bandwidth[np.ix_(first, first)][~np.eye(len(ms), dtype=bool)]
    sub_lat = c.latency[np.ix_(first, first)][~np.eye(len(ms), dtype=bool)]

    def kind(m: int) -> tuple:
        mc = c.machines[m]
        count = sum(1 for d in devices if machine[d] == m)
        gpu = (mc.gpu.name, mc.gpu.peak_flops, mc.gpu.memory_bytes, mc.gpu.hbm_bandwidth)
        return (gpu, mc.intra_bandwidth, mc.intra_latency_s, mc.memory_limit_bytes, count)

    order = sorted(devices, key=lambda d: (kind(int(machine[d])), int(machine[d]), d))
    if len(ms) > 1 and (np.ptp(sub_bw) > 0 or np.ptp(sub_lat) > 0):
        return order, None
    net = (float(sub_bw[0]), float(sub_lat[0])) if len(ms) > 1 else ()
    return order, (tuple(sorted(kind(m) for m in ms)), net)


def _to_positions(pipe: _Pipeline, order: list[int]) -> _Pipeline:
    pos = {d: i for i, d in enumerate(order)}
    stages = tuple(tuple(pos[d] for d in s) for s in pipe.stages)
    return _Pipeline(stages, pipe.layers, pipe.fill_s, pipe.bottleneck_s)


def _from_positions(pipe: _Pipeline, order: list[int]) -> _Pipeline:
    stages = tuple(tuple(order[i] for i in s) for s in pipe.stages)
    return _Pipeline(stages, pipe.layers, pipe.fill_s, pipe.bottleneck_s)


def _dp_candidates(cost: HeteroCostModel, config: SearchConfig) -> list[int]:
    """Pipeline counts worth trying: every one up to 16, then about 25% apart."""
    c, job = cost.cluster, cost.job
    limit = min(c.num_devices, job.num_micro_batches, config.max_dp or c.num_devices)
    # Memory: each pipeline holds the whole model's weights and gradients at least.
    m = job.model
    params = m.num_layers * m.layer_params("decoder") + m.embedding_params()
    total_mem = sum(mc.memory_limit_bytes * mc.count for mc in c.machines)
    limit = max(1, min(limit, int(total_mem // (params * 6.0))))
    out, d = [], 1
    while d <= limit:
        out.append(d)
        d = d + 1 if d < 16 else max(d + 1, round(d * 1.25))
    return out


def hexiscale_search(
    cost: HeteroCostModel, config: SearchConfig | None = None, progress: Progress | None = None
) -> SearchResult:
    """The best plan found within `config.max_plans` plans priced (§4.4)."""
    config = config or SearchConfig()
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    flops = cost.cluster.peak_flops
    bandwidth = cost.cluster.bandwidth
    dps = _dp_candidates(cost, config)
    cache: dict = {}
    tried: set[tuple] = set()
    history: list[dict] = []
    ema: dict[bool, float] = {}
    best: tuple[HeteroPlan, Estimate] | None = None

    def out_of_budget() -> bool:
        return len(history) >= config.max_plans

    def try_one(d: int, maximize: bool, k_scale: float, seed: int) -> bool:
        nonlocal best
        key = (d, maximize, k_scale, seed)
        if key in tried:
            return False
        tried.add(key)
        labels = config.partition(
            flops, bandwidth, d, maximize=maximize, balance=config.balance, seed=seed
        )
        found = plan_for_partition(cost, labels, k_scale, config, cache)
        t = found[1].iteration_s if found else math.inf
        history.append(
            {
                "dp": d,
                "cut": "max" if maximize else "min",
                "k_scale": k_scale,
                "seed": seed,
                "iteration_s": t,
            }
        )
        if math.isfinite(t):
            # Moving average of the cost relative to the best so far, per cut option.
            ref = best[1].iteration_s if best else t
            ema[maximize] = config.ema_decay * ema.get(maximize, t / ref) + (
                1 - config.ema_decay
            ) * (t / ref)
        if found and (best is None or t < best[1].iteration_s):
            best = found
            say(
                f"  D_dp={d:<3} cut={'max' if maximize else 'min'} k_scale={k_scale:g}: "
                f"{t:.3f} s/iteration, MFU {found[1].mfu:.1%} (new best)"
            )
            return True
        return False

    say(f"hexiscale: {cost.cluster.num_devices} GPUs, D_dp candidates {dps}")
    # Round 0: every pipeline count with both cut options (seeds the moving averages).
    for d in dps:
        for maximize in (False, True):
            if out_of_budget():
                break
            try_one(d, maximize, config.k_scales[0], config.seed)
    rounds = 0
    while best is not None and rounds < config.max_rounds and not out_of_budget():
        rounds += 1
        improved = False
        d0 = len(best[0].pipelines)
        near = [d for d in dps if abs(dps.index(d) - dps.index(d0)) <= 2] if d0 in dps else dps
        option = min(ema, key=ema.get) if ema else False
        for d in near:
            for k_scale in config.k_scales:
                for maximize in (option, not option):
                    if out_of_budget():
                        break
                    improved |= try_one(d, maximize, k_scale, config.seed + rounds - 1)
        if not improved:
            break
    if best is None:
        raise PlanningError(
            f"no plan for {cost.job.model.name} fits the memory of cluster "
            f"{cost.cluster.name!r} (tried D_dp in {dps})"
        )
    plan, est = best
    elapsed = time.perf_counter() - start
    plan.stats["search_s"] = elapsed
    plan.stats["evaluated"] = len(history)
    say(
        f"hexiscale: best {est.iteration_s:.3f} s/iteration after {len(history)} plans, "
        f"{elapsed:.1f} s"
    )
    return SearchResult(plan, est, elapsed, len(history), history)
