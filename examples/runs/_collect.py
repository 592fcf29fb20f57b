"""Records and draws the real runs of `examples/runs/*.sh` (issue #19): the one place that reads
their logs.

    run  --out DIR --panel P --x-name N --x X --method M -- CMD...
        runs CMD (a `torchrun ... pretrain_gpt.py ...`), its output into DIR/logs/, echoes the
        iteration lines, and appends a record to DIR/runs.jsonl: the grid point, the command,
        its exit status, wall time and peak memory. A failed run (out of memory at a long
        sequence, say) is a result, recorded and reported; the sweep goes on.
    skip --out DIR --panel P --x-name N --x X --method M --reason R
        records a method the runtime cannot run at that point, and why.
    draw NAME --out DIR --workload TEXT [--tiny] [--warmup K] [--started EPOCH_S]
        reads every record and its log and writes DIR/NAME.png, .csv and .md through
        `examples/figures/_common.py`, as the simulated figures do.

Per run, after dropping K warm-up iterations: the median over iterations of the log line's
real tokens/s and iteration time (`benchmarks/torchrun_runs.iteration_rows` parses the
lines), and the planner's prediction beside them: its predicted iteration time (`predicted`
in the line, for the `--dynapipe-gpu` device the plans are priced on) and the tokens/s that
time gives for the same tokens. `--baseline megatron-1f1b` runs no planner, so it has no
prediction. The iteration line carries no memory, so peak memory is measured around the run:
the peak resident set of its largest process (a rank, torchrun or a planner worker; host
memory, from getrusage of the run's reaped processes). On CPU ranks that is the rank's
tensors plus about 0.5 GiB of Python and torch; GPU memory is not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m examples.runs._collect")

from benchmarks.torchrun_runs import iteration_rows
from examples.figures._common import PaperFigure, Run, subplots, write_outputs

GiB = 2**30
RECORDS = "runs.jsonl"


@dataclass(frozen=True)
class Figure:
    """A script's paper figure and what the paper reports, quoted for the note."""

    figure: PaperFigure
    paper: str


FIGURES = {
    f.figure.name: f
    for f in (
        Figure(
            PaperFigure(
                "dynapipe_fig13_14",
                "DynaPipe",
                "Fig. 13/14",
                "measured throughput vs max sequence length and global batch",
            ),
            "§8.1-8.2, Figs. 13 and 14 (GPT and T5 of Table 1 on 4-32 A100-40GB, FLANv2): the "
            'throughput of the packing baseline (MLM+DS) "decreases rapidly as maximum sequence '
            'length scales up" while DynaPipe\'s decrease "is much less"; at maximum length '
            "2048, both grow with the global batch and DynaPipe faster; up to 3.25x over "
            "packing-based baselines when training GPT and 4.39x on T5 (§1).",
        ),
        Figure(
            PaperFigure(
                "hydraulis_fig10",
                "Hydraulis",
                "Fig. 10",
                "measured throughput of dynamic strategies vs homogeneous baselines",
            ),
            "§8.2, Fig. 10 (LLaMA 7B/13B/32B on 8-64 A800, contexts 16K and 32K): Hydraulis "
            '"achieves 1.32-2.66x improvement over the best baselines" (Megatron-LM, '
            "DeepSpeed and HotSPa, each with its tuned homogeneous strategies).",
        ),
        Figure(
            PaperFigure(
                "galvatron_table2",
                "Galvatron-BMW",
                "Table II",
                "measured throughput of the searched plan vs pure strategies",
            ),
            "§VII-B, Table II (8 RTX TITAN under 8/12/16/20 GB; each strategy's maximum "
            "samples/s, its batch in brackets): on BERT-Huge-32, DP, TP and PP run out of memory "
            "at 8 GB, SDP reaches 4.65 (8) and Galvatron-BMW 19.06 (184); at 20 GB DP 11.57 "
            "(16), TP 6.06 (16), PP 13.52 (24), SDP 17.06 (40), Galvatron-BMW 29.08 (256).",
        ),
        Figure(
            PaperFigure(
                "hexiscale_table2",
                "HexiScale",
                "Table 2",
                "measured throughput of the asymmetric plan vs symmetric layouts",
            ),
            "§5.3, Table 2: for Llama 30B on setting 3 the search finds four pipelines of "
            "different layouts (one of 8 A800 at TP8 holding all 60 layers; others of RTX 4090 "
            "stages at TP4 with RTX 3090 stages at TP2, ...); §5.1: against homogeneous "
            "clusters of the same total peak FLOPS the MFU gap is as low as 0.3% and 3.5% on "
            "average.",
        ),
    )
}
COLUMNS = [
    "panel", "x_name", "x", "method", "status", "iterations", "tokens_per_s", "iteration_ms",
    "predicted_ms", "predicted_tokens_per_s", "peak_rss_gib",
]  # fmt: skip


