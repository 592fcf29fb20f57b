"""HexiScale Fig. 10: our maximum MFU against Metis-style and Galvatron-style on heterogeneous
setting 3 (Llama 30B) and on App. B's 240-GPU cluster (Llama 30B, Llama-2 70B) (seed
hexiscale.txt §5.4).

Each bar is `benchmarks/hexiscale_settings.max_mfu_over_batches` (imported): the system's best
MFU over the same global batches, every batch priced by one cost model for all systems.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hexiscale_fig10")

from benchmarks.hexiscale_settings import BATCHES, CLUSTERS, max_mfu_over_batches, ratio
from dynapipe_planner.devices import load_cluster
from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures._hexiscale import COLORS, LABELS

FIGURE = PaperFigure(
    "hexiscale_fig10", "HexiScale", "Fig. 10", "vs Metis-style and Galvatron-style"
)
SYSTEMS = ("ours", "metis", "galvatron")
CASES = (
    ("setting 3", "hexiscale_setting3.yaml", "llama-30b"),
    ("App. B, 240 GPUs", "hexiscale_appb_240.yaml", "llama-30b"),
    ("App. B, 240 GPUs", "hexiscale_appb_240.yaml", "llama2-70b"),
)
# §5.4: (our MFU over Metis's, over Galvatron's) per case; None where the paper gives none.
PAPER = {0: (1.6, None), 1: (1.6, 2.7), 2: (1.9, 3.3)}


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    cases, batches = (CASES[:1], (256,)) if run.quick else (CASES, BATCHES)
    rows = []
    for label, file, model in cases:
        found = max_mfu_over_batches(load_cluster(CLUSTERS / file), model, batches, systems=SYSTEMS)
        for system in SYSTEMS:
            r = found[system]
            rows.append(
                {
                    "cluster": label,
                    "model": model,
                    "system": system,
                    "max_mfu": round(r.best.mfu, 4),
                    "batch": r.batch or "",
                    "ours_over_this": round(ratio(found["ours"].best.mfu, r.best.mfu), 3),
                    "layout": r.best.layout[:160],
                }
            )
    fig, axes = subplots(run, ncols=len(cases), width=3.8 if len(cases) > 1 else 5.5, height=4.0)
    lines = []
    for i, (ax, (label, _, model)) in enumerate(zip(axes, cases, strict=True)):
        mine = [r for r in rows if (r["cluster"], r["model"]) == (label, model)]
        bars = ax.bar(
            [LABELS[r["system"]].replace(" (ours)", "") for r in mine],
            [100 * r["max_mfu"] for r in mine],
            color=[COLORS[r["system"]] for r in mine],
        )
        ax.bar_label(
            bars,
            [
                f"{100 * r['max_mfu']:.1f}%"
                + ("" if r["system"] == "ours" else f"\nours {r['ours_over_this']:.2f}x")
                for r in mine
            ],
            fontsize=8,
        )
        ax.set_ylabel("maximum MFU (%)")
        ax.set_ylim(0, 45)
        ax.set_title(f"{label}, {model}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
        got = {r["system"]: r for r in mine}
        metis_x, galv_x = PAPER[i]
        lines.append(
            f"- {label}, {model}: ours {got['ours']['max_mfu']:.1%} (batch "
            f"{got['ours']['batch']}), Metis-style {got['metis']['max_mfu']:.1%} (ours "
            f"{got['metis']['ours_over_this']:.2f}x; paper {metis_x}x), Galvatron-style "
            f"{got['galvatron']['max_mfu']:.1%} (ours {got['galvatron']['ours_over_this']:.2f}x"
            + (f"; paper {galv_x}x)." if galv_x else "; the paper gives no ratio here).")
        )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "`hexiscale_setting3.yaml` (56 GPUs) and `hexiscale_appb_240.yaml` (App. B Table 4: "
            "5 x 8 x 3090, 6 x 4 x 3090, 20 x 8 x 4090, 2 x 8 x A800; 0.7 GB/s between "
            f"machines); 4096-token samples, micro-batch 1, full recomputation; global batches "
            f"{', '.join(map(str, batches))} for every system, each bar its maximum; a bar's "
            "label gives its MFU and our MFU over it."
        ),
        paper=(
            "§5.4, Fig. 10 (left): on setting 3 Metis reaches 17.1% MFU, 1.6x lower than "
            "HexiScale (App. C Table 5: one pipeline of 8 stages, one per machine, in-machine "
            "DP). Fig. 10 (middle, right), 240 simulated GPUs: HexiScale is 1.6x and 1.9x "
            "Metis and 2.7x and 3.3x Galvatron for Llama 30B and Llama-2 70B; Metis's and "
            "Galvatron's searches take hours there."
        ),
        ours="\n".join(lines),
        differences=(
            "Metis-style and Galvatron-style are our approximations in our cost model "
            "(`hetero/baselines.py`), not the systems' own planners. Metis-style prices App. "
            "C's one-stage-per-machine pipeline with every uniform (TP, micro-batch) choice and "
            "balances layers to each stage's speed within memory, so on setting 3 it reaches "
            f"{next(r['max_mfu'] for r in rows if r['system'] == 'metis'):.1%} where the "
            "paper's Metis plan measured 17.1% (App. C's own Table 5 plan does not fit our "
            "memory model, `benchmarks/results/hexiscale_breakdown.txt`). Galvatron-style "
            "tries every symmetric TP / PP / DP with layers balanced by time under each stage's "
            "real memory, but not Galvatron's per-layer strategies; it is stronger than the "
            "paper's fine-tuned (DP, TP, PP) = (4, 2, 7) Galvatron, which may explain our lower "
            "ratios over it. Our network model shares each machine's link among concurrent "
            "transfers; under App. A's per-pair links Metis-style comes much closer to us on "
            "settings 1-3 (sensitivity table of `benchmarks/results/hexiscale_settings.txt`)."
        ),
    )


if __name__ == "__main__":
    main()
