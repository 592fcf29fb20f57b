"""DynaPipe Fig. 18: predicted vs measured iteration time and peak memory (dynapipe.txt §8.6),
from real CPU training runs.

The measurements are `benchmarks/cost_model_accuracy.py`'s saved points
(`benchmarks/results/cost_model_accuracy_*/points.csv`: GPT 4 layers x 256, sequence 1024,
PP=2 on 2 CPU processes, profiled cost table, 50 iterations, first 3 excluded); re-measuring
needs the torch runtime and ~10 minutes, so this script plots the saved runs and computes the
error statistics from them. Rerun the benchmark to refresh them.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig18")

from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure(
    "dynapipe_fig18", "DynaPipe", "Fig. 18", "cost-model accuracy (real CPU runs, saved)"
)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUNS = {
    "stdlib corpus": "cost_model_accuracy_stdlib",
    "FLAN-like, loaded machine": "cost_model_accuracy_flan",
    "FLAN-like, quieter machine": "cost_model_accuracy_flan_quieter",
}


def load(run_name: str, folder: str) -> list[dict]:
    with (RESULTS / folder / "points.csv").open() as f:
        points = list(csv.DictReader(f))
    return [
        {
            "run": run_name,
            "kind": p["kind"],
            "iteration": int(p["iteration"]),
            "stage": p["stage"],
            "predicted": float(p["predicted"]),
            "measured": float(p["measured"]),
            "rel_error": round(float(p["predicted"]) / float(p["measured"]) - 1, 5),
        }
        for p in points
    ]


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    rows = [r for name, folder in RUNS.items() for r in load(name, folder)]
    fig, axes = subplots(run, ncols=3, width=4.2, height=4.0)
    panels = (
        ("time", 1.0, "iteration time (s)", "(a) iteration time (wall clock)"),
        ("busy", 1.0, "stage compute time (s)", "(a') per-stage CPU busy time"),
        ("memory", 2**20, "peak memory (MiB)", "(b) peak memory per stage"),
    )
    lines = []
    for ax, (kind, scale, label, title) in zip(axes, panels, strict=True):
        mine = [r for r in rows if r["kind"] == kind]
        for name in RUNS:
            pts = [r for r in mine if r["run"] == name]
            ax.scatter(
                [r["measured"] / scale for r in pts],
                [r["predicted"] / scale for r in pts],
                s=10,
                alpha=0.7,
                label=name,
            )
            err = np.abs([r["rel_error"] for r in pts])
            lines.append(
                f"- {kind}, {name}: median |error| {np.median(err):.1%}, p90 "
                f"{np.percentile(err, 90):.1%} over {len(pts)} points."
            )
        both = [r["measured"] / scale for r in mine] + [r["predicted"] / scale for r in mine]
        lo, hi = min(both), max(both)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "Saved real CPU runs (see the script's docstring); `rel_error` = predicted / "
            "measured - 1, computed here. Wall-clock time depends on the shared machine's load "
            "(each run's summary.txt gives the load averages); busy time is the "
            "load-insensitive check of the cost table."
        ),
        paper=(
            '§8.6, Fig. 18 (A100 GPUs, all experiments): "For T5, the estimated iteration '
            "time matches well the actual value. The iteration time prediction error for GPT "
            'is slightly larger"; the peak-memory prediction is plotted against the measured '
            "peak. The text gives no error percentages."
        ),
        ours="\n".join(lines),
        differences=(
            "Ours are CPU runs of a small GPT (no GPU here), so wall-clock time is at the "
            "mercy of other jobs on the 2 shared cores: on a loaded machine the prediction "
            "under-estimates by about a third, on a quieter one the median error is near 10%; "
            "per-stage busy time and memory, which load barely moves, stay within a few "
            "percent and under 1%. Only GPT is measured (no T5 runtime)."
        ),
    )


if __name__ == "__main__":
    main()
