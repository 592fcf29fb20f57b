"""Shared output writing for the paper-figure scripts (issue #8).

Every script computes rows (dicts with the same keys), draws one matplotlib figure and writes
three files under `<out>/<name>/`: `<name>.png`, `<name>.csv` (exactly the plotted numbers) and
`<name>.md` (what the paper shows, what we got, where and why they differ). Titles follow
"DynaPipe Fig. 7: <caption>" so that every PNG names the paper figure it reproduces.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "out"


@dataclass(frozen=True)
class PaperFigure:
    """Which paper figure a script reproduces: `name` is the output stem (`dynapipe_fig7`)."""

    name: str
    paper: str
    number: str
    caption: str

    @property
    def title(self) -> str:
        return f"{self.paper} {self.number}: {self.caption}"


@dataclass
class Run:
    """One script's run: its output folder and wall-clock start (for the note's runtime)."""

    figure: PaperFigure
    out: Path
    quick: bool
    started: float = field(default_factory=time.perf_counter)


def start(figure: PaperFigure, argv: Sequence[str] | None = None, doc: str = "") -> Run:
    """Parse `--out DIR` (root of every figure's folder) and `--quick` (smallest workload)."""
    parser = argparse.ArgumentParser(description=(doc or figure.title).splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="root output folder")
    parser.add_argument("--quick", action="store_true", help="a tiny workload (smoke tests)")
    args = parser.parse_args(argv)
    out = args.out / figure.name
    out.mkdir(parents=True, exist_ok=True)
    return Run(figure, out, args.quick)


def subplots(run: Run, ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.8):
    """A figure titled with the paper figure, `ncols` x `nrows` axes (always a flat list)."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    fig.suptitle(run.figure.title, fontsize=11)
    return fig, list(axes.flat)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_outputs(
    run: Run,
    rows: Sequence[dict[str, Any]],
    fig: Figure,
    paper: str,
    ours: str,
    differences: str,
    workload: str = "",
    source: str = "",
) -> list[Path]:
    """Write PNG, CSV and markdown note; returns their paths. `rows` must share one key set;
    `source` names the script for the note (default `examples/figures/<name>.py`)."""
    if not rows:
        raise ValueError(f"{run.figure.name}: no rows to write")
    columns = list(rows[0].keys())
    for k, r in enumerate(rows):
        if list(r.keys()) != columns:
            raise ValueError(f"{run.figure.name}: row {k} has columns {list(r)}, not {columns}")
    stem = run.out / run.figure.name
    png, csv_path, md = (stem.with_suffix(s) for s in (".png", ".csv", ".md"))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    elapsed = time.perf_counter() - run.started
    parts = [
        f"# {run.figure.title}",
        "",
        f"![{run.figure.name}]({png.name})",
        "",
        f"Computed by `{source or f'examples/figures/{run.figure.name}.py'}` in {elapsed:.0f} s"
        + (" (quick mode)" if run.quick else "")
        + f"; the plotted numbers are in `{csv_path.name}`.",
    ]
    if workload:
        parts += ["", "## Workload", "", workload.strip()]
    parts += [
        "",
        "## What the paper shows",
        "",
        paper.strip(),
        "",
        "## What we got",
        "",
        ours.strip(),
        "",
        "## Where and why they differ",
        "",
        differences.strip(),
        "",
        "## Data",
        "",
        markdown_table(rows),
        "",
    ]
    md.write_text("\n".join(parts))
    print(f"{run.figure.name}: wrote {png}, {csv_path.name}, {md.name} ({elapsed:.1f} s)")
    return [png, csv_path, md]
