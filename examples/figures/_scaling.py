"""Plot and summary shared by DynaPipe Fig. 13 and Fig. 14 (rows from `scaling_point`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from examples.figures._common import Run, subplots

STYLE = {"dynapipe": "o-", "baseline": "s-", "baseline (c)": "^--"}


def plot_scaling(run: Run, rows: Sequence[dict[str, Any]], x: str, xlabel: str) -> Figure:
    gpus = sorted({r["gpus"] for r in rows})
    fig, axes = subplots(run, ncols=len(gpus), nrows=2, width=3.6, height=3.0)
    for r_i, family in enumerate(("gpt", "t5")):
        for c_i, g in enumerate(gpus):
            ax = axes[r_i * len(gpus) + c_i]
            mine = [r for r in rows if r["family"] == family and r["gpus"] == g]
            for method, style in STYLE.items():
                pts = [r for r in mine if r["method"] == method]
                label = method if family == "gpt" else method.replace("baseline", "padding")
                if family == "gpt":
                    label = label.replace("baseline", "packing")
                ax.plot(
                    [r[x] for r in pts],
                    [r["tokens_per_s"] / 1e3 for r in pts],
                    style,
                    label=label,
                    ms=4,
                )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mine[0]['model']}, {g} GPUs", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("throughput (k tokens/s)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    return fig


def oom_points(rows: Sequence[dict[str, Any]], x: str) -> str:
    """Which points ran out of memory under which method (computed, for the notes)."""
    found = []
    for r in rows:
        if r["oom"] and r["method"] != "baseline (c)":
            found.append(f"{r['model']} / {r['gpus']} GPUs / {x} {r[x]}: {r['method']}")
    return "; ".join(found) if found else "none"


def summary(rows: Sequence[dict[str, Any]], x: str) -> str:
    """DynaPipe over the baseline per point ("both OOM" where neither fits), and per family the
    mean and least gain where both fit."""
    lines: list[str] = []
    gains: dict[str, list[float]] = {"gpt": [], "t5": []}
    for family in ("gpt", "t5"):
        for g in sorted({r["gpus"] for r in rows}):
            mine = [r for r in rows if r["family"] == family and r["gpus"] == g]
            ratios = []
            for value in sorted({r[x] for r in mine}):
                at = {r["method"]: r for r in mine if r[x] == value}
                dyn, base = at["dynapipe"], at["baseline"]
                if dyn["oom"] and base["oom"]:
                    ratios.append(f"{value}: both OOM")
                elif dyn["oom"]:
                    ratios.append(f"{value}: DynaPipe OOM")
                elif base["oom"]:
                    ratios.append(f"{value}: baseline OOM")
                else:
                    gain = dyn["tokens_per_s"] / base["tokens_per_s"]
                    gains[family].append(gain)
                    ratios.append(f"{value}: {gain:.2f}x")
            lines.append(
                f"- {family.upper()} {mine[0]['model']} on {g} GPUs, DynaPipe / baseline by "
                f"{x}: " + ", ".join(ratios) + "."
            )
    for family, baseline in (("gpt", "packing"), ("t5", "padding")):
        if gains[family]:
            lines.append(
                f"- {family.upper()}: mean gain over {baseline} {np.mean(gains[family]):.3f}x, "
                f"least {min(gains[family]):.3f}x over {len(gains[family])} points."
            )
    return "\n".join(lines)
