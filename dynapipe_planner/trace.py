"""Pictures of a simulated iteration: a Chrome trace for Perfetto and a static PNG timeline.

The trace is for digging into one plan (zoom, select, measure); the PNG is for reports and
side-by-side comparisons of schedules. Both are written atomically so a viewer or a figure script
never reads a half-written file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .plan import atomic_write
from .simulate import Event, Rank, SimulationResult

COLOURS = {"F": "#4C72B0", "B": "#55A868"}
PASS_NAMES = {"F": "forward", "B": "backward"}
_US = 1e6


def write_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    """Trace-event JSON: one process per replica, one thread per stage, and one extra thread per
    stage boundary for its transfers, so communication never hides compute. Transfer rows
    start after the deepest replica's stages; a shallower replica names only its own rows."""
    num_stages = 1 + max((stage for _, stage in result.ranks), default=0)
    depth: dict[int, int] = {}
    for replica, stage in result.ranks:
        depth[replica] = max(depth.get(replica, 0), stage + 1)
    events: list[dict] = []
    for replica in sorted(depth):
        events += _row_names(replica, depth[replica], num_stages)
    events += [_complete(e, e.rank[1]) for e in result.compute_events]
    events += [_complete(e, num_stages + min(e.rank[1], e.peer)) for e in result.transfer_events]
    payload = {"traceEvents": events, "displayTimeUnit": "ms"}
    atomic_write(Path(path), json.dumps(payload, separators=(",", ":")).encode())


def _row_names(replica: int, depth: int, num_stages: int) -> list[dict]:
    rows = [(stage, f"stage {stage}") for stage in range(depth)]
    rows += [(num_stages + j, f"p2p {j}<->{j + 1}") for j in range(depth - 1)]
    meta = [_meta("process_name", replica, 0, {"name": f"replica {replica}"})]
    meta.append(_meta("process_sort_index", replica, 0, {"sort_index": replica}))
    for tid, name in rows:
        meta.append(_meta("thread_name", replica, tid, {"name": name}))
        meta.append(_meta("thread_sort_index", replica, tid, {"sort_index": tid}))
    return meta


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def _complete(event: Event, tid: int) -> dict:
    args = {"mb": event.mb, "start_s": event.start, "end_s": event.end}
    if event.peer >= 0:
        args["from_stage"], args["to_stage"] = event.rank[1], event.peer
    return {
        "name": f"{event.kind}{event.mb}",
        "cat": PASS_NAMES.get(event.kind, "p2p"),
        "ph": "X",
        "pid": event.rank[0],
        "tid": tid,
        "ts": event.start * _US,
        "dur": (event.end - event.start) * _US,
        "args": args,
    }


def write_timeline_png(result: SimulationResult, path: str | Path, dpi: int = 100) -> None:
    """One row per rank, forward and backward passes in two colours, micro-batch ids on the
    bars wide enough to hold them, makespan and bubble fraction in the title."""
    ranks = result.ranks
    width_in = 14.0
    fig = Figure(figsize=(width_in, 1.2 + 0.35 * len(ranks)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    row = {rank: i for i, rank in enumerate(ranks)}
    spans: dict[tuple[str, Rank], list[tuple[float, float]]] = {}
    for e in result.compute_events:
        spans.setdefault((e.kind, e.rank), []).append((e.start, e.end - e.start))
    for (kind, rank), bars in spans.items():
        ax.broken_barh(bars, (row[rank] - 0.4, 0.8), facecolors=COLOURS[kind], edgecolor="white")
    px_per_s = 0.85 * width_in * dpi / (result.makespan or 1.0)
    for e in result.compute_events:
        label = str(e.mb)
        if (e.end - e.start) * px_per_s > 7 * len(label) + 4:
            mid = (e.start + e.end) / 2
            ax.text(mid, row[e.rank], label, ha="center", va="center", fontsize=7, color="white")
    _decorate(ax, result, ranks)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write(Path(path), buf.getvalue())


def _decorate(ax: Axes, result: SimulationResult, ranks: list[Rank]) -> None:
    ax.set_yticks(range(len(ranks)), [f"replica {r} stage {s}" for r, s in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, result.makespan or 1.0)
    ax.set_xlabel("time (s)")
    ax.set_title(
        f"simulated iteration: makespan {result.makespan:.6g} s, "
        f"bubble fraction {result.bubble_fraction:.1%}"
    )
    legend = [Patch(color=colour, label=PASS_NAMES[kind]) for kind, colour in COLOURS.items()]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
