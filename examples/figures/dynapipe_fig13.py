"""DynaPipe Fig. 13: throughput vs maximum sequence length, GPT and T5 on 4-32 GPUs
(dynapipe.txt §8.1), Table 1's model for each GPU count, 65,536-token global batches.

Each method gets the paper's grid search over power-of-two TP (within a node) x PP x DP,
screened on the first global batch of each point, the best three run on every batch;
"baseline (c)" is the baseline on DynaPipe's
layout (the paper's MLM+DS (c)). Baseline: packing for GPT, fixed-size padding for T5 (our
packing is decoder-only); micro-batch size grid searched, 1F1B.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig13")

from examples.figures._common import PaperFigure, start, write_outputs
from examples.figures._dynapipe import scaling_point
from examples.figures._scaling import oom_points, plot_scaling, summary

FIGURE = PaperFigure(
    "dynapipe_fig13", "DynaPipe", "Fig. 13", "throughput vs max sequence length (A100-40GB)"
)
MAX_SEQLENS = (512, 1024, 2048, 4096, 8192)
GPUS = (4, 8, 16, 32)
TOKENS = 65536


# Why T5 runs out of memory at long lengths (measured with the planner's own error messages).
T5_OOM = (
    " Our T5 cost model materialises attention scores (no flash attention): on T5 5.5B / 4 GPUs "
    "at 8,192 tokens one 8,133-token sample alone needs 14.2 GiB of activations on TP4 even "
    "with full recomputation, 12.2 GiB being left after weights and optimiser state, so "
    "neither method fits that batch."
)


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    gpus = (4,) if run.quick else GPUS
    lens = (512, 2048) if run.quick else MAX_SEQLENS
    iterations, tokens = (1, 16384) if run.quick else (4, TOKENS)
    rows = [
        row
        for family in ("gpt", "t5")
        for g in gpus
        for max_len in lens
        for row in scaling_point(family, g, max_len, tokens, iterations)
    ]
    fig = plot_scaling(run, rows, "max_seqlen", "max sequence length (tokens)")
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"SYNTHETIC FLAN-like lengths, {tokens:,}-token global batches, {iterations} "
            "iterations per point, A100-40GB (8 per node), Table 1's models (GPT 3.35B/6.7B/"
            "13B/29B, T5 5.5B/11B/22B/44B on 4/8/16/32 GPUs), analytic cost model, "
            "recomputation chosen per iteration."
        ),
        paper=(
            "§8.1, Fig. 13: MLM+DS's throughput \"decreases rapidly as maximum sequence length "
            'scales up" while DynaPipe\'s decrease "is much less"; on T5 (16 and 32 GPUs) '
            "DynaPipe scales to longer sequences than the baselines, and MLM+DS on DynaPipe's "
            "layout (MLM+DS (c)) often under-performs. The abstract reports up to 4.39x higher "
            "training throughput than packing-based baselines."
        ),
        ours=summary(rows, "max_seqlen"),
        differences=(
            "Our baselines are priced by the same analytic cost model with block-diagonal "
            "attention for packed rows (only within-sample attention), which is kinder to "
            "packing than MLM+DS's full-row attention, so the GPT gaps are smaller than the "
            "paper's, and DynaPipe's plans may hold packed rows themselves (the packing baseline's "
            "rows whole, or a DP micro-batch's samples packed), so on the same layout DynaPipe "
            "is never predicted slower than packing. T5's baseline is fixed-size padding. "
            "Layouts are screened on one batch per point and the best three run on all of "
            "them; the data is SYNTHETIC; times are predicted, not measured. "
            "Out of memory (the layout chosen fails on a later batch "
            "under every recomputation mode): "
            + oom_points(rows, "max_seqlen")
            + "."
            + (T5_OOM if any(r["oom"] and r["family"] == "t5" for r in rows) else "")
        ),
    )


if __name__ == "__main__":
    main()
