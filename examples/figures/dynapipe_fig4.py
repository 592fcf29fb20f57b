"""DynaPipe Fig. 4: throughput and padding efficiency vs maximum sequence length, packing vs
dynamic micro-batching (dynapipe.txt §2.2), GPT 6.7B and T5 11B on 8 A100-40GB GPUs.

GPT: packing (FFD to the maximum length, block-diagonal attention, micro-batch size grid
searched, 1F1B) against DynaPipe's dynamic micro-batching with the adaptive schedule. Our packing
baseline is decoder-only, so for T5 the baseline is fixed-size padded micro-batches (size grid
searched, 1F1B), the other classic way to batch encoder-decoder samples.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig4")

from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures._dynapipe import GPT_8, T5_8, Setup, batches, run_method

FIGURE = PaperFigure(
    "dynapipe_fig4", "DynaPipe", "Fig. 4", "packing vs dynamic micro-batching (8 A100-40GB)"
)
MAX_SEQLENS = (512, 1024, 2048, 4096, 8192)
TOKENS = 65536  # global batch (§8.1)


def methods(setup: Setup) -> dict[str, dict]:
    baseline = ("packing", "packing") if not setup.encoder_decoder else ("padding", "padding")
    return {
        baseline[0]: {"batching": baseline[1], "schedule": "1f1b"},
        "dynamic": {"batching": "dynamic", "schedule": "adaptive"},
    }


def sweep(iterations: int, max_seqlens: Sequence[int], setups=(GPT_8, T5_8)) -> list[dict]:
    rows = []
    for setup in setups:
        for max_len in max_seqlens:
            bs = batches(setup, max_len, TOKENS, iterations)
            for method, config in methods(setup).items():
                out = run_method(setup.planner(max_seqlen=max_len, **config), bs)
                rows.append(
                    {
                        "model": setup.model,
                        "layout": setup.label,
                        "max_seqlen": max_len,
                        "method": method,
                        "tokens_per_s": round(out.throughput, 1),
                        "padding_efficiency": round(out.padding_efficiency, 4),
                        "encoder_efficiency": round(out.efficiency(0), 4),
                        "decoder_efficiency": round(out.efficiency(1), 4)
                        if setup.encoder_decoder
                        else float("nan"),
                    }
                )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    rows = sweep(2 if run.quick else 8, (512, 2048) if run.quick else MAX_SEQLENS)
    fig, axes = subplots(run, ncols=2, nrows=2, width=5.0, height=3.4)
    for col, model in enumerate(("gpt-6.7b", "t5-11b")):
        mine = [r for r in rows if r["model"] == model]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = [r for r in mine if r["method"] == method]
            xs = [r["max_seqlen"] for r in pts]
            axes[col].plot(xs, [r["tokens_per_s"] / 1e3 for r in pts], "o-", label=method)
            axes[2 + col].plot(xs, [r["padding_efficiency"] for r in pts], "o-", label=method)
        for ax, ylabel in (
            (axes[col], "throughput (k tokens/s)"),
            (axes[2 + col], "padding eff. (real / padded tokens)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max sequence length (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(mine[0]["layout"], fontsize=9)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        axes[2 + col].set_ylim(0, 1.05)
    by = {(r["model"], r["method"], r["max_seqlen"]): r for r in rows}
    lo, hi = min(r["max_seqlen"] for r in rows), max(r["max_seqlen"] for r in rows)
    lines = []
    for model, base in (("gpt-6.7b", "packing"), ("t5-11b", "padding")):
        for method in (base, "dynamic"):
            a, b = by[(model, method, lo)], by[(model, method, hi)]
            drop = 1 - b["tokens_per_s"] / a["tokens_per_s"]
            lines.append(
                f"- {model} {method}: {a['tokens_per_s']:,.0f} -> {b['tokens_per_s']:,.0f} "
                f"tokens/s from max length {lo} to {hi} ({drop:.1%} lower); padding efficiency "
                f"{a['padding_efficiency']:.3f} -> {b['padding_efficiency']:.3f}."
            )
        gain = by[(model, "dynamic", hi)]["tokens_per_s"] / by[(model, base, hi)]["tokens_per_s"]
        lines.append(f"- {model} at max length {hi}: dynamic / {base} = {gain:.2f}x.")
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "SYNTHETIC FLAN-like lengths (`flan` preset), 65,536-token global batches (§8.1), "
            f"{'2' if run.quick else '8'} iterations per point; GPT 6.7B on TP2 x PP4 and T5 "
            "11B on TP4 x PP2 (8 A100-40GB, Table 1's 8-GPU models), analytic cost model, "
            "recomputation chosen per iteration. Throughput = real tokens / predicted time."
        ),
        paper=(
            '§2.2, Fig. 4: training GPT and T5 on FLANv2 with packing, "more than 50% '
            "throughput decrease when the maximum sequence length increases from 512 to 8192, "
            'while the total number of non-padding tokens only increases by 13.2%"; dynamic '
            "micro-batching keeps throughput far flatter. Packing keeps padding efficiency "
            "high (§8.3: both > 0.8 for GPT)."
        ),
        ours="\n".join(lines),
        differences=(
            "Our cost model is analytic (A100 FLOPs with a small-GEMM efficiency curve, "
            "quadratic attention) and our packing prices block-diagonal attention (only the "
            "attention inside each packed sample, as variable-length kernels do), so packing "
            "loses less to long rows than the paper's MLM+DS, which attends over the whole "
            "packed row; the drop we see comes from fewer, longer micro-batches and bubbles. "
            "The layout is fixed (no 3D grid search), the data is SYNTHETIC, and T5's baseline "
            "is padding because our packing is decoder-only; its grid search settles on one "
            "sample per micro-batch beyond 512 tokens (no padding, slow small GEMMs), which "
            "is already slow at 512, so in relative terms our T5 dynamic curve falls further "
            "than the padding one while staying above it at every length."
        ),
    )


if __name__ == "__main__":
    main()
