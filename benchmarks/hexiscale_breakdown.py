"""Where a HexiScale plan's iteration goes (seed hexiscale.txt App. A Eq. 7-10), in MFU points.

Each device's share of one iteration is split into: model FLOPs at its peak (the MFU),
recomputation (what the stage's mode computes twice), kernel inefficiency (the analytic model's
time over FLOPs / peak), TP communication (Eq. 3), p2p sends (Eq. 5), steady-state waiting for
the pipeline's slowest stage, fill / drain bubbles (Eq. 9's first sum), waiting for a slower
pipeline (Eq. 10's max) and DP sync (Eq. 7). Terms are weighted by the device's peak FLOPS,
so they sum to 100 points of the cluster's peak.

Rows: our plan and the equal-FLOPS A800 reference for settings 1-2 (Llama-2 7B) and 3
(Llama 30B) at the benchmark's batches; the same search with memory x100 (how much depth
memory forces); with recomputation chosen per stage (ours and the A800 reference); the same
search with App. A's network as written (`share_links=False`); and
the paper's Table 2 plan for setting 3 built by hand and priced by our model both ways.

    python -m benchmarks.hexiscale_breakdown
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dataclasses import replace
from pathlib import Path

from dynapipe_planner.devices import load_cluster
from dynapipe_planner.hetero.baselines import _metis_price, equal_flops_a800, metis_style
from dynapipe_planner.hetero.cost import HeteroCostModel, TrainingJob
from dynapipe_planner.hetero.layer_assign import assign_micro_batches
from dynapipe_planner.hetero.layout import HeteroPipeline, HeteroPlan, HeteroStage
from dynapipe_planner.hetero.search import SearchConfig, hexiscale_search
from dynapipe_planner.model_spec import MODEL_PRESETS

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
TERMS = ("mfu", "recompute", "ineff", "tp", "p2p", "steady", "bubble", "straggle", "dp")


def breakdown(cost: HeteroCostModel, plan: HeteroPlan) -> dict[str, float]:
    """MFU points per term (see the module docstring); they sum to 100."""
    est = cost.estimate(plan)
    job, m, c = cost.job, cost.job.model, cost.cluster
    h, a, s = m.hidden_size, m.attention_width, job.seqlen
    layer_flops = 3.0 * s * job.layer_flops_per_token() * job.micro_batch_size
    # What each mode computes again in the backward pass: the whole forward, or (selective)
    # the attention scores and their product with the values.
    recomputed = {"full": layer_flops / 3, "selective": 4.0 * s * s * a * job.micro_batch_size}
    out_flops = 3.0 * s * 2 * h * m.vocab_size * job.micro_batch_size
    acc = dict.fromkeys(TERMS, 0.0)
    slowest = max(est.pipeline_s)
    for p, costs, p_time in zip(plan.pipelines, est.stages, est.pipeline_s, strict=True):
        busy = [x.busy_s for x in costs]
        mb = p.micro_batches
        for j, (st, x) in enumerate(zip(p.stages, costs, strict=True)):
            tp_s = st.num_layers * cost.tp_comm_s(st.devices, x.recompute)
            compute = x.forward_s + x.backward_s - tp_s
            flops = st.num_layers * layer_flops + (out_flops if j == len(p.stages) - 1 else 0)
            for d in st.devices:
                peak = float(c.peak_flops[d])
                useful = mb * flops / st.tp / peak
                recompute = mb * st.num_layers * recomputed.get(x.recompute, 0.0) / st.tp / peak
                terms = {
                    "mfu": useful,
                    "recompute": recompute,
                    "ineff": mb * compute - useful - recompute,
                    "tp": mb * tp_s,
                    "p2p": mb * (x.send_forward_s + x.send_backward_s),
                    "steady": (mb - 1) * (max(busy) - busy[j]),
                    "bubble": sum(busy) - busy[j],
                    "straggle": slowest - p_time,
                    "dp": est.dp_sync_s,
                }
                for k, v in terms.items():
                    acc[k] += peak * v
    norm = c.total_peak_flops * est.iteration_s
    return {k: 100 * v / norm for k, v in acc.items()}


def describe(cost: HeteroCostModel, plan: HeteroPlan) -> str:
    c = cost.cluster
    text = "; ".join(
        "+".join(f"{c.gpu(s.devices[0]).name}x{s.tp}:{s.num_layers}" for s in p.stages)
        + f" (m={p.micro_batches})"
        for p in plan.pipelines[:2]
    )
    more = len(plan.pipelines) - 2
    return f"DP={len(plan.pipelines)}: {text}" + (f" +{more} more" if more > 0 else "")


def row(label: str, cost: HeteroCostModel, plan: HeteroPlan) -> None:
    b = breakdown(cost, plan)
    est = cost.estimate(plan)
    oom = "" if est.fits else f"  OUT OF MEMORY: {est.oom[0]}"
    print(
        f"{label:<30} {est.iteration_s:7.2f}s "
        + " ".join(f"{b[k]:5.1f}" for k in TERMS)
        + f"  dp {est.dp_sync_s:6.2f}s{oom}"
    )
    print(f"{'':<30} {describe(cost, plan)}")


def more_memory(cost: HeteroCostModel, factor: float = 100.0) -> HeteroCostModel:
    c = cost.cluster
    machines = tuple(
        replace(mc, memory_limit_bytes=int(mc.memory_limit_bytes * factor)) for mc in c.machines
    )
    return HeteroCostModel(replace(c, machines=machines), cost.job, share_links=cost.share_links)


def table2_plan(cost: HeteroCostModel) -> HeteroPlan:
    """§5.3 Table 2 (Llama 30B, setting 3) on `hexiscale_setting3.yaml`'s device ids (3090 x8:
    0-7, 3090 x4: 8-11 and 12-15, 4090 x8: 16-47, A800: 48-55). Llama 30B's 52 heads do not
    split 8 ways, so pipeline 0's one TP=8 stage of 60 layers is two TP=4 stages of 30 here.
    Micro-batches go to the pipelines so they finish together, as the planner does."""

    def r(a: int, n: int) -> tuple[int, ...]:
        return tuple(range(a, a + n))

    spec = [
        [(r(48, 4), 30), (r(52, 4), 30)],
        [(r(16, 4), 18), (r(20, 4), 18), (r(24, 4), 18), (r(8, 2), 6)],
        [(r(28, 4), 18), (r(32, 4), 18), (r(36, 4), 18), (r(10, 2), 6)],
        [(r(40, 4), 18), (r(44, 4), 18)] + [(r(a, 2), 4) for a in (0, 2, 4, 6, 12, 14)],
    ]
    pipes = []
    for stages in spec:
        start, out = 0, []
        for devices, n in stages:
            out.append(HeteroStage(devices, (start, start + n)))
            start += n
        pipes.append(HeteroPipeline(tuple(out), 1))
    job = cost.job
    plan = HeteroPlan(pipes, job.micro_batch_size, job.seqlen, job.model.name, cost.cluster.name)
    costs = cost.plan_stage_costs(plan)
    profiles = [(sum(x.busy_s for x in p), max(x.busy_s for x in p)) for p in costs]
    micro = assign_micro_batches(profiles, job.num_micro_batches)
    assert micro is not None
    plan.pipelines = [replace(p, micro_batches=k) for p, k in zip(pipes, micro, strict=True)]
    return plan


def metis_table5(cost: HeteroCostModel) -> str:
    """App. C Table 5 (Metis on setting 3): one stage per machine, (DP, TP) = (machine, 1),
    layers 20 / 8 x4 / 4 / 2 / 2, a micro-batch of 8 (one sample per A800 replica), priced by
    our model without its memory check; then whether each stage would fit and what our
    Metis-style search (which may pick TP > 1) finds."""
    c, job = cost.cluster, cost.job
    machines = sorted(c.machines, key=lambda m: (-m.gpu.peak_flops * m.count, m.first_device))
    layers = [20, 8, 8, 8, 8, 4, 2, 2]
    dps = [m.count for m in machines]
    priced = _metis_price(cost, machines, [1] * len(machines), dps, 8, layers)
    assert priced is not None
    mfu = job.flops_per_sample() * job.global_batch / (priced[0] * c.total_peak_flops)
    over = []
    for j, (m, n) in enumerate(zip(machines, layers, strict=True)):
        replica = HeteroCostModel(c, replace(job, micro_batch_size=8 // m.count * 1 or 1))
        first, last = j == 0, j == len(machines) - 1
        options = replica.stage_options((m.first_device,), first, last, 8 - j, m.count)
        capacity = max(o.capacity for o in options)
        if n > capacity:
            over.append(f"{m.name}: {n} layers > {capacity}")
    search = metis_style(cost)
    return (
        f"Table 5 plan {mfu:.1%} ({'fits' if not over else 'out of memory: ' + ', '.join(over)}); "
        f"our Metis-style search {search.mfu:.1%} ({search.layout[:60]}...)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CI's check: setting 3, 5 plans a search")
    args = p.parse_args()
    print(f"{'plan':<30} {'iter':>8} " + " ".join(f"{k[:5]:>5}" for k in TERMS))
    cases = [
        ("hexiscale_setting1.yaml", "llama2-7b", 128),
        ("hexiscale_setting2.yaml", "llama2-7b", 128),
        ("hexiscale_setting3.yaml", "llama-30b", 256),
    ]
    config = SearchConfig()
    if args.smoke:  # setting 3 runs every row kind, the paper's Table 2 plan too
        cases, config = cases[2:], SearchConfig(max_plans=5)
    for file, model, batch in cases:
        cluster = load_cluster(CLUSTERS / file)
        print(f"\n== {cluster.name}, {model}, {batch} samples of 4096 tokens")
        for share in (True, False):
            cost = HeteroCostModel(
                cluster, TrainingJob(MODEL_PRESETS[model], global_batch=batch), share_links=share
            )
            tag = "" if share else " [App. A links]"
            row("ours" + tag, cost, hexiscale_search(cost, config).plan)
            homo = equal_flops_a800(cost)
            row("homogeneous A800" + tag, homo, hexiscale_search(homo, config).plan)
            if share:
                free = more_memory(cost)
                row("ours, memory x100", free, hexiscale_search(free, config).plan)
                auto = HeteroCostModel(cluster, replace(cost.job, recompute="auto"))
                row("ours, recompute per stage", auto, hexiscale_search(auto, config).plan)
                homo_auto = equal_flops_a800(auto)
                row("homogeneous, per stage", homo_auto, hexiscale_search(homo_auto, config).plan)
            if "setting3" in file:
                for b in (batch, 1024):
                    job = TrainingJob(MODEL_PRESETS[model], global_batch=b)
                    priced = HeteroCostModel(cluster, job, share_links=share)
                    row(f"paper Table 2, batch {b}{tag}", priced, table2_plan(priced))
                    print(f"{'':<30} Metis, App. C: {metis_table5(priced)}")
    print(
        "\nterms in MFU points of the cluster's peak (sum 100): mfu = model FLOPs at peak; "
        "recompute = what recomputation computes twice; ineff = analytic kernel time over FLOPs / "
        "peak; tp = Eq. 3; p2p = Eq. 5 sends; steady = 1F1B waiting on the slowest stage; "
        "bubble = fill and drain; straggle = waiting on a slower pipeline; dp = Eq. 7 sync"
    )


if __name__ == "__main__":
    main()
