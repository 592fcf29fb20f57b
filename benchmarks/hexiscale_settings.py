"""HexiScale on the paper's clusters (seed hexiscale.txt §5.1 settings 1-3, App. B's 240 GPUs):
the maximum MFU of our plan, the homogeneous A800 PCIe cluster of equal peak FLOPS on the same
network, the best symmetric Megatron layout, a Galvatron-style symmetric search and a
Metis-style single pipeline (App. C), all priced by one cost model (`hetero.cost`); then the
search time for 64, 128, 240 and 320 GPUs on one core.

§5.1 compares each system's *maximum* MFU and names no global batch, so every system here gets
the same list of global batches (`--batches`, samples of 4096 tokens) and reports its best MFU
with the batch that achieved it (`max_mfu_over_batches`, which the HexiScale figure scripts
reuse). The paper's gap to homogeneous ("0.3%", "3.5%" on average) is in MFU percentage
points; we print points and the gap relative to the homogeneous MFU.

Targets from the issue: within 5 MFU points of the homogeneous reference, at least 1.5x over
Metis-style, under 10 s at 320 GPUs. This prints what it measured; it asserts nothing.

    python -m benchmarks.hexiscale_settings            # a few minutes
    python -m benchmarks.hexiscale_settings --quick    # settings 1-3 only, no scaling runs
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.hexiscale_settings")

from benchmarks.hexiscale_breakdown import breakdown, describe
from dynapipe_planner.devices import HeteroCluster, cluster_from_dict, load_cluster
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.hetero.baselines import (
    BaselineResult,
    galvatron_symmetric,
    homogeneous_reference,
    megatron_symmetric,
    metis_style,
)
from dynapipe_planner.hetero.cost import HeteroCostModel, TrainingJob
from dynapipe_planner.hetero.search import SearchConfig, hexiscale_search
from dynapipe_planner.hetero.simulate import simulate_plan
from dynapipe_planner.model_spec import MODEL_PRESETS

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
CASES = [
    ("setting 1", "hexiscale_setting1.yaml", "llama2-7b"),
    ("setting 1", "hexiscale_setting1.yaml", "llama2-13b"),
    ("setting 2", "hexiscale_setting2.yaml", "llama2-7b"),
    ("setting 2", "hexiscale_setting2.yaml", "llama2-13b"),
    ("setting 3", "hexiscale_setting3.yaml", "llama-30b"),
    ("App. B 240", "hexiscale_appb_240.yaml", "llama-30b"),
    ("App. B 240", "hexiscale_appb_240.yaml", "llama2-70b"),
]
# Global batches in samples of 4096 tokens; 1024 is Llama 2's 4M-token pretraining batch.
BATCHES = (128, 256, 512, 1024)
SYSTEMS = ("ours", "homogeneous", "megatron", "galvatron", "metis")


@dataclass
class BestOverBatches:
    """One system's maximum MFU over a list of global batches: `best` at `batch` (None and
    MFU 0 when no batch fits memory), and what it got at every batch."""

    best: BaselineResult
    batch: int | None
    by_batch: dict[int, BaselineResult]


def job_cost(
    cluster: HeteroCluster,
    model: str,
    batch: int,
    share_links: bool = True,
    recompute: str = "full",
) -> HeteroCostModel:
    """The one cost model every system of a row is priced by (micro-batch 1; full recompute as
    App. A assumes, or "auto": each stage its fastest mode that fits)."""
    job = TrainingJob(MODEL_PRESETS[model], global_batch=batch, recompute=recompute)
    return HeteroCostModel(cluster, job, share_links=share_links)


def price_system(system: str, cost: HeteroCostModel, config: SearchConfig) -> BaselineResult:
    """One system's best plan for one job; MFU 0 when nothing fits memory."""
    if system == "ours":
        try:
            r = hexiscale_search(cost, config)
        except PlanningError as e:
            return BaselineResult("hexiscale", 0.0, math.inf, str(e))
        est = r.estimate
        return BaselineResult("hexiscale", est.mfu, est.iteration_s, describe(cost, r.plan), r.plan)
    if system == "homogeneous":
        return homogeneous_reference(cost, config)
    if system == "megatron":
        return megatron_symmetric(cost)
    if system == "galvatron":
        return galvatron_symmetric(cost)
    if system == "metis":
        return metis_style(cost)
    raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS}")


