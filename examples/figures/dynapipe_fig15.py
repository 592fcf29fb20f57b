"""DynaPipe Fig. 15: padding efficiency (real / padded tokens) vs maximum sequence length
(dynapipe.txt §8.3): GPT 6.7B overall, T5 11B per side (encoder input, decoder input).

Same plans as Fig. 4 (`dynapipe_fig4.sweep`): packing vs dynamic for GPT, fixed-size padding vs
dynamic for T5 (our packing is decoder-only), 65,536-token global batches on 8 A100-40GB.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig15")

from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures.dynapipe_fig4 import MAX_SEQLENS, sweep

FIGURE = PaperFigure("dynapipe_fig15", "DynaPipe", "Fig. 15", "padding efficiency (8 A100-40GB)")


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    rows = sweep(2 if run.quick else 8, (512, 2048) if run.quick else MAX_SEQLENS)
    fig, axes = subplots(run, ncols=2, width=5.0, height=3.8)
    series = (
        (axes[0], "gpt-6.7b", "padding_efficiency", ""),
        (axes[1], "t5-11b", "encoder_efficiency", " (encoder)"),
        (axes[1], "t5-11b", "decoder_efficiency", " (decoder)"),
    )
    for ax, model, column, suffix in series:
        mine = [r for r in rows if r["model"] == model]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = [r for r in mine if r["method"] == method]
            style = "o-" if column != "decoder_efficiency" else "s--"
            ax.plot(
                [r["max_seqlen"] for r in pts],
                [r[column] for r in pts],
                style,
                label=method + suffix,
            )
        ax.set_title(mine[0]["layout"], fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max sequence length (tokens)")
        ax.set_ylabel("padding efficiency (real / padded tokens)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    def span(model: str, method: str, column: str) -> str:
        vals = [r[column] for r in rows if r["model"] == model and r["method"] == method]
        return f"{min(vals):.3f}-{max(vals):.3f}"

    lines = [
        f"- GPT: packing {span('gpt-6.7b', 'packing', 'padding_efficiency')}, dynamic "
        f"{span('gpt-6.7b', 'dynamic', 'padding_efficiency')} over the maximum lengths.",
        f"- T5 encoder: padding {span('t5-11b', 'padding', 'encoder_efficiency')}, dynamic "
        f"{span('t5-11b', 'dynamic', 'encoder_efficiency')}; decoder: padding "
        f"{span('t5-11b', 'padding', 'decoder_efficiency')}, dynamic "
        f"{span('t5-11b', 'dynamic', 'decoder_efficiency')}.",
    ]
    write_outputs(
        run,
        [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows],
        fig,
        workload=(
            "The plans of Fig. 4 (`dynapipe_fig4.sweep`): SYNTHETIC FLAN-like lengths, "
            "65,536-token global batches; a micro-batch's padded tokens are rows x padded "
            "length per side."
        ),
        paper=(
            '§8.3, Fig. 15: for GPT "both packing and our dynamic micro-batching can achieve a '
            'high padding efficiency (>0.8, Fig. 15a), with ours slightly higher", and '
            "packing's efficiency increases with the maximum length. For T5, packing is very "
            "efficient on the encoder input but much less on the decoder; DynaPipe's is \"more "
            'balanced between encoder and decoder".'
        ),
        ours="\n".join(lines),
        differences=(
            "GPT: both are above 0.8 as in the paper, but our packing is slightly higher than "
            "dynamic, not lower: our FFD packing fills rows nearly perfectly on SYNTHETIC "
            "lengths, and our DP trades some padding for fewer, better-shaped micro-batches. "
            "T5: our baseline is padding, not packing (decoder-only packing), and its grid "
            "search picks one sample per micro-batch beyond 512 tokens (efficiency 1.0, at a "
            "throughput cost, Fig. 4). Our DP weighs the encoder side far more (its cost "
            "dominates on T5 11B), so its decoder efficiency is the lower one - the opposite "
            "balance to the paper's packing, and less balanced than the paper's DP."
        ),
    )


if __name__ == "__main__":
    main()
