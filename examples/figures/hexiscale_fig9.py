"""HexiScale Fig. 9: search time and estimated MFU of our plan against cluster size, 64 to 320
GPUs of App. B's machine mix, Llama-2 70B (seed hexiscale.txt §5.3).

The measurement is `benchmarks/hexiscale_settings.measure_scaling` (imported): one search per
size on one core (wall clock), 4 samples of 4096 tokens per GPU per iteration, the search's
default stopping rule (a round without improvement) under a 60 s budget; wall and process
(CPU) time, the latter steadier on a shared machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hexiscale_fig9")

from benchmarks.hexiscale_settings import measure_scaling
from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure(
    "hexiscale_fig9", "HexiScale", "Fig. 9", "search time and estimated MFU vs cluster size"
)
SIZES = (64, 128, 192, 256, 320)
MODEL, PER_GPU = "llama2-70b", 4


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    sizes = SIZES[:1] if run.quick else SIZES
    load = os.getloadavg()[0]
    rows = [
        {
            **r,
            **{k: round(r[k], 3) for k in ("search_s", "cpu_s")},
            "mfu": round(r["mfu"], 4),
            "dp_sync_points": round(r["dp_sync_points"], 1),
        }
        for r in measure_scaling(60.0, sizes, MODEL, PER_GPU)
    ]
    fig, axes = subplots(run, ncols=2, width=4.8, height=3.8)
    gpus = [r["gpus"] for r in rows]
    axes[0].plot(gpus, [r["search_s"] for r in rows], "o-", color="tab:red", label="ours, wall")
    axes[0].plot(gpus, [r["cpu_s"] for r in rows], "s--", color="tab:red", label="ours, CPU")
    axes[0].axhline(120, color="gray", ls="--", label="paper: < 2 min (12 cores)")
    axes[0].set_ylabel("search time on one core (s)")
    axes[0].set_yscale("log")
    axes[1].plot(gpus, [100 * r["mfu"] for r in rows], "o-", color="tab:red", label="ours")
    axes[1].set_ylabel("estimated MFU of the plan (%)")
    axes[1].set_ylim(0, 40)
    for ax in axes:
        ax.set_xlabel("GPUs (App. B machine mix)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"`{MODEL}`, {PER_GPU} samples of 4096 tokens per GPU per iteration, micro-batch 1, "
            "full recomputation; clusters are App. B's machines (8 x 3090 : 4 x 3090 : 8 x 4090 "
            ": 8 x A800 = 5 : 6 : 20 : 2) interleaved and cut at each size "
            "(`benchmarks/hexiscale_settings.scaled_cluster`), 0.7 GB/s between machines. "
            f"Timed on the shared 2-core machine (1-minute load average {load:.1f} at the "
            "start), so the times are noisy."
        ),
        paper=(
            "§5.3, Fig. 9: 50 iterations (where the algorithm generally converges) on a 12-core "
            "CPU for 64 to 320 GPUs stay under two minutes; the runtime does not depend on the "
            "model size; the simulated MFU stays stable as the cluster grows."
        ),
        ours="\n".join(
            f"- {r['gpus']} GPUs ({r['machines']} machines): {r['search_s']:.2f} s wall, "
            f"{r['cpu_s']:.2f} s CPU, "
            f"{r['plans']} plans priced, D_dp = {r['dp']}, estimated MFU {r['mfu']:.1%}, "
            f"DP sync {r['dp_sync_points']:.1f} MFU points."
            for r in rows
        ),
        differences=(
            "Our search stops at the first round without improvement, after a few tens of "
            "plans rather than a fixed 50 iterations, and phase 2 runs once per group of "
            "pipelines that are identical up to renaming machines; both keep it to seconds on "
            "one core. Our MFU falls with size where the paper's stays stable, with the batch "
            "fixed at 4 samples per GPU (the paper does not state its batch here). The drop is "
            "DP sync (MFU points per size under 'What we got'): Llama-2 70B has 80 layers, so a "
            "pipeline holds at most 80 stages and larger clusters need several pipelines whose "
            "gradient sync crosses the 0.7 GB/s machine links, which our model lets every "
            "transfer leaving a machine share (App. A prices each device pair as if it owned "
            "the link)."
        ),
    )


if __name__ == "__main__":
    main()
