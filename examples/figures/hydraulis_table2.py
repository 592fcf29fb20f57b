"""Hydraulis Table 2: solve time of each planner subproblem (hydraulis.txt App. E), 32B model,
context 32K, 64 GPUs with 200K tokens per iteration and 1,024 GPUs with 3.2M.

The measurement is `benchmarks/hydraulis_solve_time.py`'s own `measure` (imported, not
copied), on one core (process time). Each bar pairs the same method: the paper's methods as we
implement them (its DP over the relaxation, its greedy dispatch, its ILP packing with CP-SAT)
against the times the paper reports for them on its own machine (a cross-machine quote, not a
like-for-like timing); our heuristic defaults (closed-form proposal
with hill climb, LPT packing) are bars of their own, with their measured gap to the exact
methods in the note.
"""

from __future__ import annotations

from collections.abc import Sequence

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.figures.hydraulis_table2")

from benchmarks.hydraulis_solve_time import (
    GAP_BOUND,
    PAPER,
    PAPER_ITERATIONS,
    PAPER_METHODS,
    SETTINGS,
    measure,
)
from examples.figures._common import PaperFigure, start, subplots, write_outputs

FIGURE = PaperFigure("hydraulis_table2", "Hydraulis", "Table 2", "planner solve times (one core)")
PARTS = ("proposal", "dispatch / iteration", "packing / iteration")
HEURISTICS = ("closed form + hill climb", "", "LPT per V")


def main(argv: Sequence[str] | None = None) -> None:
    run = start(FIGURE, argv, __doc__ or "")
    iterations, trials = (1, 5) if run.quick else (10, 100)
    settings = SETTINGS[:1] if run.quick else SETTINGS
    rows, gaps = [], []
    for num_gpus, tokens in settings:
        # The paper's DP (C++ core) takes about a second at 64 GPUs, a minute at 1,024; the ILP
        # (CP-SAT) seconds per pipeline even at 64: quick mode runs neither.
        m = measure(
            num_gpus, tokens, iterations, trials, paper_dp=not run.quick,
            ilp_iterations=0 if run.quick else 2,
        )  # fmt: skip
        paper = PAPER[num_gpus]
        exact = (
            None if m.paper_dp_s is None else m.profiling_s + m.paper_dp_s,
            m.dispatch_s / m.iterations,
            None if m.ilp_s is None else m.ilp_s / m.ilp_iterations,
        )
        fast = (m.profiling_s + m.closed_form_s, None, m.lpt_s / m.iterations)
        paper_times = (paper[0], paper[1] / PAPER_ITERATIONS, paper[2] / PAPER_ITERATIONS)
        for k, part in enumerate(PARTS):
            ilp = m.ilp_iterations if k == 2 else iterations
            for who, method, seconds, sample in (
                ("paper (reported)", PAPER_METHODS[k], paper_times[k], PAPER_ITERATIONS),
                ("ours, paper's method", PAPER_METHODS[k], exact[k], ilp),
                ("ours, heuristic", HEURISTICS[k], fast[k], iterations),
            ):
                if seconds is None:
                    continue
                rows.append(
                    {
                        "gpus": num_gpus,
                        "tokens_per_iteration": tokens,
                        "part": part,
                        "who": who,
                        "method": method,
                        "seconds": round(seconds, 4),
                        "iterations": sample,
                    }
                )
        gaps.append((num_gpus, m))
    fig, axes = subplots(run, ncols=len(settings), width=6.0, height=4.0)
    colours = {"paper (reported)": "0.6", "ours, paper's method": "C0", "ours, heuristic": "C2"}
    for ax, (num_gpus, tokens) in zip(axes, settings, strict=True):
        width = 0.27
        for w, who in enumerate(colours):
            pts = [
                (PARTS.index(r["part"]), r["seconds"])
                for r in rows
                if r["gpus"] == num_gpus and r["who"] == who
            ]
            bars = ax.bar(
                [i + (w - 1) * width for i, _ in pts],
                [s for _, s in pts],
                width,
                label=who,
                color=colours[who],
            )
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(PARTS)), PARTS, fontsize=8)
        ax.set_title(f"{num_gpus} GPUs, {tokens:,} tokens / iteration", fontsize=9)
        ax.set_ylabel("solve time (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    lines = [
        f"- {r['gpus']} GPUs, {r['part']}, {r['who']} ({r['method']}): {r['seconds']:.3g} s"
        for r in rows
    ]
    for num_gpus, m in gaps:
        if m.proposal_gaps:
            lines.append(
                f"- {num_gpus} GPUs, proposal gap (the closed form's best candidate's estimate "
                f"/ the paper DP's, per maximum length): max {max(m.proposal_gaps):.4f}, mean "
                f"{sum(m.proposal_gaps) / len(m.proposal_gaps):.4f}; the default proposal's "
                f"(with the DP where tractable): max {max(m.default_gaps):.4f}"
            )
        if m.candidate_gaps:
            lines.append(
                f"- {num_gpus} GPUs, packing gap (LPT / ILP, slowest pipeline's Eq. 1 objective "
                f"per candidate): max {max(m.candidate_gaps):.4f}, mean "
                f"{sum(m.candidate_gaps) / len(m.candidate_gaps):.4f} "
                f"({m.proved} pipelines proved optimal by CP-SAT)"
            )
    write_outputs(
        run,
        rows,
        fig,
        workload=(
            "`llama-32b`, context 32K, SYNTHETIC CommonCrawl-like lengths (`commoncrawl` preset), "
            f"A800; {iterations} iterations, {trials} dispatch trials, the paper's candidate set "
            "(4 proposals around each batch's maximum length); the ILP packing on the first "
            "iterations only (`ilp_iterations`)."
        ),
        paper=(
            "App. E, Table 2 (10 iterations combined for dispatch and packing, 10 processes): "
            "64 GPUs & 200K tokens: proposal 2.03 s, ideal dispatching 40.21 s, greedy "
            "dispatching 5.46 s, packing 10.15 s; 1,024 GPUs & 3.2M tokens: proposal 107.21 s, "
            "ideal dispatching >1000 s, greedy 38.56 s, packing 13.46 s. Dispatch and packing "
            "are drawn per iteration (the paper's total / 10)."
        ),
        ours="\n".join(lines),
        differences=(
            "Same methods, different machines: the blue bars run the paper's methods (its DP "
            "over the relaxation in steps of 0.1, rounded; its greedy dispatch; Eq. 1 as an "
            "ILP, here CP-SAT with a 1 s limit per micro-batch count) on one core of a shared "
            "2-core machine, against the times the paper reports on its own hardware with 10 "
            "processes and its own code: a cross-machine quote, not a like-for-like timing "
            "(Hydraulis' public code is not run here). The green bars are our default "
            "heuristics, other algorithms than the "
            "paper's: a closed-form proposal with a hill climb and LPT packing; their time is "
            "not a speed-up of the paper's methods. Their measured gap to the exact methods is "
            f"held to {GAP_BOUND:.0%} (`benchmarks/hydraulis_solve_time.py`): LPT packing is "
            "within it per candidate; the closed-form proposal alone is not at every maximum "
            "length, so the default proposal merges the paper DP's candidates with it wherever "
            "the DP is tractable (64 GPUs here) and is the closed form alone beyond (1,024). "
            "Quick mode runs neither the paper's DP nor the ILP packing. We do not time the ideal "
            "(ILP) dispatch, which Hydraulis itself rejects."
        ),
    )


if __name__ == "__main__":
    main()
