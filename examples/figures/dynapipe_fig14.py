"""DynaPipe Fig. 14: throughput vs global batch size, GPT and T5 on 4-32 GPUs
(dynapipe.txt §8.2), Table 1's model for each GPU count, maximum sequence length 2048.

Each method gets the paper's grid search over power-of-two TP (within a node) x PP x DP,
screened on the first global batch of each point, the best three run on every batch;
"baseline (c)" is the baseline on DynaPipe's
layout (the paper's MLM+DS (c)). Baseline: packing for GPT, fixed-size padding for T5 (our
packing is decoder-only); micro-batch size grid searched, 1F1B.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig14")

from examples.figures._common import PaperFigure, start, write_outputs
from examples.figures._dynapipe import scaling_point
from examples.figures._scaling import plot_scaling, summary

FIGURE = PaperFigure(
    "dynapipe_fig14", "DynaPipe", "Fig. 14", "throughput vs global batch size (A100-40GB)"
)
TOKENS = (16384, 32768, 65536, 131072)
GPUS = (4, 8, 16, 32)
MAX_SEQLEN = 2048


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    gpus = (4,) if run.quick else GPUS
    sizes = (8192, 16384) if run.quick else TOKENS
    iterations = 1 if run.quick else 4
    rows = [
        row
        for family in ("gpt", "t5")
        for g in gpus
        for tokens in sizes
        for row in scaling_point(family, g, MAX_SEQLEN, tokens, iterations)
    ]
    fig = plot_scaling(run, rows, "global_batch_tokens", "global batch (tokens)")
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"SYNTHETIC FLAN-like lengths truncated at {MAX_SEQLEN}, {iterations} "
            "iterations per point, A100-40GB (8 per node), Table 1's models (GPT 3.35B/6.7B/"
            "13B/29B, T5 5.5B/11B/22B/44B on 4/8/16/32 GPUs), analytic cost model, "
            "recomputation chosen per iteration."
        ),
        paper=(
            "§8.2, Fig. 14 (maximum length 2048): for GPT \"both MLM+DS and DynaPipe's "
            'performance increases with global batch size" and DynaPipe\'s "increase[s] faster '
            'than MLM+DS", since a larger batch gives more room to optimise micro-batching; '
            "for T5 the baselines lean on tensor parallelism and gain less from larger batches "
            "than DynaPipe, which uses more pipeline parallelism. No per-point numbers in the "
            "text."
        ),
        ours=summary(rows, "global_batch_tokens"),
        differences=(
            "Our baselines are priced by the same analytic cost model with block-diagonal "
            "attention for packed rows (only within-sample attention), which is kinder to "
            "packing than MLM+DS's full-row attention, so the GPT gaps are smaller than the "
            "paper's, and DynaPipe's plans may hold packed rows themselves, so on the same "
            "layout DynaPipe is never predicted slower than packing. T5's baseline is "
            "fixed-size padding. Layouts are screened on one batch per point and the best "
            "three run on all of them; the data is SYNTHETIC; times are predicted, not "
            "measured. For "
            "GPT both grow with the global batch as in the paper, but ours stays within a few "
            "percent of packing instead of pulling ahead; for T5 DynaPipe's lead grows with the "
            "batch (the paper's trend)."
        ),
    )


if __name__ == "__main__":
    main()
