"""DynaPipe Fig. 7: makespan of 1F1B vs the adaptive schedule when micro-batch execution times
get zero-mean Gaussian noise (dynapipe.txt §2.2), 4 and 8 pipeline stages.

Micro-batches start uniform (forward 1/3, backward 2/3 of a unit per stage, no communication);
each micro-batch's time is scaled by 1 + N(0, sigma) (floored at 0.05) on every stage. Both
schedules come from the planner core's schedule search (`search_schedule`, memory
unconstrained, the adaptive one with its cluster-permutation ordering); makespans are
normalised by the noise-free makespan and averaged over random draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.dynapipe_fig7")

from dynapipe_planner.schedule import search_schedule
from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure(
    "dynapipe_fig7", "DynaPipe", "Fig. 7", "makespan under Gaussian micro-batch time noise"
)
SIGMAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
STAGES = (4, 8)
MICROBATCHES = 32


def makespan(times: np.ndarray, stages: int, kind: str) -> float:
    fwd = np.repeat(times[:, None] / 3, stages, axis=1)
    bwd = 2 * fwd
    zero = np.zeros((len(times), stages - 1))
    act = np.ones_like(fwd)
    limit = np.full(stages, 1e9)
    return search_schedule(fwd, bwd, act, limit, zero, zero, kind=kind).timeline.makespan


def sweep(trials: int, sigmas: Sequence[float]) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for stages in STAGES:
        base = {k: makespan(np.ones(MICROBATCHES), stages, k) for k in ("1f1b", "adaptive")}
        for sigma in sigmas:
            draws = [
                np.maximum(0.05, 1 + rng.normal(0, sigma, MICROBATCHES)) for _ in range(trials)
            ]
            for kind in ("1f1b", "adaptive"):
                spans = [makespan(t, stages, kind) / base[kind] for t in draws]
                rows.append(
                    {
                        "stages": stages,
                        "sigma": sigma,
                        "schedule": kind,
                        "normalised_makespan": round(float(np.mean(spans)), 4),
                        "std": round(float(np.std(spans)), 4),
                        "trials": trials,
                    }
                )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    rows = sweep(3 if run.quick else 30, (0.0, 0.3) if run.quick else SIGMAS)
    fig, axes = subplots(run, ncols=2, width=4.8, height=3.6)
    for ax, stages in zip(axes, STAGES, strict=True):
        for kind in ("1f1b", "adaptive"):
            pts = [r for r in rows if r["stages"] == stages and r["schedule"] == kind]
            ax.errorbar(
                [r["sigma"] for r in pts],
                [r["normalised_makespan"] for r in pts],
                yerr=[r["std"] for r in pts],
                marker="o",
                capsize=3,
                label=kind,
            )
        ax.set_xlabel("noise std (fraction of micro-batch time)")
        ax.set_ylabel("makespan / noise-free makespan")
        ax.set_title(f"{stages} stages, {MICROBATCHES} micro-batches", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    top = max(r["sigma"] for r in rows)
    by = {(r["stages"], r["schedule"], r["sigma"]): r["normalised_makespan"] for r in rows}
    lines = [
        f"- {s} stages at sigma {top}: 1F1B {by[(s, '1f1b', top)]:.3f}x, adaptive "
        f"{by[(s, 'adaptive', top)]:.3f}x of the noise-free makespan."
        for s in STAGES
    ]
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"{MICROBATCHES} uniform micro-batches per iteration, noise 1 + N(0, sigma) per "
            f"micro-batch, {'3' if run.quick else '30'} draws per point (seed 0), memory "
            "unconstrained, no communication time."
        ),
        paper=(
            '§2.2, Fig. 7: "the per-iteration training time with 1F1B schedule grows rapidly '
            "as the variation level increases, especially when there are more pipeline "
            'stages"; the adaptive schedule is "more robust to dynamic micro-batches". The '
            "text gives the trend, not per-point values."
        ),
        ours="\n".join(lines),
        differences=(
            "Same trend as the paper: 1F1B grows with the noise and more with 8 stages; the "
            "adaptive schedule stays near 1.0, at times just below it, because its search "
            "also tries cluster permutations of the injection order and keeps the shortest "
            "makespan (short micro-batches can fill and drain the pipeline). The "
            "paper's micro-batch count and noise model are not stated: ours (32 micro-batches, "
            "per-micro-batch scale on every stage) is a choice. Memory is unconstrained here, "
            "which is the adaptive schedule's best case (it trades memory for robustness)."
        ),
    )


if __name__ == "__main__":
    main()
