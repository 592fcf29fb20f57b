"""HexiScale figure helpers shared by the `hexiscale_*` scripts: system labels and the
compute / bubble / communication split of a plan's iteration, read from
`benchmarks/hexiscale_breakdown.breakdown` (imported, not copied)."""

from __future__ import annotations

from benchmarks.hexiscale_breakdown import breakdown
from dynapipe_planner.hetero.cost import HeteroCostModel
from dynapipe_planner.hetero.layout import HeteroPlan

LABELS = {
    "ours": "HexiScale (ours)",
    "homogeneous": "homogeneous A800 PCIe",
    "megatron": "Megatron (symmetric)",
    "galvatron": "Galvatron-style",
    "metis": "Metis-style",
}
COLORS = {
    "ours": "tab:red",
    "homogeneous": "tab:gray",
    "megatron": "tab:blue",
    "galvatron": "tab:green",
    "metis": "tab:orange",
}
# breakdown() terms grouped as the paper's Figs. 1, 7 and 11 split an iteration.
PARTS = {
    "compute": ("mfu", "recompute", "ineff"),
    "bubble": ("steady", "bubble", "straggle"),
    "communication": ("tp", "p2p", "dp"),
}


def time_split(cost: HeteroCostModel, plan: HeteroPlan) -> dict[str, float]:
    """Seconds of one iteration spent computing, waiting in bubbles (fill / drain, waiting on
    the slowest stage or pipeline) and communicating, averaged over the devices weighted by
    peak FLOPS; the three add up to the iteration time."""
    points = breakdown(cost, plan)
    seconds = cost.estimate(plan).iteration_s / 100
    return {part: seconds * sum(points[t] for t in terms) for part, terms in PARTS.items()}
