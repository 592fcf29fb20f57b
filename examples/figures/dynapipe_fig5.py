"""DynaPipe Fig. 5: token-based and fixed-size micro-batching, throughput normalised to
DynaPipe's DP micro-batching (dynapipe.txt §2.2), GPT 6.7B and T5 11B on 8 A100-40GB GPUs.

Token-based: micro-batches of at most B tokens (sorted samples, `token-budget` batching) for a
sweep of B. Fixed-size: padded micro-batches of k samples (`padding` batching) for a sweep of
k. Both run 1F1B, as Megatron would; the normaliser is dynamic micro-batching (adaptive
schedule). A missing point is out of memory under every recomputation mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig5")

from examples.figures._common import PaperFigure, start, subplots, write_outputs
from examples.figures._dynapipe import GPT_8, T5_8, batches, run_method

FIGURE = PaperFigure(
    "dynapipe_fig5",
    "DynaPipe",
    "Fig. 5",
    "token-based and fixed-size micro-batching / DP (8 A100-40GB)",
)
TOKENS = 65536
MAX_SEQLENS = (512, 2048, 8192)
BUDGETS = (1024, 2048, 4096, 8192, 16384, 32768)
SIZES = (1, 2, 4, 8, 16, 32, 64)


def sweep(iterations: int, max_seqlens: Sequence[int], budgets, sizes) -> list[dict]:
    rows = []
    for setup in (GPT_8, T5_8):
        for max_len in max_seqlens:
            bs = batches(setup, max_len, TOKENS, iterations)
            dp = run_method(setup.planner(max_seqlen=max_len), bs).throughput
            options = [
                ("token-based", b, {"batching": "token-budget", "token_budget": b}) for b in budgets
            ]
            options += [
                ("fixed-size", k, {"batching": "padding", "micro_batch_size": k}) for k in sizes
            ]
            for method, param, config in options:
                if method == "token-based" and param < max_len * (
                    2 if setup.encoder_decoder else 1
                ):
                    continue  # a budget below the longest sample cannot hold it
                out = run_method(setup.planner(max_seqlen=max_len, schedule="1f1b", **config), bs)
                rows.append(
                    {
                        "model": setup.model,
                        "max_seqlen": max_len,
                        "method": method,
                        "parameter": param,
                        "tokens_per_s": round(out.throughput, 1),
                        "dp_tokens_per_s": round(dp, 1),
                        "normalised": round(out.throughput / dp, 4),
                        "oom": not out.ok,
                    }
                )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    if run.quick:
        rows = sweep(2, (2048,), (4096, 16384), (1, 8))
    else:
        rows = sweep(4, MAX_SEQLENS, BUDGETS, SIZES)
    fig, axes = subplots(run, ncols=2, nrows=2, width=5.0, height=3.4)
    for r_i, model in enumerate(("gpt-6.7b", "t5-11b")):
        for c_i, (method, xlabel) in enumerate(
            (
                ("token-based", "tokens per micro-batch"),
                ("fixed-size", "micro-batch size (samples)"),
            )
        ):
            ax = axes[2 * r_i + c_i]
            for max_len in dict.fromkeys(r["max_seqlen"] for r in rows):
                pts = [
                    r
                    for r in rows
                    if r["model"] == model and r["method"] == method and r["max_seqlen"] == max_len
                ]
                ys = [math.nan if r["oom"] else r["normalised"] for r in pts]
                ax.plot([r["parameter"] for r in pts], ys, "o-", label=f"max len {max_len}")
            ax.axhline(1.0, color="k", lw=0.8, ls="--", label="DP (DynaPipe) = 1")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("throughput / DP")
            ax.set_title(f"{model}: {method}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    lines = []
    for model in ("gpt-6.7b", "t5-11b"):
        for method in ("token-based", "fixed-size"):
            mine = [r for r in rows if r["model"] == model and r["method"] == method]
            ok = [r for r in mine if not r["oom"]]
            best = max(ok, key=lambda r: r["normalised"]) if ok else None
            oom = sorted({(r["max_seqlen"], r["parameter"]) for r in mine if r["oom"]})
            lines.append(
                f"- {model} {method}: best {best['normalised']:.2f}x of DP "
                f"(max len {best['max_seqlen']}, parameter {best['parameter']}); "
                f"worst {min(r['normalised'] for r in ok):.2f}x; "
                f"{len(oom)} OOM points"
                + (f" (e.g. max len {oom[0][0]}, parameter {oom[0][1]})" if oom else "")
                + "."
                if best
                else f"- {model} {method}: every point out of memory."
            )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "SYNTHETIC FLAN-like lengths, 65,536-token global batches, "
            f"{'2' if run.quick else '4'} iterations per point; GPT 6.7B (TP2 x PP4) and T5 11B "
            "(TP4 x PP2) on 8 A100-40GB, analytic cost model; each point is one fixed "
            "parameter (no grid search), recomputation chosen per iteration."
        ),
        paper=(
            "§2.2, Fig. 5: fixed micro-batch sizes run out of memory as the size and the maximum "
            "length grow; at small maximum lengths throughput first rises (GEMM efficiency) "
            "then falls (padding). Token-based micro-batching is much better but still OOMs "
            "before its best point on T5. All values are normalised to DynaPipe's DP (= 1); "
            "the text gives no per-point numbers."
        ),
        ours="\n".join(lines),
        differences=(
            "Same qualitative shape where memory allows. Our planner picks recomputation per "
            "iteration for the baselines too (the paper grid-searches checkpointing), which "
            "turns some of the paper's OOM points into slower, recomputing points; the layout "
            "is fixed rather than grid searched, the data SYNTHETIC and the costs analytic. A "
            "normalised value above 1 means the fixed parameter beat the DP on this batch, "
            "which the DP can miss because its objective (Eq. 2) is an approximation of the "
            "schedule's makespan."
        ),
    )


if __name__ == "__main__":
    main()
