"""DynaPipe Fig. 16: ablation (dynapipe.txt §8.4).

(a) Micro-batching, T5 11B, maximum length 4096, 65,536-token global batches on 8 A100-40GB
    with no pipelining (TP8, as the paper's best layout has none): fixed-size padding
    (our stand-in for MLM+DS packing, which is decoder-only here), token-based (TB) and our DP,
    each with samples sorted (S) or ordered by a TSP solver (T, OR-Tools).
(b) Schedules, GPT 6.7B, maximum length 4096, 4 stages (TP2 x PP4), global batches of 16,384
    and 65,536 tokens, dynamic micro-batches: 1F1B, adaptive without micro-batch ordering
    (one cluster), adaptive with ordering (4 clusters).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig16")

from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures._dynapipe import GPT_8, Setup, batches, run_method

FIGURE = PaperFigure("dynapipe_fig16", "DynaPipe", "Fig. 16", "ablation (8 A100-40GB)")
T5_NO_PP = Setup("t5-11b", tp=8, stages=1, replicas=1)
MAX_SEQLEN = 4096

MICROBATCHING = {
    "padding": {"batching": "padding"},
    "TB (S)": {"batching": "token-budget", "order": "sort"},
    "TB (T)": {"batching": "token-budget", "order": "tsp"},
    "DP (S)": {"batching": "dynamic", "order": "sort"},
    "DP (T)": {"batching": "dynamic", "order": "tsp"},
}
SCHEDULES = {
    "1F1B": {"schedule": "1f1b"},
    "adaptive, no ordering": {"schedule": "adaptive", "num_clusters": 1},
    "adaptive + ordering": {"schedule": "adaptive", "num_clusters": 4},
}


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    iterations = 2 if run.quick else 6
    rows = []
    bs = batches(T5_NO_PP, MAX_SEQLEN, 65536, iterations)
    for name, config in MICROBATCHING.items():
        out = run_method(T5_NO_PP.planner(max_seqlen=MAX_SEQLEN, **config), bs)
        rows.append(
            {
                "panel": "a",
                "layout": T5_NO_PP.label,
                "global_batch_tokens": 65536,
                "method": name,
                "tokens_per_s": round(out.throughput, 1),
            }
        )
    for tokens in (16384, 65536):
        bs = batches(GPT_8, MAX_SEQLEN, tokens, iterations)
        for name, config in SCHEDULES.items():
            out = run_method(GPT_8.planner(max_seqlen=MAX_SEQLEN, **config), bs)
            rows.append(
                {
                    "panel": "b",
                    "layout": GPT_8.label,
                    "global_batch_tokens": tokens,
                    "method": name,
                    "tokens_per_s": round(out.throughput, 1),
                }
            )
    fig, axes = subplots(run, ncols=2, width=5.2, height=3.8)
    a = [r for r in rows if r["panel"] == "a"]
    axes[0].bar([r["method"] for r in a], [r["tokens_per_s"] / 1e3 for r in a], color="C0")
    axes[0].set_title(f"(a) micro-batching: {T5_NO_PP.label}, max len 4096", fontsize=9)
    axes[0].set_ylabel("throughput (k tokens/s)")
    axes[0].set_xlabel("micro-batching (S: sorted, T: TSP order)")
    axes[0].tick_params(axis="x", labelsize=8)
    width = 0.27
    for k, name in enumerate(SCHEDULES):
        pts = [r for r in rows if r["panel"] == "b" and r["method"] == name]
        xs = np.arange(len(pts)) + (k - 1) * width
        axes[1].bar(xs, [r["tokens_per_s"] / 1e3 for r in pts], width, label=name)
    axes[1].set_xticks(range(2), ["16,384", "65,536"])
    axes[1].set_xlabel("global batch (tokens)")
    axes[1].set_ylabel("throughput (k tokens/s)")
    axes[1].set_title(f"(b) schedules: {GPT_8.label}, max len 4096", fontsize=9)
    axes[1].legend(fontsize=8, loc="upper left")
    axes[1].set_ylim(0, 1.25 * max(r["tokens_per_s"] for r in rows if r["panel"] == "b") / 1e3)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    by = {(r["panel"], r["global_batch_tokens"], r["method"]): r["tokens_per_s"] for r in rows}
    tb_s = by[("a", 65536, "TB (S)")]
    lines = [
        f"- (a) TB (S) / padding = {tb_s / by[('a', 65536, 'padding')]:.2f}x; "
        f"DP (S) / TB (S) = {by[('a', 65536, 'DP (S)')] / by[('a', 65536, 'TB (S)')]:.2f}x; "
        f"DP (T) / DP (S) = {by[('a', 65536, 'DP (T)')] / by[('a', 65536, 'DP (S)')]:.3f}x; "
        f"TB (T) / TB (S) = {by[('a', 65536, 'TB (T)')] / by[('a', 65536, 'TB (S)')]:.3f}x."
    ]
    for tokens in (16384, 65536):
        one = by[("b", tokens, "1F1B")]
        lines.append(
            f"- (b) global batch {tokens}: adaptive + ordering is "
            f"{by[('b', tokens, 'adaptive + ordering')] / one - 1:+.1%} over 1F1B, adaptive "
            f"without ordering {by[('b', tokens, 'adaptive, no ordering')] / one - 1:+.1%}."
        )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"SYNTHETIC FLAN-like lengths truncated at 4096, {iterations} global batches per "
            "bar, analytic cost model, recomputation chosen per iteration; baselines keep "
            "their grid search (micro-batch size or token budget)."
        ),
        paper=(
            "§8.4, Fig. 16a (T5, max length 4096, 65,536 tokens, 8 GPUs, no pipelining): TB "
            '"already achieves significantly higher throughput than MLM+DS" and the DP '
            '"further outperforms TB (without the need for parameter searching)"; sorting vs '
            'TSP ordering "do not impact the performance much". Fig. 16b (GPT, 4 stages): '
            '"our pipeline schedule achieves 10.1% and 7.4% throughput improvement over 1F1B, '
            'under global batch size 16384 and 65536"; ordering matters less at the larger '
            "batch."
        ),
        ours="\n".join(lines),
        differences=(
            "(a) Our T5 baseline is fixed-size padding, not packing; TB gets a grid-searched "
            "budget as in the paper, and the ordering (S vs T) changes little, as in the "
            "paper. (b) Our schedule gain is larger than the paper's and grows with the batch "
            "instead of shrinking: the analytic cost model charges the adaptive schedule "
            "nothing for its irregular communication and dynamic shapes (the paper's real "
            "runs pay for both), and its 1F1B keeps the DP's micro-batches, which were sized "
            "for the adaptive schedule's memory rule when they need it (more micro-batches in "
            "flight), so 1F1B may fall back to recomputation. The paper's explanation for its "
            "gain being below Fig. 7's (Eq. 2 makes micro-batches uniform) applies to ours "
            "too."
        ),
    )


if __name__ == "__main__":
    main()