def max_mfu_over_batches(
    cluster: HeteroCluster,
    model: str,
    batches: Sequence[int] = BATCHES,
    config: SearchConfig | None = None,
    systems: Sequence[str] = SYSTEMS,
    share_links: bool = True,
    recompute: str = "full",
) -> dict[str, BestOverBatches]:
    """Every system's maximum MFU over the same global batches, each batch priced by the same
    cost model for every system (§5.1 reports maximum MFU and gives no batch)."""
    config = config or SearchConfig()
    found: dict[str, dict[int, BaselineResult]] = {s: {} for s in systems}
    for batch in batches:
        cost = job_cost(cluster, model, batch, share_links, recompute)
        for s in systems:
            found[s][batch] = price_system(s, cost, config)
    out = {}
    for s, by_batch in found.items():
        batch = max(by_batch, key=lambda b: by_batch[b].mfu)
        fits = by_batch[batch].mfu > 0
        out[s] = BestOverBatches(by_batch[batch], batch if fits else None, by_batch)
    return out


def scaled_cluster(n: int):
    """App. B's machine mix (8x3090 : 4x3090 : 8x4090 : 8xA800 = 5 : 6 : 20 : 2), interleaved,
    cut at n GPUs (the last machine may be smaller)."""
    pattern = ([("RTX4090", 8, 32)] * 20 + [("RTX3090", 4, 24)] * 6 + [("RTX3090", 8, 24)] * 5) + [
        ("A800", 8, 200)
    ] * 2
    order = sorted(range(len(pattern)), key=lambda i: (i * 7919) % len(pattern))
    machines, total, i = [], 0, 0
    while total < n:
        gpu, count, bw = pattern[order[i % len(order)]]
        count = min(count, n - total)
        machines.append({"name": f"m{i}", "gpu": gpu, "count": count, "intra_bandwidth_gbs": bw})
        total += count
        i += 1
    return cluster_from_dict(
        {
            "name": f"appb-mix-{n}",
            "network": {"bandwidth_gbs": 0.7, "latency_us": 50},
            "machines": machines,
        }
    )


def ratio(ours: float, other: float) -> float:
    """Our MFU over another system's (inf when that one fits at no batch)."""
    return ours / other if other > 0 else math.inf


def points_gap(ours: float, homo: float) -> float:
    """§5.1's "MFU percentage gap": homogeneous MFU minus ours, in percentage points."""
    return (homo - ours) * 100


def rel_gap(ours: float, homo: float) -> float:
    return (homo - ours) / homo if homo > 0 else float("nan")


def _cell(r: BestOverBatches) -> str:
    return f"{r.best.mfu:5.1%}@{r.batch}" if r.batch else "   OOM    "


