"""HexiScale Fig. 8: convergence of the iterative search (§4.4) with its multi-level graph
partition (§4.2) against the same search with a random partition, Llama-2 7B on heterogeneous
setting 1 and Llama 30B on setting 3 (seed hexiscale.txt §5.3).

Both run `hexiscale_search` unchanged except for `SearchConfig.partition`, over several seeds;
each plan the search prices is one iteration, and the curve is the best estimated MFU found so
far (a search ends when a round brings no improvement; its curve then stays flat). The random
partition deals the shuffled devices to the part with the least compute so far, so parts stay
balanced in FLOPS as §4.2's do, but links are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hexiscale_fig8")

from benchmarks.hexiscale_settings import CLUSTERS, job_cost
from dynapipe_planner.devices import load_cluster
from dynapipe_planner.hetero.cost import HeteroCostModel
from dynapipe_planner.hetero.graph_partition import partition_graph
from dynapipe_planner.hetero.search import SearchConfig, hexiscale_search
from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure(
    "hexiscale_fig8",
    "HexiScale",
    "Fig. 8",
    "search convergence, graph partition vs random partition",
)
CASES = (
    ("setting 1", "hexiscale_setting1.yaml", "llama2-7b"),
    ("setting 3", "hexiscale_setting3.yaml", "llama-30b"),
)
# Llama 2's 4M-token batch, where every system's MFU peaks in hexiscale_settings.txt.
BATCH = 1024


def random_partition(
    weights: np.ndarray,
    adjacency: np.ndarray,
    k: int,
    *,
    maximize: bool = False,
    balance: float = 1.1,
    seed: int = 0,
) -> np.ndarray:
    """k non-empty parts of shuffled devices, each next one to the part with the least
    compute; `adjacency`, `maximize` and `balance` are ignored (no cut objective)."""
    rng = np.random.default_rng(seed)
    labels = np.empty(len(weights), dtype=int)
    load = np.zeros(k)
    for i, v in enumerate(rng.permutation(len(weights))):
        part = i if i < k else int(np.argmin(load))
        labels[v] = part
        load[part] += weights[v]
    return labels


METHODS = {"graph partition (ours)": partition_graph, "random partition": random_partition}


def best_so_far(cost: HeteroCostModel, history: list[dict]) -> list[float]:
    """Best estimated MFU after each priced plan (0 until one fits memory)."""
    peak = cost.cluster.total_peak_flops
    flops = cost.job.flops_per_sample() * cost.job.global_batch
    out, best = [], 0.0
    for h in history:
        best = max(best, flops / (h["iteration_s"] * peak))
        out.append(best)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    seeds = range(1) if run.quick else range(8)
    cases = CASES[:1] if run.quick else CASES
    plans = {"max_plans": 50} if run.quick else {}  # quick: the first 50 plans of each search
    rows, curves = [], {}
    for label, file, model in cases:
        cost = job_cost(load_cluster(CLUSTERS / file), model, BATCH)
        for method, partition in METHODS.items():
            for seed in seeds:
                r = hexiscale_search(cost, SearchConfig(seed=seed, partition=partition, **plans))
                curve = best_so_far(cost, r.history)
                curves[(label, method, seed)] = curve
                for i, mfu in enumerate(curve):
                    rows.append(
                        {
                            "setting": label,
                            "model": model,
                            "method": method,
                            "seed": seed,
                            "iteration": i + 1,
                            "best_mfu": round(mfu, 4),
                        }
                    )
    fig, axes = subplots(run, ncols=len(cases), width=5.5 if len(cases) > 1 else 6.5, height=4.0)
    summary = []
    for ax, (label, _, model) in zip(axes, cases, strict=True):
        length = max(len(c) for (lb, _, _), c in curves.items() if lb == label)
        for method, color in zip(METHODS, ("tab:red", "tab:blue"), strict=True):
            padded = np.array(
                [
                    c + [c[-1]] * (length - len(c))
                    for (lb, m, _), c in curves.items()
                    if (lb, m) == (label, method)
                ]
            )
            x = np.arange(1, length + 1)
            ax.plot(x, 100 * padded.mean(0), color=color, label=f"{method}, mean")
            ax.fill_between(
                x,
                100 * padded.min(0),
                100 * padded.max(0),
                color=color,
                alpha=0.2,
                label=f"{method}, min-max over {len(padded)} seeds",
            )
            ends = [len(c) for (lb, m, _), c in curves.items() if (lb, m) == (label, method)]
            summary.append(
                f"- {label}, {model}, {method}: final best MFU mean {padded[:, -1].mean():.1%} "
                f"(min {padded[:, -1].min():.1%}, max {padded[:, -1].max():.1%}) over "
                f"{len(padded)} seeds; the search stopped after {min(ends)}-{max(ends)} plans."
            )
        ax.set_xlabel("plans priced (search iterations)")
        ax.set_ylabel("best estimated MFU so far (%)")
        ax.set_title(f"{label}, {model}, batch {BATCH}", fontsize=9)
        ax.legend(fontsize=7, loc="center right")
        ax.grid(alpha=0.3)
    gaps, relative = [], []
    for label, _, model in cases:
        final = {
            m: np.mean([c[-1] for (lb, mm, _), c in curves.items() if (lb, mm) == (label, m)])
            for m in METHODS
        }
        ours, rand = final["graph partition (ours)"], final["random partition"]
        relative.append(ours / rand - 1)
        gaps.append(
            f"{label} {model}: {100 * (ours - rand):+.1f} MFU points ({ours / rand - 1:+.0%})"
        )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            f"`hexiscale_setting1.yaml` with `llama2-7b` and `hexiscale_setting3.yaml` with "
            f"`llama-30b`, {BATCH} samples of 4096 tokens, micro-batch 1, full recomputation; "
            f"seeds {seeds.start}-{seeds.stop - 1}, default `SearchConfig` (10 s budget, a "
            "round without improvement ends the search)."
        ),
        paper=(
            "§5.3, Fig. 8 (20 runs each): the graph partition converges to a higher estimated "
            "MFU than random partition, by about 8% for Llama-2 7B (setting 1) and 23% for "
            "Llama 30B (setting 3), keeps improving over the iterations while random "
            "partitioning typically converges early; random partitions run out of memory "
            "more often."
        ),
        ours="\n".join([*summary, "- Final mean gap, ours minus random: " + "; ".join(gaps) + "."]),
        differences=(
            "Our random partition keeps compute balanced (it only ignores links), and phase 2 "
            "still splits each pipeline by machine, so it is a milder baseline than a purely "
            "random split; the gap measures what bandwidth-aware grouping adds. Where a "
            "random curve never rises, its best is among the first plans priced, D_dp = 1, "
            "which needs no partition. The x axis counts plans priced (each a point of the "
            "§4.4 loop), and a search stops at the first round without improvement, rather "
            "than running the paper's 50 iterations. The paper's gaps (about 8% for 7B, 23% "
            "for 30B) do not say whether they are points or relative; we print both"
            + (
                ", and our relative gap is larger for 7B than for 30B, the reverse of the paper's. "
                if len(relative) == 2 and relative[0] > relative[1]
                else ". "
            )
            + "All MFUs are our cost model's estimates, with concurrent transfers sharing a "
            "machine's link (see `dynapipe_planner/hetero/cost.py`)."
        ),
    )


if __name__ == "__main__":
    main()
