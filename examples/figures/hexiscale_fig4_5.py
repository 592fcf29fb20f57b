"""HexiScale Figs. 4-5: maximum MFU of our plan, symmetric Megatron, Galvatron-style and
Metis-style on heterogeneous settings 1-3, and of the equal-FLOPS homogeneous A800 PCIe cluster
(seed hexiscale.txt §5.1; Llama-2 7B and 13B on settings 1-2 in Fig. 4, Llama 30B on setting 3
in Fig. 5).

Each bar is `benchmarks/hexiscale_settings.max_mfu_over_batches` (imported): the system's best
MFU over the same global batches, every batch priced by one cost model for all systems.
Crosses mark the paper's measured MFU (Table 3, "Real") for HexiScale and for the homogeneous
Ethernet cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hexiscale_fig4_5")

from benchmarks.hexiscale_settings import (
    BATCHES,
    CASES,
    CLUSTERS,
    SYSTEMS,
    max_mfu_over_batches,
    points_gap,
    ratio,
)
from dynapipe_planner.devices import load_cluster
from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures._hexiscale import COLORS, LABELS

FIGURE = PaperFigure(
    "hexiscale_fig4_5",
    "HexiScale",
    "Figs. 4-5",
    "maximum MFU, settings 1-3 vs equal-FLOPS A800",
)
ORDER = ("ours", "megatron", "galvatron", "metis", "homogeneous")
assert set(ORDER) == set(SYSTEMS)
# Table 3 (§5.3), measured MFU in %: (HexiScale on the setting, homogeneous over Ethernet).
PAPER_REAL = {
    ("setting 1", "llama2-7b"): (31.2, 41.1),
    ("setting 1", "llama2-13b"): (27.2, 39.5),
    ("setting 2", "llama2-7b"): (33.5, 41.1),
    ("setting 2", "llama2-13b"): (31.4, 39.5),
    ("setting 3", "llama-30b"): (27.5, 27.8),
}


def differences(rows: list[dict]) -> str:
    homo = [r["max_mfu"] for r in rows if r["system"] == "homogeneous"]
    mega3 = [r for r in rows if r["setting"] == "setting 3" and r["system"] == "megatron"]
    megatron = (
        f"Megatron fits memory on setting 3 in our model ({mega3[0]['layout']}, "
        f"{mega3[0]['max_mfu']:.1%}) where the paper's runs out of memory: our memory model "
        "(App. A Eq. 11 generalised) is not Megatron's allocator, and our symmetric layouts let "
        "stages differ by one layer when PP does not divide the layers, which stock Megatron's "
        "pipeline split does not. "
        if mega3 and mega3[0]["max_mfu"] > 0
        else ""
    )
    return (
        "Our numbers come from one analytic cost model for every system, not from runs. Our "
        "network model lets concurrent transfers that leave a machine share its link, where "
        "App. A's Eq. 4-5 give every device pair the whole link; that choice moves the gaps by "
        "several points either way (sensitivity table of "
        "`benchmarks/results/hexiscale_settings.txt`: under App. A's network the gaps are "
        "2.1-6.4 points and Metis-style comes within 1.03-1.23x of us). Our equal-FLOPS A800 "
        f"reference reaches {min(homo):.1%}-{max(homo):.1%} where the paper's Ethernet runs "
        "measured 27.8-41.1%; it is planned by the same search, and our consumer-GPU plans "
        "lose to it mostly in pipeline sends and bubbles "
        "(`benchmarks/results/hexiscale_breakdown.txt`). "
        + megatron
        + "Galvatron-style is symmetric degrees with time-balanced layers, not Galvatron's "
        "per-layer strategy search; Metis-style is App. C's one-pipeline layout with every "
        "uniform (TP, micro-batch) choice priced by our model, not Metis's own planner."
    )


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    cases = [c for c in CASES if c[0].startswith("setting")]
    batches = BATCHES
    if run.quick:
        cases, batches = [c for c in cases if c[0] == "setting 2"][:1], (128,)
    rows = []
    for label, file, model in cases:
        found = max_mfu_over_batches(load_cluster(CLUSTERS / file), model, batches)
        for system in ORDER:
            r = found[system]
            rows.append(
                {
                    "setting": label,
                    "model": model,
                    "system": system,
                    "max_mfu": round(r.best.mfu, 4),
                    "batch": r.batch or "",
                    "batches_tried": " ".join(map(str, batches)),
                    "layout": r.best.layout[:160],
                }
            )
    fig4 = [c for c in cases if c[0] != "setting 3"]
    fig5 = [c for c in cases if c[0] == "setting 3"]
    panels = [(p, t) for p, t in ((fig4, "Fig. 4: settings 1-2"), (fig5, "Fig. 5: setting 3")) if p]
    fig, axes = subplots(run, ncols=len(panels), width=6.0 if len(panels) > 1 else 6.5, height=4.4)
    for ax, (group, title) in zip(axes, panels, strict=True):
        width = 0.8 / len(ORDER)
        for k, system in enumerate(ORDER):
            xs, ys = [], []
            for i, (label, _, model) in enumerate(group):
                r = next(
                    r
                    for r in rows
                    if (r["setting"], r["model"], r["system"]) == (label, model, system)
                )
                xs.append(i + (k - (len(ORDER) - 1) / 2) * width)
                ys.append(100 * r["max_mfu"])
            ax.bar(xs, ys, width, color=COLORS[system], label=LABELS[system])
        for i, (label, _, model) in enumerate(group):
            ours_real, homo_real = PAPER_REAL[(label, model)]
            x_ours = i - (len(ORDER) - 1) / 2 * width
            x_homo = i + (len(ORDER) - 1) / 2 * width
            ax.plot(
                [x_ours, x_homo], [ours_real, homo_real], "kx", ms=7, label="paper, Table 3 (real)"
            )
        ax.set_xticks(
            range(len(group)), [f"{label}\n{model}" for label, _, model in group], fontsize=8
        )
        ax.set_ylabel("maximum MFU (%)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        handles, names = ax.get_legend_handles_labels()
        keep = dict(zip(names, handles, strict=True))
        ax.legend(keep.values(), keep.keys(), fontsize=7, loc="upper left", ncol=2)
        ax.set_ylim(0, 60)
        ax.set_xlim(-0.6, len(group) - 0.4)

    lines, gaps = [], []
    for label, _, model in cases:
        got = {r["system"]: r for r in rows if (r["setting"], r["model"]) == (label, model)}
        ours, homo = got["ours"]["max_mfu"], got["homogeneous"]["max_mfu"]
        gaps.append(points_gap(ours, homo))
        lines.append(
            f"- {label}, {model}: ours {ours:.1%} (batch {got['ours']['batch']}), homogeneous "
            f"{homo:.1%}: gap {gaps[-1]:+.1f} MFU points ({(homo - ours) / homo:.1%} relative); "
            f"{ratio(ours, got['metis']['max_mfu']):.2f}x Metis-style, "
            f"{ratio(ours, got['galvatron']['max_mfu']):.2f}x Galvatron-style, "
            f"{ratio(ours, got['megatron']['max_mfu']):.2f}x Megatron. Paper (Table 3, real): "
            f"{PAPER_REAL[(label, model)][0]}% vs {PAPER_REAL[(label, model)][1]}%."
        )
    lines.append(
        f"- Gap over these cases: minimum {min(gaps):+.1f}, mean "
        f"{sum(gaps) / len(gaps):+.1f} MFU points."
    )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "`examples/clusters/hexiscale_setting{1,2,3}.yaml` (§5.1; 0.7 GB/s between "
            "machines), `llama2-7b`, `llama2-13b`, `llama-30b`, 4096-token samples, "
            f"micro-batch 1, full recomputation; global batches {', '.join(map(str, batches))} "
            "for every system, each bar its maximum. The homogeneous reference is the A800 PCIe "
            "cluster of equal peak FLOPS in whole 8-GPU machines on the same network, planned by "
            "our search and by Megatron (the better); Galvatron-style and Metis-style are "
            "approximations in our cost model (`hetero/baselines.py`)."
        ),
        paper=(
            '§5.1: HexiScale\'s maximum MFU is within a minimum "MFU percentage gap of 0.3%" '
            "and an average of 3.5% (percentage points) of Megatron / Galvatron on the "
            "homogeneous A800 PCIe Ethernet clusters; up to 2.5x and on average 2.1x "
            "Galvatron's maximum MFU; Megatron runs out of memory on setting 3 (Fig. 5). "
            "Table 3 (real / simulated MFU, %): 7B homogeneous Ethernet 41.1 / 42.2, setting 1 "
            "31.2 / 32.3, setting 2 33.5 / 33.8; 13B homogeneous 39.5 / 41.0, setting 1 27.2 / "
            "28.6, setting 2 31.4 / 31.8; 30B homogeneous 27.8 / 28.6, setting 3 27.5 / 28.0. "
            "(Read against Table 3, the gaps are 0.3-12.3 points, not 0.3-3.5.)"
        ),
        ours="\n".join(lines),
        differences=differences(rows),
    )


if __name__ == "__main__":
    main()
