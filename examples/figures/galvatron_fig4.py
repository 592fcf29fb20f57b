"""Galvatron-BMW Fig. 4: memory- vs time-balanced (vs bi-objective) partitions of a 4-way 1F1B
pipeline (seed `galvatron_bmw.txt` §IV-B): per-stage memory and time, balance degrees, throughput.

BERT-Huge-48 (global batch 32) and T5-512/4-48 (global batch 64), 8 micro-batches, 4 A100-40GB
GPUs, one GPU per stage and no CKPT, as in the paper's figure. p_m and p_t are
`dynapipe_planner.search.balance_partitions` (the partitions Algorithm 2 starts from and moves
towards); the bi-objective partition is our `search(..., bi_objective=True)` under a 16 GB
budget; every partition is priced by `price_plan` (§V estimator, Eq. 2 and Eq. 9).
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.galvatron_fig4")

from benchmarks.galvatron_tables import MODELS
from dynapipe_planner.cluster import GiB, get_gpu
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search import (
    analytic_cost_inputs,
    balance_partitions,
    price_plan,
    search,
    strategy_space,
)
from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure(
    "galvatron_fig4", "Galvatron-BMW", "Fig. 4", "4-way 1F1B pipelines with different partitions"
)
STAGES = 4
MICROBATCHES = 8
# The paper's example budget, and a tighter one: our bf16 estimator puts about half the paper's
# memory on a stage, so at 16 GB every partition fits and only the tighter budget shows the
# time-balanced pipeline running out of memory.
BUDGETS_GB = (16, 10)
GPU = "A100-40GB"
# name -> global batch (Fig. 4's caption)
SETTINGS = {"bert-huge-48": 32, "t5-512/4-48": 64}
QUICK = {"bert-huge-32": 32}
COLOURS = {
    "memory-balanced": "tab:blue",
    "time-balanced": "tab:orange",
    "bi-objective 16 GB": "tab:green",
    "bi-objective 10 GB": "tab:purple",
}
LINES = {16: ("red", "--"), 10: ("tab:purple", ":")}


def balance(values: Sequence[float]) -> float:
    """Eq. 6: 1 - max / sum (0 .. 1 - 1/P; larger is better balanced)."""
    return 1.0 - max(values) / sum(values)


def setting_rows(name: str, batch: int) -> list[dict]:
    preset, seq, tgt = MODELS[name]
    model = MODEL_PRESETS[preset]
    inputs = analytic_cost_inputs(model, get_gpu(GPU), STAGES, seq_length=seq, tgt_seq_length=tgt)
    pure_pp = [s for s in strategy_space(STAGES)[STAGES] if not s.ckpt]
    p_m, p_t = balance_partitions(inputs, pure_pp, batch, MICROBATCHES)
    plans = {"memory-balanced": p_m, "time-balanced": p_t}
    for budget in BUDGETS_GB:
        try:
            found = search(
                model, inputs, STAGES, budget * GiB, global_batch_size=batch,
                num_microbatches=MICROBATCHES, pp_degrees=[STAGES],
                strategy_filter=lambda s: not s.ckpt, bi_objective=True,
            )  # fmt: skip
            plans[f"bi-objective {budget} GB"] = found.partition
        except PlanningError:
            pass  # nothing fits this budget: the figure leaves that partition out
    rows = []
    layers = len(model.layer_kinds())
    for plan, partition in plans.items():
        price = price_plan(inputs, pure_pp * layers, partition, MICROBATCHES, batch)
        a_t, a_m = balance(price.stage_time_s), balance(price.stage_memory_bytes)
        for stage, (n, t, mem) in enumerate(
            zip(partition, price.stage_time_s, price.stage_memory_bytes, strict=True)
        ):
            rows.append(
                {
                    "model": name,
                    "global_batch": batch,
                    "partition_kind": plan,
                    "partition": "-".join(map(str, partition)),
                    "stage": stage + 1,
                    "layers": n,
                    "stage_time_s": round(t, 5),
                    "stage_memory_gb": round(mem / GiB, 3),
                    "alpha_t": round(a_t, 4),
                    "alpha_m": round(a_m, 4),
                    "samples_per_s": round(price.throughput, 2),
                    **{f"fits_{b}gb": price.fits(b * GiB) for b in BUDGETS_GB},
                }
            )
    return rows


def draw(ax, rows: list[dict]) -> None:
    """The paper's drawing: per partition, one bar per stage, height its memory, width its
    share of the partition's summed stage time."""
    x = 0.0
    centres, labels = [], []
    for kind in dict.fromkeys(r["partition_kind"] for r in rows):
        stages = [r for r in rows if r["partition_kind"] == kind]
        total = sum(r["stage_time_s"] for r in stages)
        start = x
        for r in stages:
            w = 4.0 * r["stage_time_s"] / total
            ax.bar(x, r["stage_memory_gb"], width=w, align="edge", color=COLOURS[kind],
                   edgecolor="black", alpha=0.85)  # fmt: skip
            ax.text(x + w / 2, r["stage_memory_gb"], str(r["layers"]), ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
            x += w
        head = stages[0]
        centres.append((start + x) / 2)
        labels.append(
            f"{kind}\n[{head['partition'].replace('-', ',')}]\n"
            f"αt={head['alpha_t']:.2f} αm={head['alpha_m']:.2f}\n"
            f"{head['samples_per_s']:.1f} samples/s"
        )
        x += 0.8
    for budget, (colour, style) in LINES.items():
        ax.axhline(budget, color=colour, linestyle=style, linewidth=1, label=f"{budget} GB budget")
    ax.set_xticks(centres, labels, fontsize=7.5)
    ax.set_ylabel("stage peak memory (GB)")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, axis="y")


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    settings = QUICK if run.quick else SETTINGS
    rows = [r for name, batch in settings.items() for r in setting_rows(name, batch)]
    fig, axes = subplots(run, ncols=len(settings), width=7.2, height=4.8)
    for ax, (name, batch) in zip(axes, settings.items(), strict=True):
        draw(ax, [r for r in rows if r["model"] == name])
        ax.set_title(
            f"{name}, global batch {batch}, {MICROBATCHES} micro-batches\n"
            "bar height: memory; bar width: stage time (share); number: layers",
            fontsize=9,
        )
    summary = []
    for name in settings:
        here = {r["partition_kind"]: r for r in rows if r["model"] == name and r["stage"] == 1}
        line = f"- {name}: " + "; ".join(
            f"{k} [{r['partition'].replace('-', ',')}] αt {r['alpha_t']:.2f}, αm "
            f"{r['alpha_m']:.2f}, {r['samples_per_s']:.1f} samples/s"
            + "".join(f", over {b} GB" for b in BUDGETS_GB if not r[f"fits_{b}gb"])
            for k, r in here.items()
        )
        for b in BUDGETS_GB:
            kind = f"bi-objective {b} GB"
            if kind in here:
                gain = here[kind]["samples_per_s"] / here["memory-balanced"]["samples_per_s"]
                line += f". {kind} over memory-balanced: {100 * (gain - 1):+.1f}%"
            else:
                line += f". No partition fits {b} GB, so the search returns none"
        summary.append(line + ".")
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"{', '.join(settings)}; 4 x {GPU} (our analytic model), PP 4, one GPU per stage, "
            f"no CKPT, {MICROBATCHES} micro-batches, 1F1B; bi-objective search under "
            f"{' and '.join(f'{b} GB' for b in BUDGETS_GB)} per GPU."
        ),
        paper=(
            "Fig. 4 (§IV-B, 4 A100 GPUs, BERT-Huge-48 batch 32 and T5-512/4-48 batch 64, 8 "
            "micro-batches): the time-balanced pipelines have αt close to 1 - 1/4 = 0.75 but "
            "shallower stages use far more memory than deeper ones under 1F1B (low αm), so under "
            "a limited budget (e.g. 16 GB) some stages run out of memory; the memory-balanced "
            "pipelines have near-uniform memory but put more layers on deeper stages, lowering "
            "αt and throughput. The bi-objective partition sits between them (median αt and "
            "αm), avoids the time-balanced pipeline's OOM and is up to 19.2% faster than the "
            "memory-balanced one. (The figure's exact bar values are only in the image.)"
        ),
        ours="\n".join(summary),
        differences=(
            "- Memory and time are the §V estimator's (analytic A100 model, bf16 activations, 18 "
            "bytes of model state per parameter), not measurements, so absolute GB and samples/s "
            "differ; the 1F1B memory skew (stage i keeps min(P - i, m) micro-batches) is the "
            "same mechanism.\n"
            "- Our time-balanced p_t balances the layers' times only (as Algorithm 2's rule 3 "
            "reference does); the embedding and output layers on the end stages are priced by "
            "`price_plan` but not balanced, so αt of p_t can be below the paper's ~0.75.\n"
            "- Our stages hold about half the paper's memory (bf16 activations; the paper's "
            "Table I sizes look like FP32), so at the paper's 16 GB every partition fits and the "
            "bi-objective search may return p_t itself or a partition beyond it (its p_t ignores "
            "the output layer's time on the last stage). The 10 GB budget is ours, chosen to put "
            "the budget between the memory-balanced and time-balanced peaks as the paper's 16 GB "
            "does for its measured memory: there the time-balanced pipeline does not fit and the "
            "bi-objective partition lands between the two, as in the paper.\n"
            "- The bi-objective partition is what our whole search returns (the best of the "
            "memory-balanced start, p_t and the even split when they fit, then Algorithm 2's "
            "moves)."
        ),
    )


if __name__ == "__main__":
    main()