def compare(max_plans: int, batches: Sequence[int], cases) -> list[tuple[str, dict]]:
    """The headline table: each system's maximum MFU over `batches`, with its batch."""
    print(
        f"maximum MFU over global batches {', '.join(map(str, batches))} (samples of 4096 "
        "tokens), every system at every batch, one cost model; cell = MFU@batch"
    )
    header = (
        f"{'cluster':<11} {'model':<11} {'GPUs':>4} {'ours':>10} {'homo':>10} {'gap':>6} "
        f"{'rel':>6} {'megatron':>10} {'galv.':>10} {'metis':>10} {'x metis':>7} "
        f"{'x galv.':>7} {'x mega':>7} {'search':>7}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for label, file, model in cases:
        cluster = load_cluster(CLUSTERS / file)
        res = max_mfu_over_batches(cluster, model, batches, SearchConfig(max_plans=max_plans))
        ours, homo = res["ours"], res["homogeneous"]
        mfu = ours.best.mfu
        search_s = ours.best.plan.stats["search_s"] if ours.best.plan else math.nan
        print(
            f"{label:<11} {model:<11} {cluster.num_devices:>4} {_cell(ours)} {_cell(homo)} "
            f"{points_gap(mfu, homo.best.mfu):+5.1f}p {rel_gap(mfu, homo.best.mfu):6.1%} "
            f"{_cell(res['megatron'])} {_cell(res['galvatron'])} {_cell(res['metis'])} "
            + " ".join(
                f"{ratio(mfu, res[s].best.mfu):6.2f}x" for s in ("metis", "galvatron", "megatron")
            )
            + f" {search_s:6.1f}s"
        )
        print(f"   ours: {ours.best.layout}")
        if ours.best.plan is not None:
            cost = job_cost(cluster, model, ours.batch)
            sim = simulate_plan(cost, ours.best.plan)
            if abs(sim.iteration_s - ours.best.iteration_s) > 0.01 * sim.iteration_s:
                print(
                    f"   note: 1F1B replay {sim.iteration_s:.2f} s vs estimate "
                    f"{ours.best.iteration_s:.2f} s"
                )
        print(
            f"   homogeneous: {homo.best.name}, {homo.best.layout[:70]}; "
            f"metis: {res['metis'].best.layout[:70]}"
        )
        sys.stdout.flush()
        results.append((f"{label} {model}", res))
    print(
        "gap = homogeneous MFU - ours in MFU percentage points (the paper's unit: 0.3 minimum, "
        "3.5 average); rel = that gap over the homogeneous MFU; x = our MFU over the baseline's"
    )
    return results


def by_batch_table(results: list[tuple[str, dict]], batches: Sequence[int]) -> None:
    print("\nMFU at each global batch (the maxima above are taken over these)")
    header = f"{'case':<23} {'batch':>5} " + " ".join(f"{s:>11}" for s in SYSTEMS)
    print(header)
    print("-" * len(header))
    for case, res in results:
        for b in batches:
            cells = []
            for s in SYSTEMS:
                mfu = res[s].by_batch[b].mfu
                cells.append(f"{mfu:11.1%}" if mfu > 0 else f"{'OOM':>11}")
            print(f"{case:<23} {b:>5} " + " ".join(cells))


def verdicts(results: list[tuple[str, dict]]) -> None:
    """One line per issue target over the headline (maximum-MFU) numbers."""
    gaps = [
        (case, points_gap(r["ours"].best.mfu, r["homogeneous"].best.mfu)) for case, r in results
    ]
    met = [c for c, g in gaps if g <= 5.0]
    print(
        f"\ntarget 1, MFU within 5 percentage points of the homogeneous A800 reference (max MFU "
        f"vs max MFU): met in {len(met)}/{len(gaps)} cases; gaps in points: "
        + ", ".join(f"{c} {g:+.1f}" for c, g in gaps)
        + f"; mean {sum(g for _, g in gaps) / len(gaps):+.1f} points"
    )
    paper = [g for c, g in gaps if c.startswith("setting")]
    if paper:
        print(
            f"  over §5.1's settings 1-3 only: minimum {min(paper):+.1f}, mean "
            f"{sum(paper) / len(paper):+.1f} MFU points (the paper: 0.3 minimum, 3.5 average)"
        )
    xs = [(case, ratio(r["ours"].best.mfu, r["metis"].best.mfu)) for case, r in results]
    met = [c for c, x in xs if x >= 1.5]
    print(
        f"target 2, at least 1.5x the Metis-style MFU (ratio of maximum MFUs): met in "
        f"{len(met)}/{len(xs)} cases; " + ", ".join(f"{c} {x:.2f}x" for c, x in xs)
    )


VARIANTS = {
    "network": (
        "sensitivity: App. A's network as written (every device pair has the whole link), "
        "full recomputation; headline = shared links",
        {"share_links": False},
    ),
    "recompute": (
        "beyond App. A: recomputation chosen per stage (the fastest of none / selective / full "
        "whose memory holds the stage's layers, for every system), shared links",
        {"recompute": "auto"},
    ),
}


def variant(name: str, max_plans: int, batches: Sequence[int], cases) -> None:
    """The headline's maximum MFUs under one change of the cost model (`VARIANTS`): the
    network choice the paper leaves open that moves the gaps most (whether transfers leaving a
    machine at once share its link, or each device pair has the whole link as App. A Eq. 4-5
    literally say; `benchmarks/hexiscale_breakdown.py` splits the terms), or recomputation
    chosen per stage instead of App. A's full recomputation everywhere."""
    title, change = VARIANTS[name]
    print(f"\n{title}; maximum MFU over the same batches")
    header = (
        f"{'cluster':<11} {'model':<11} {'ours':>10} {'homo':>10} {'gap':>6} {'rel':>6} "
        f"{'metis':>10} {'x metis':>7} {'megatron':>10} {'galv.':>10}  our DP / depths"
    )
    print(header)
    print("-" * len(header))
    for label, file, model in cases:
        cluster = load_cluster(CLUSTERS / file)
        config = SearchConfig(max_plans=max_plans)
        res = max_mfu_over_batches(cluster, model, batches, config, SYSTEMS, **change)
        ours, homo, metis = res["ours"], res["homogeneous"], res["metis"]
        plan = ours.best.plan
        depths = sorted({len(p.stages) for p in plan.pipelines}) if plan else []
        print(
            f"{label:<11} {model:<11} {_cell(ours)} {_cell(homo)} "
            f"{points_gap(ours.best.mfu, homo.best.mfu):+5.1f}p "
            f"{rel_gap(ours.best.mfu, homo.best.mfu):6.1%} {_cell(metis)} "
            f"{ratio(ours.best.mfu, metis.best.mfu):6.2f}x "
            f"{_cell(res['megatron'])} {_cell(res['galvatron'])}  "
            f"DP={len(plan.pipelines) if plan else 0} depth {depths}"
        )
        sys.stdout.flush()


def measure_scaling(
    max_plans: int, sizes: Sequence[int], model: str = "llama2-70b", batch_per_gpu: int = 4
) -> list[dict]:
    """Search wall and process (CPU) time, plans priced, MFU of our search and the MFU points
    its DP sync costs (`hexiscale_breakdown.breakdown`) on App. B's machine mix cut at each
    size (§5.3 Fig. 9), the global batch growing with the cluster. Process time is the steadier
    number on a shared machine."""
    rows = []
    for n in sizes:
        cluster = scaled_cluster(n)
        cost = job_cost(cluster, model, batch_per_gpu * n)
        cpu = time.process_time()
        r = hexiscale_search(cost, SearchConfig(max_plans=max_plans))
        rows.append(
            {
                "gpus": n,
                "machines": len(cluster.machines),
                "search_s": r.elapsed_s,
                "cpu_s": time.process_time() - cpu,
                "plans": r.evaluated,
                "dp": len(r.plan.pipelines),
                "mfu": r.estimate.mfu,
                "dp_sync_points": breakdown(cost, r.plan)["dp"],
            }
        )
    return rows


def scaling(max_plans: int, sizes: Sequence[int], model: str, batch_per_gpu: int) -> None:
    print(
        f"\nsearch time, {model}, {batch_per_gpu} samples per GPU per iteration, one core "
        f"(at most {max_plans} plans; a search stops earlier when a round brings no improvement)"
    )
    print(
        f"{'GPUs':>5} {'machines':>8} {'search s':>9} {'CPU s':>6} {'plans':>6} {'DP':>4} "
        f"{'MFU':>6}"
    )
    for r in measure_scaling(max_plans, sizes, model, batch_per_gpu):
        print(
            f"{r['gpus']:>5} {r['machines']:>8} {r['search_s']:>9.2f} {r['cpu_s']:>6.2f} "
            f"{r['plans']:>6} "
            f"{r['dp']:>4} {r['mfu']:6.1%}"
        )
        sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-plans", type=int, default=200, help="plans priced per search")
    p.add_argument("--quick", action="store_true", help="settings 1-3 only, no scaling runs")
    p.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=list(BATCHES),
        help="global batches (samples of 4096 tokens) every system is tried at",
    )
    p.add_argument("--sizes", type=int, nargs="*", default=[64, 128, 240, 320])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: setting 1 with Llama-2 7B at batch 128, 5 plans a search, one "
        "scaling size (64 GPUs)",
    )
    args = p.parse_args()
    if args.smoke:
        args.max_plans, args.batches, args.sizes = 5, [128], [64]
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores\n")
    cases = [c for c in CASES if not args.quick or "App" not in c[0]]
    cases = cases[:1] if args.smoke else cases
    t0 = time.perf_counter()
    results = compare(args.max_plans, args.batches, cases)
    by_batch_table(results, args.batches)
    verdicts(results)
    paper_cases = [c for c in cases if "App" not in c[0]]
    for name in VARIANTS:
        variant(name, args.max_plans, args.batches, paper_cases)
    if args.smoke:
        scaling(args.max_plans, args.sizes, "llama2-70b", 4)
    elif not args.quick:
        scaling(max(args.max_plans, 1000), args.sizes, "llama2-70b", 4)
    load = os.getloadavg()
    print(
        f"\ntotal {time.perf_counter() - t0:.0f} s; load average now {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f}"
    )


if __name__ == "__main__":
    main()