def _record(out: Path, **fields: Any) -> None:
    with (out / RECORDS).open("a") as f:
        f.write(json.dumps(fields) + "\n")


def _point(args: argparse.Namespace) -> dict[str, str]:
    return {"panel": args.panel, "x_name": args.x_name, "x": args.x, "method": args.method}


def run(args: argparse.Namespace) -> None:
    """Run one command, its output into a log, and record it (exit status 0 either way)."""
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = "_".join(f"{v}" for v in _point(args).values())
    log = logs / ("".join(c if c.isalnum() or c in "-." else "_" for c in name) + ".log")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    print(f"  {args.method} at {args.x_name} {args.x}: {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if iteration_rows(line):
                print("    " + line.strip(), flush=True)
        status = proc.wait()
    # Linux reports kilobytes: the largest of every process of the run (grandchildren too).
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    wall = time.perf_counter() - started
    print(f"    exit {status}, {wall:.0f} s, log {log}", flush=True)
    _record(
        args.out, **_point(args), command=shlex.join(command), log=log.name,
        status="ok" if status == 0 else f"exit {status}", peak_rss_bytes=peak_rss, wall_s=wall,
    )  # fmt: skip


def skip(args: argparse.Namespace) -> None:
    print(f"  {args.method} at {args.x_name} {args.x}: not runnable: {args.reason}", flush=True)
    _record(args.out, **_point(args), command="", log="", status="not runnable: " + args.reason)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def measured_row(record: dict[str, Any], out: Path, warmup: int) -> dict[str, Any]:
    """One CSV row: the record's point and status, and its medians after the warm-up."""
    row = {k: record[k] for k in ("panel", "x_name", "x", "method", "status")}
    row.update({k: "" for k in COLUMNS[5:]})
    if record["status"] != "ok":
        return row
    iterations = iteration_rows((out / "logs" / record["log"]).read_text())[warmup:]
    if not iterations:
        row["status"] = "no iteration lines after the warm-up"
        return row
    tps = [_number(r["tps"]) for r in iterations]
    ms = [_number(r["ms"]) for r in iterations]
    row.update(
        iterations=len(iterations),
        tokens_per_s=round(statistics.median(tps), 1),
        iteration_ms=round(statistics.median(ms), 1),
        peak_rss_gib=round(record["peak_rss_bytes"] / GiB, 3),
    )
    predicted = [
        (_number(r["predicted"]), t * m / 1e3)  # (predicted ms, tokens of the iteration)
        for r, t, m in zip(iterations, tps, ms, strict=True)
        if r["predicted"] is not None and _number(r["predicted"]) > 0
    ]
    if predicted:
        row["predicted_ms"] = round(statistics.median(p for p, _ in predicted), 3)
        row["predicted_tokens_per_s"] = round(
            statistics.median(tokens / (p / 1e3) for p, tokens in predicted), 1
        )
    return row


def _sort_key(x: str) -> tuple[int, float | str]:
    try:
        return (0, float(x))
    except ValueError:
        return (1, x)


def plot(run: Run, rows: list[dict[str, Any]]):
    """One column per panel; rows of axes: measured tokens/s, predicted tokens/s, peak RSS. A
    run that failed or cannot run is an x at 0 on the measured axis (the tables' OOM cells)."""
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    metrics = (
        ("tokens_per_s", "measured tokens/s"),
        ("predicted_tokens_per_s", "predicted tokens/s (planner)"),
        ("peak_rss_gib", "peak RSS, largest process (GiB)"),
    )
    width = max(4.6, 8.0 / len(panels))  # room for the title above a single column
    fig, axes = subplots(run, ncols=len(panels), nrows=len(metrics), width=width, height=2.9)
    for col, panel in enumerate(panels):
        mine = [r for r in rows if r["panel"] == panel]
        xs = sorted({r["x"] for r in mine}, key=_sort_key)
        for row_i, (key, label) in enumerate(metrics):
            ax = axes[row_i * len(panels) + col]
            for m, method in enumerate(methods):
                runs = [r for r in mine if r["method"] == method]
                at = {r["x"]: r[key] for r in runs if r[key] != ""}
                pts = [(k, at[x]) for k, x in enumerate(xs) if x in at]
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", color=f"C{m}", ms=4, label=method)
                failed = [xs.index(r["x"]) for r in runs if r["status"] != "ok"]
                if key == "tokens_per_s" and failed:
                    ax.plot(failed, [0] * len(failed), "x", color=f"C{m}", ms=7, clip_on=False)
            ax.set_xticks(range(len(xs)), xs, fontsize=7)
            ax.set_xlim(-0.5, len(xs) - 0.5)
            ax.set_xlabel(mine[0]["x_name"], fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if row_i == 0:
                ax.set_title(panel, fontsize=9)
                ax.legend(fontsize=6)
    return fig


def hardware() -> str:
    """The machine the runs used: its GPUs if nvidia-smi lists any, else its CPU."""
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True).stdout.split("\n")
        gpus = [g.strip() for g in gpus if g.strip()]
        if gpus:
            kinds = ", ".join(f"{gpus.count(g)} x {g}" for g in dict.fromkeys(gpus))
            return f"{kinds} (nvidia-smi), {os.cpu_count()} CPU cores"
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.machine()
    return f"no GPU: CPU ranks (gloo) on {os.cpu_count()} cores of {cpu}"


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    return a["tokens_per_s"] / b["tokens_per_s"]


def summary(rows: list[dict[str, Any]]) -> str:
    """Per point, each method's tokens/s and the first method's (the paper's system) over each
    of the others'."""
    lines = []
    for panel in dict.fromkeys(r["panel"] for r in rows):
        mine = [r for r in rows if r["panel"] == panel]
        for x in sorted({r["x"] for r in mine}, key=_sort_key):
            at = [r for r in mine if r["x"] == x]
            parts = [
                f"{r['method']} {r['tokens_per_s']:,.0f} tokens/s"
                if r["status"] == "ok"
                else f"{r['method']} {r['status']}"
                for r in at
            ]
            first = at[0]
            ratios = [
                f"{first['method']} / {r['method']} {_ratio(first, r):.2f}x"
                for r in at[1:]
                if first["status"] == "ok" and r["status"] == "ok"
            ]
            ratio_text = f" ({', '.join(ratios)})" if ratios else ""
            lines.append(f"- {panel}, {at[0]['x_name']} {x}: {'; '.join(parts)}{ratio_text}.")
    return "\n".join(lines)


def commands(records: list[dict[str, Any]]) -> str:
    """The first command line of every method (the others differ only in the grid's value)."""
    first = {}
    for r in records:
        if r["command"]:
            first.setdefault(r["method"], r["command"])
    return "\n".join(f"- {method}: `{command}`" for method, command in first.items())


def failures(records: list[dict[str, Any]], out: Path) -> str:
    """Each failed run's last error line (the log keeps the rest)."""
    lines = []
    for r in records:
        if r["status"].startswith("exit"):
            text = (out / "logs" / r["log"]).read_text().splitlines()
            errors = [t for t in text if "error" in t.lower()] or text[-1:] or ["(no output)"]
            lines.append(f"- {r['method']} at {r['x_name']} {r['x']}: {errors[-1].strip()}")
    return "\n".join(lines)


def draw(args: argparse.Namespace) -> None:
    spec = FIGURES[args.name]
    records = [json.loads(line) for line in (args.out / RECORDS).read_text().splitlines()]
    rows = [measured_row(r, args.out, args.warmup) for r in records]
    if not any(r["status"] == "ok" for r in rows):
        raise SystemExit(f"{args.name}: no run succeeded; see the logs in {args.out / 'logs'}")
    # The note's runtime is the whole sweep's, from the script's start.
    run = Run(spec.figure, args.out, args.tiny, time.perf_counter() - (time.time() - args.started))
    fig = plot(run, rows)
    failed = failures(records, args.out)
    tiny = (
        "TINY mode: a tiny GPT on CPU ranks for a few iterations. These numbers test the script; "
        "they are not the paper's and say nothing about GPUs. "
        if args.tiny
        else ""
    )
    coarse = sum(1 for r in rows if r["predicted_ms"] != "" and r["predicted_ms"] < 10)
    rounding = (
        f" {coarse} of the median predictions are under 10 ms, and the homogeneous line prints "
        "whole milliseconds (the heterogeneous one tenths): those predicted tokens/s are coarse."
        if coarse
        else ""
    )
    write_outputs(
        run,
        rows,
        fig,
        source=f"examples/runs/{args.name}.sh",
        workload=(
            f"Measured on {hardware()}; 1-minute load {os.getloadavg()[0]:.1f} when drawn. "
            f"{args.workload.strip()} Each point is one `torchrun pretrain_gpt.py` run: medians "
            f"over its iterations after {args.warmup} warm-up iteration(s). Commands (first "
            f"point of each method):\n\n{commands(records)}"
        ),
        paper=spec.paper,
        ours=summary(rows) + (f"\n\nFailed runs:\n\n{failed}" if failed else ""),
        differences=(
            tiny + "Measured tokens/s count real tokens (no padding) over the whole iteration. "
            "Predicted tokens/s is the planner's predicted iteration time for the "
            "`--dynapipe-gpu` device its cost model describes (the runtime's default is "
            "A100-80GB), not for this machine, unless the run was given the matching "
            "`--dynapipe-gpu` or a profiled `--dynapipe-cost-model`; megatron-1f1b runs no "
            "planner. Peak memory is the peak resident set (host memory) of the run's largest "
            "process, measured around the run: the iteration line does not report the ranks' "
            "tensor or GPU memory. Data is SYNTHETIC where the data path says `synthetic:`."
            + rounding
        ),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands_ = parser.add_subparsers(dest="command_name", required=True)
    for name, func in (("run", run), ("skip", skip)):
        p = commands_.add_parser(name)
        p.add_argument("--out", type=Path, required=True)
        for flag in ("--panel", "--x-name", "--x", "--method"):
            p.add_argument(flag, required=True)
        p.set_defaults(func=func)
    commands_.choices["run"].add_argument("command", nargs=argparse.REMAINDER)
    commands_.choices["skip"].add_argument("--reason", required=True)
    p = commands_.add_parser("draw")
    p.add_argument("name", choices=sorted(FIGURES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workload", required=True, help="what the script ran, for the note")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--started", type=float, default=time.time(), help="the sweep's start (epoch s)")
    p.add_argument("--warmup", type=int, default=1, help="iterations dropped per run")
    p.set_defaults(func=draw)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
