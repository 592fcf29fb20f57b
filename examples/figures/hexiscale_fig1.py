"""HexiScale Fig. 1: the §3.1 case study, Llama-2 13B on 3 x A800 (NVLink), 3 x RTX 4090 and
2 x RTX 3090 (PCIe) over 1 GB/s Ethernet, global batch 24, micro-batch 1, full activation
recomputation (seed hexiscale.txt §3.1, §3.3).

Megatron's three plans the paper lists ((DP, TP, PP) = (1, 1, 8), (1, 2, 4), (2, 1, 4); Megatron's
rank order, layers split evenly, `baselines.symmetric_plan`) and our search's plan, all priced
by `hetero.cost`; each iteration is split into compute, bubbles and communication with
`benchmarks/hexiscale_breakdown.breakdown` (via `_hexiscale.time_split`).
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hexiscale_fig1")

from benchmarks.hexiscale_breakdown import describe
from benchmarks.hexiscale_settings import CLUSTERS, job_cost
from dynapipe_planner.devices import load_cluster
from dynapipe_planner.hetero.baselines import symmetric_plan
from dynapipe_planner.hetero.search import SearchConfig, hexiscale_search
from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures._hexiscale import PARTS, time_split

FIGURE = PaperFigure(
    "hexiscale_fig1",
    "HexiScale",
    "Fig. 1",
    "case study, Megatron's plans vs our asymmetric plan (Llama-2 13B, 8 GPUs)",
)
# (label, TP, PP, DP) of §3.1's Megatron plans.
MEGATRON_PLANS = (
    ("Megatron plan 1\n(DP1,TP1,PP8)", 1, 8, 1),
    ("Megatron plan 2\n(DP1,TP2,PP4)", 2, 4, 1),
    ("Megatron plan 3\n(DP2,TP1,PP4)", 1, 4, 2),
)
PART_COLORS = {"compute": "tab:blue", "bubble": "tab:orange", "communication": "tab:purple"}


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    cluster = load_cluster(CLUSTERS / "hexiscale_case_study.yaml")
    cost = job_cost(cluster, "llama2-13b", 24)
    plans = [(label, symmetric_plan(cost, tp, pp, dp)) for label, tp, pp, dp in MEGATRON_PLANS]
    ours = hexiscale_search(cost, SearchConfig(max_plans=40 if run.quick else 200))
    plans.append(("HexiScale (ours)", ours.plan))
    rows = []
    for label, plan in plans:
        est = cost.estimate(plan)
        split = time_split(cost, plan)
        rows.append(
            {
                "plan": label.replace("\n", " "),
                "iteration_s": round(est.iteration_s, 3),
                **{f"{p}_s": round(split[p], 3) for p in PARTS},
                "dp_sync_s": round(est.dp_sync_s, 3),
                "mfu": round(est.mfu, 4),
                "fits_memory": est.fits,
                "layout": describe(cost, plan),
            }
        )
    fig, axes = subplots(run, ncols=1, width=8.0, height=4.6)
    ax = axes[0]
    names = [label for label, _ in plans]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        values = [r[f"{part}_s"] for r in rows]
        ax.bar(names, values, bottom=bottom, label=part, color=PART_COLORS[part])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(rows):
        tag = f"{r['iteration_s']:.1f} s" + ("" if r["fits_memory"] else "\n(OOM in our model)")
        ax.text(i, r["iteration_s"], tag, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("iteration time (s), split per device\nweighted by peak FLOPS")
    ax.set_ylim(0, max(r["iteration_s"] for r in rows) * 1.25)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")

    best_megatron = min((r for r in rows[:-1]), key=lambda r: r["iteration_s"])
    # §3.1's two communication estimates, from the same cost model: TP per layer over all 24
    # micro-batches for plan 2's groups (Ethernet-crossing and NVLink), DP sync of plan 3.
    tp_layer = [
        cost.tp_comm_s(s.devices, cost.job.recompute) * 24 for s in plans[1][1].pipelines[0].stages
    ]
    mine = rows[-1]
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "`examples/clusters/hexiscale_case_study.yaml` (§3.1: machine A 3 x A800-80G NVLink "
            "200 GB/s, B 3 x RTX 4090 PCIe 32 GB/s, C 2 x RTX 3090 PCIe 16 GB/s, 1 GB/s "
            "Ethernet), `llama2-13b`, 24 samples of 4096 tokens, micro-batch 1, full "
            "recomputation. Bars split the iteration of the average device (weighted by peak "
            "FLOPS) into compute (model FLOPs, recomputation, kernel inefficiency), bubble "
            "(fill / drain, waiting on the slowest stage or pipeline) and communication (TP, "
            "pipeline sends, DP sync)."
        ),
        paper=(
            "§3.1: plan 1 has bubbles over 22% of the pipeline time and is bounded by machine B; "
            "plan 2 pays an estimated 1.88 s of inter-machine TP communication per layer at "
            "batch 24 (0.01 s over NVLink); plan 3 (four stages of 10 layers, Fig. 1 top) is "
            "the potential good one, and its DP communication for 10 layers on machine B is "
            "estimated at 9.90 s. §3.3 (Fig. 1 bottom): HexiScale's two pipelines give TP to "
            "machine A, fewer layers to B and C, batch sizes 40% apart (7% apart in time), DP "
            "communication for 5 layers in 5.07 s, and an iteration of 25.55 s, 1.6x faster "
            "than Megatron."
        ),
        ours="\n".join(
            [
                f"- {r['plan']}: {r['iteration_s']:.2f} s (compute {r['compute_s']:.2f}, bubble "
                f"{r['bubble_s']:.2f}, communication {r['communication_s']:.2f}; DP sync "
                f"{r['dp_sync_s']:.2f} s), MFU {r['mfu']:.1%}"
                + ("" if r["fits_memory"] else ", does not fit our memory model")
                + f"; {r['layout']}"
                for r in rows
            ]
            + [
                f"- Ours is {best_megatron['iteration_s'] / mine['iteration_s']:.1f}x faster "
                f"than the fastest of Megatron's three plans ({best_megatron['plan']}).",
                f"- Plan 2's TP communication per layer at batch 24: {max(tp_layer):.2f} s for "
                f"the group that crosses Ethernet, {min(tp_layer):.3f} s over NVLink (paper: "
                f"1.88 s and 0.01 s). Plan 3's DP sync: {rows[2]['dp_sync_s']:.2f} s (paper: "
                "9.90 s for machine B's 10 layers).",
            ]
        ),
        differences=(
            "Every Megatron plan here needs more memory than a 24 GB card holds in our model "
            "(bf16 weights, fp32 gradients and Adam states, the states sharded over at most two "
            "pipelines), so "
            "`megatron_symmetric` finds no feasible plan; we price them anyway, as the paper's "
            "case study prices them by simulation. Our plan differs from the paper's Fig. 1 "
            "bottom: with 24 micro-batches a single 8-stage pipeline (TP 1, layers balanced "
            "to each GPU's speed) avoids DP sync over 1 GB/s altogether, which our cost model "
            "prices lower than two pipelines; the paper's exact Fig. 1 layout is only drawn, "
            "not listed, so we do not price it. Our per-layer TP cost over Ethernet (plan 2) "
            "counts 12 ring phases per micro-batch (forward, backward and the recomputed "
            "forward, App. A Eq. 3), hence the larger figure than the paper's 1.88 s; our DP "
            "sync for plan 3 shares machine B's link among its leaving devices "
            "(`hetero/cost.py`); the paper's estimates use its own per-pair constants."
        ),
    )


if __name__ == "__main__":
    main()
