"""Hydraulis Fig. 12: (a) the strategy chosen for each iteration and its latency, (b) rank load
balance, Hydraulis vs Megatron-style (hydraulis.txt §8.4), 32B model on 64 A800 GPUs,
SYNTHETIC CommonCrawl-like lengths, context 32K.

Hydraulis is our `StrategySelector` (proposed heterogeneous strategies, greedy dispatch, Eq. 1
packing, per-iteration selection); Megatron-style is `megatron_iteration` (fixed-length packing
to the context, rows dealt evenly, 1F1B) on the homogeneous scheme that is fastest on the first
iterations, as `benchmarks/hydraulis_quality.py` picks it (its `best_of`).
A rank's latency is the propagation time of the pipeline it belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hydraulis_fig12")

from benchmarks.hydraulis_quality import MAX_TP, best_of, workload
from dynapipe_planner.strategy.baselines import IterationLatency, megatron_iteration, per_gpu
from dynapipe_planner.strategy.selection import SelectionConfig, StrategySelector
from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure(
    "hydraulis_fig12", "Hydraulis", "Fig. 12", "strategy per iteration and rank load balance"
)
MODEL = "llama-32b"
NUM_GPUS = 64
CONTEXT = 32768
TOKENS = 100_000  # §8.1's default per iteration
BALANCE_ITERATIONS = 5


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    iterations, trials = (3, 5) if run.quick else (30, 100)
    # Quick: the smallest Hydraulis setting (7B on 8 GPUs at 16K), 50K tokens per iteration.
    quick = ("llama-7b", 8, 16384, 50_000)
    model, num_gpus, context, tokens = quick if run.quick else (MODEL, NUM_GPUS, CONTEXT, TOKENS)
    work = workload(model, num_gpus, context, iterations, tokens)
    batches = work.batches
    selector = StrategySelector(
        work.profiles, work.proposals, work.models, num_gpus, SelectionConfig(trials=trials)
    )
    fits = work.fits

    def megatron(p, b):
        return megatron_iteration(b, p.scheme, num_gpus, context, selector.planners)

    mega = best_of(fits, megatron, batches[:4])
    rows, names = [], {}
    for k, batch in enumerate(batches):
        choice = selector.select(batch)
        busy = per_gpu(
            [p.latency for p in choice.pipelines], [p.scheme for p in choice.pipelines], num_gpus
        )
        ours = IterationLatency(choice.latency, tuple(busy.tolist()))
        label = str(choice.strategy)
        names.setdefault(label, f"S{len(names)}")
        row = {
            "iteration": k + 1,
            "max_length": int(batch.max()),
            "strategy_id": names[label],
            "strategy": label,
            "hydraulis_latency_s": round(ours.latency, 4),
            "hydraulis_rank_max_s": "",
            "hydraulis_rank_min_s": "",
            "megatron_latency_s": "",
            "megatron_rank_max_s": "",
            "megatron_rank_min_s": "",
        }
        if k < BALANCE_ITERATIONS:
            base = megatron(mega, batch)
            row.update(
                hydraulis_rank_max_s=round(max(ours.gpu_busy), 4),
                hydraulis_rank_min_s=round(min(ours.gpu_busy), 4),
                megatron_latency_s=round(base.latency, 4),
                megatron_rank_max_s=round(max(base.gpu_busy), 4),
                megatron_rank_min_s=round(min(base.gpu_busy), 4),
            )
        rows.append(row)
    fig, axes = subplots(run, ncols=2, width=5.4, height=4.0)
    ax = axes[0]
    for label, sid in names.items():
        pts = [r for r in rows if r["strategy"] == label]
        ax.scatter(
            [r["iteration"] for r in pts],
            [r["hydraulis_latency_s"] for r in pts],
            label=f"{sid} ({len(pts)}x)",
            s=18,
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("propagation latency (s)")
    ax.set_title(f"(a) Hydraulis strategy per iteration, {model}, {num_gpus} GPUs", fontsize=9)
    ax.legend(fontsize=7, title="strategy", title_fontsize=7)
    ax = axes[1]
    bal = [r for r in rows if r["megatron_latency_s"] != ""]
    xs = np.arange(len(bal))
    for offset, who, color in ((-0.18, "megatron", "C1"), (0.18, "hydraulis", "C0")):
        hi = np.array([r[f"{who}_rank_max_s"] for r in bal])
        lo = np.array([r[f"{who}_rank_min_s"] for r in bal])
        ax.bar(
            xs + offset,
            hi - lo,
            0.34,
            bottom=lo,
            color=color,
            alpha=0.8,
            label=f"{who}: min..max over ranks",
        )
    ax.set_xticks(xs, [str(r["iteration"]) for r in bal])
    ax.set_xlabel("iteration")
    ax.set_ylabel("rank propagation latency (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"(b) load balance across the {num_gpus} ranks", fontsize=9)
    ax.legend(fontsize=7)
    for a in axes:
        a.grid(alpha=0.3)

    def gaps(who: str) -> list[float]:
        return [
            (r[f"{who}_rank_max_s"] - r[f"{who}_rank_min_s"]) / r[f"{who}_rank_max_s"] for r in bal
        ]

    speed = [r["megatron_latency_s"] / r["hydraulis_latency_s"] for r in bal]
    legend = "; ".join(f"{sid} = {label}" for label, sid in names.items())
    ours = (
        f"- (a) {len(names)} distinct strategies over {iterations} iterations: {legend}.\n"
        f"- (b) (slowest - fastest rank) / slowest over the first {len(bal)} iterations: "
        f"Megatron-style {min(gaps('megatron')):.2f}-{max(gaps('megatron')):.2f}, Hydraulis "
        f"{min(gaps('hydraulis')):.2f}-{max(gaps('hydraulis')):.2f}; Megatron-style scheme "
        f"{mega.scheme}; Hydraulis is {min(speed):.2f}-{max(speed):.2f}x faster on those "
        "iterations."
    )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"`{model}` on {num_gpus} A800 (TP up to {MAX_TP}), SYNTHETIC `commoncrawl` lengths "
            f"truncated at {context // 1024}K, {tokens:,} tokens per iteration, {iterations} "
            f"iterations, {trials} dispatch trials; latencies are the planner core's schedule "
            "timelines on the analytic cost model. Rank columns are filled for the first "
            f"{BALANCE_ITERATIONS} iterations (panel b)."
        ),
        paper=(
            "§8.4, Fig. 12a: over 100 iterations different strategies are chosen as the length "
            'distribution varies; the heterogeneous S3 is "1.6x speedup than S0 in most '
            "cases\" but cannot take every iteration's longest sequence. Fig. 12b: Megatron-LM "
            'shows "a latency difference of 0.36-0.65x between the slowest and fastest ranks", '
            'Hydraulis "reduces this gap to just 0.02-0.10x".'
        ),
        ours=ours,
        differences=(
            "Our iterations are SYNTHETIC and fewer (30, not 100) to keep the script to about "
            "a minute; latencies are predicted, not measured, so Fig. 12a's estimate-vs-actual "
            "comparison is out of scope. A rank that a strategy leaves without a pipeline "
            "counts as idle (latency 0), which widens a gap whenever a strategy does not use "
            "all 64 GPUs. Where a batch holds one very long sequence, our dispatch minimises "
            "the slowest pipeline, and that pipeline (holding the long sequence alone) is on "
            "the critical path while the others finish early: the gap can then exceed the "
            "paper's 0.10 even though the iteration is still faster than Megatron-style's "
            "(see the CSV's iteration rows)."
        ),
    )


if __name__ == "__main__":
    main()
