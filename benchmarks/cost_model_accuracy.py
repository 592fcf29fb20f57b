"""Cost-model accuracy: the planner's predicted iteration time and per-stage peak memory against
real training iterations (DynaPipe seed `dynapipe.txt` §8 "cost model accuracy", Fig. 18;
targets here: median time error under 10 %, memory under 6 %).

1. Profile a per-layer cost table of the model on this device with `tools/profile_costs.py`
   (or take `--cost-table`), every process pinned to one CPU thread as torchrun pins training.
2. Train it for `--iterations` real iterations with `megatron.dynapipe.training` under torchrun:
   PP=2 on 2 processes, dynamic micro-batching, the adaptive schedule, planned with that table
   (`--dynapipe-cost-model`), on a long-tailed dataset (default: the built-in stdlib corpus).
3. Compare every iteration's plan `stats["predicted_iteration_s"]` and
   `stats["peak_memory_bytes"][stage]` with what was measured; print median and p90 relative
   error, and write the points (CSV) and a predicted-vs-measured scatter plot (PNG).

What is measured, through `pretrain(probe=...)` around each iteration's pipeline run:

* time: wall time of running the plan's instructions up to finalised gradients (the part the
  plan predicts: forward and backward passes, transfers and waits), the slower of the two
  ranks. The optimiser step is not in the prediction and not in the measurement.
* busy (diagnostic): each rank's CPU time (`time.thread_time`) during that run against its
  stage's predicted forward + backward seconds; unlike wall time it barely changes when other
  processes compete for the cores, so it separates load from modelling errors.
* memory of a stage: `static + peak`, where `static` is the rank's live tensor bytes when the
  iteration starts (weights, gradient buffers, Adam state, the iteration's input tensors) and
  `peak` the maximum of the bytes allocated during the pipeline run that are alive at once
  (activations of micro-batches in flight, received buffers and gradients, each pass's
  workspace), read from the CPU allocator's events (CUDA: the allocator's counters); see
  `megatron.dynapipe.memory`. The table's numbers are taken with the same instrument
  (static + activations + transient), so both sides mean the same bytes.

CPU memory tracing slows the run it watches, so each iteration runs twice: a pass that only
times and a pass that only traces memory. Training is deterministic (same seed, same data
order, same plans: checked), so both passes run the same iterations. The first
`--warmup-iterations` are excluded: Adam allocates its state at the first step and first calls
allocate caches.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.cost_model_accuracy")

from benchmarks.torchrun_runs import ROOT, add_model_args, free_port, model_flags

WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, hidden_size=256, seq_length=1024)
    p.add_argument("--tokens-per-global-batch", type=int, default=16384)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--warmup-iterations", type=int, default=3)
    p.add_argument(
        "--memory-limit-gib", type=float, default=2.0, help="GiB per stage for the planner"
    )
    p.add_argument("--data-path", default="stdlib")
    p.add_argument("--microbatch-sizes", default="1,2,4,8,16", help="profiling grid")
    p.add_argument("--max-tokens", type=int, default=16384, help="profiling grid token cap")
    p.add_argument("--cost-table", default=None, help="use this table instead of profiling")
    p.add_argument("--output-dir", default="cost_model_accuracy")
    p.add_argument("--smoke", action="store_true", help="a tiny model and grid, 2 iterations")
    p.add_argument("--worker", choices=("time", "memory"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:  # CI's check that the benchmark runs, not a measurement
        args.num_layers, args.hidden_size, args.seq_length = 2, 32, 128
        args.tokens_per_global_batch, args.iterations, args.warmup_iterations = 512, 2, 1
        args.microbatch_sizes, args.max_tokens = "1,2", 256
    if args.warmup_iterations >= args.iterations:
        p.error(f"--warmup-iterations {args.warmup_iterations} leaves no iteration to compare")
    return args


def _training_argv(args: argparse.Namespace) -> list[str]:
    return [
        *model_flags(args),
        "--pipeline-model-parallel-size", str(WORLD), "--dynamic-micro-batching",
        "--pipeline-schedule", "adaptive",
        "--tokens-per-global-batch", str(args.tokens_per_global_batch),
        "--train-iters", str(args.iterations), "--data-path", args.data_path,
        "--dynapipe-cost-model", args.cost_table,
        "--dynapipe-memory-limit-gib", str(args.memory_limit_gib),
        "--log-interval", "10", "--split", "1,0,0", "--eval-iters", "0", "--lr", "1e-4",
    ]  # fmt: skip


def _environment() -> dict[str, str]:
    # One thread per process in the profiler and in every rank, so the table describes training;
    # kineto's per-trace log lines off (read when torch loads).
    return {**os.environ, "OMP_NUM_THREADS": "1", "KINETO_LOG_LEVEL": "6"}


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


# ---------------------------------------------------------------- inside each torchrun rank


def _worker(args: argparse.Namespace, records_path: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    import torch

    from dynapipe_planner.cost import cost_model_from_description
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.arguments import parse_args as training_args
    from megatron.dynapipe.memory import MemoryTrace, live_tensor_bytes
    from megatron.dynapipe.training import pretrain

    torch.set_num_threads(1)
    device = ps.device()
    records: list[dict] = []
    tables = {}

    def predicted_busy_s(plan, stage: int) -> float:
        """This stage's forward + backward seconds for the plan's micro-batches, per the table."""
        recompute = plan.stats["recompute"]
        if recompute not in tables:
            model = cost_model_from_description(plan.meta["cost_model"])
            tables[recompute] = model.pipeline_costs(recompute)
        mine = [mb for mb in plan.microbatches if mb.replica == ps.replica()]
        fwd, bwd, _, _ = tables[recompute].stage_costs_many(
            np.array([mb.num_rows for mb in mine]),
            np.array([mb.seqlen for mb in mine]),
            np.array([mb.tgt_seqlen for mb in mine]),
        )
        return float((fwd + bwd)[:, stage].sum())

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @contextlib.contextmanager
    def probe(iteration: int, plan) -> Iterator[None]:
        stage = ps.stage()
        record = {
            "iteration": iteration,
            "stage": stage,
            "predicted_s": plan.stats["predicted_iteration_s"],
            "predicted_bytes": plan.stats["peak_memory_bytes"][stage],
            "num_microbatches": plan.stats["num_microbatches"],
        }
        if args.worker == "time":
            synchronize()
            started, cpu_started = time.perf_counter(), time.thread_time()
            yield
            synchronize()
            record["measured_s"] = time.perf_counter() - started
            record["busy_cpu_s"] = time.thread_time() - cpu_started
            record["predicted_busy_s"] = predicted_busy_s(plan, stage)
        else:
            static = live_tensor_bytes(device)
            with MemoryTrace(device) as trace, trace.phase("iteration"):
                yield
            record["static_bytes"] = static
            record["measured_bytes"] = static + trace.phases["iteration"].peak
        records.append(record)

    pretrain(training_args(_training_argv(args)), probe=probe)
    records_path.write_text(json.dumps(records))


# ---------------------------------------------------------------- the driver


def _run(cmd: list[str], what: str) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=_environment())
    if done.returncode != 0:
        sys.exit(f"{what} failed (exit code {done.returncode})")


def _profile(args: argparse.Namespace, out: Path) -> str:
    path = out / "cost_table.json"
    print(f"profiling the cost table ({_load()})", flush=True)
    started = time.perf_counter()
    cmd = [
        sys.executable, str(ROOT / "tools" / "profile_costs.py"), *model_flags(args),
        "--microbatch-sizes", args.microbatch_sizes, "--max-tokens", str(args.max_tokens),
        "--cpu-threads", "1", "--output", str(path),
    ]  # fmt: skip
    _run(cmd, "profiling")
    print(f"profiled in {time.perf_counter() - started:.0f} s ({_load()})", flush=True)
    return str(path)


def _train(args: argparse.Namespace, out: Path, mode: str) -> list[list[dict]]:
    print(f"training pass measuring {mode} ({_load()})", flush=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
        "--master-port", str(free_port()), "-m", "benchmarks.cost_model_accuracy",
        *model_flags(args),
        "--tokens-per-global-batch", str(args.tokens_per_global_batch),
        "--iterations", str(args.iterations),
        "--warmup-iterations", str(args.warmup_iterations),
        "--memory-limit-gib", str(args.memory_limit_gib),
        "--data-path", args.data_path, "--cost-table", args.cost_table,
        "--output-dir", str(out), "--worker", mode,
    ]  # fmt: skip
    _run(cmd, f"training ({mode})")
    print(f"done ({_load()})", flush=True)
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(WORLD)]


def _points(args, timed: list[list[dict]], traced: list[list[dict]]) -> list[dict]:
    """One time point per iteration and one memory point per (iteration, stage); rank r runs
    stage r (PP=2, DP=1, TP=1)."""
    timed_at = [{r["iteration"]: r for r in rank} for rank in timed]
    traced_at = [{r["iteration"]: r for r in rank} for rank in traced]
    points = []
    for it in range(args.warmup_iterations, args.iterations):
        plans = {
            (rank[it]["predicted_s"], rank[it]["stage"], rank[it]["predicted_bytes"])
            for rank in (*timed_at, *traced_at)
        }
        if len(plans) != WORLD:
            sys.exit(f"iteration {it}: the two passes planned differently; not comparable")
        points.append(
            {
                "kind": "time",
                "iteration": it,
                "stage": "",
                "predicted": timed_at[0][it]["predicted_s"],
                "measured": max(rank[it]["measured_s"] for rank in timed_at),
            }
        )
        points.extend(
            {
                "kind": "busy",
                "iteration": it,
                "stage": rank[it]["stage"],
                "predicted": rank[it]["predicted_busy_s"],
                "measured": rank[it]["busy_cpu_s"],
            }
            for rank in timed_at
        )
        points.extend(
            {
                "kind": "memory",
                "iteration": it,
                "stage": rank[it]["stage"],
                "predicted": rank[it]["predicted_bytes"],
                "measured": rank[it]["measured_bytes"],
            }
            for rank in traced_at
        )
    for p in points:
        p["rel_error"] = (p["predicted"] - p["measured"]) / p["measured"]
    return points


def _summary(points: list[dict], kind: str, target: float) -> str:
    err = np.array([p["rel_error"] for p in points if p["kind"] == kind])
    absolute = np.abs(err)
    median, p90 = np.median(absolute), np.percentile(absolute, 90)
    verdict = "meets" if median < target else "MISSES"
    return (
        f"{kind:6s}: median |error| {median:6.1%}  p90 {p90:6.1%}  mean signed {err.mean():+6.1%}"
        f"  over {len(err)} points ({verdict} the {target:.0%} target)"
    )


def _write_csv(points: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(points[0]))
        writer.writeheader()
        writer.writerows(points)


def _plot(points: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, kind, scale, unit, band in (
        (axes[0], "time", 1e3, "ms", 0.10),
        (axes[1], "memory", 2**-20, "MiB", 0.06),
        (axes[2], "busy", 1e3, "ms", 0.10),
    ):
        sel = [p for p in points if p["kind"] == kind]
        measured = np.array([p["measured"] for p in sel]) * scale
        predicted = np.array([p["predicted"] for p in sel]) * scale
        stages = np.array([p["stage"] if p["stage"] != "" else 0 for p in sel])
        for stage in sorted(set(stages.tolist())):
            mask = stages == stage
            label = "iteration" if kind == "time" else f"stage {stage}"
            ax.scatter(measured[mask], predicted[mask], s=14, alpha=0.7, label=label)
        lo, hi = (
            min(measured.min(), predicted.min()) * 0.9,
            max(measured.max(), predicted.max()) * 1.1,
        )
        line = np.array([lo, hi])
        ax.plot(line, line, "k-", lw=1, label="exact")
        ax.fill_between(line, line * (1 - band), line * (1 + band), color="grey", alpha=0.15,
                        label=f"±{band:.0%}")  # fmt: skip
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title({"time": "iteration time", "memory": "peak memory per stage",
                      "busy": "CPU time per stage (diagnostic)"}[kind])  # fmt: skip
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    out = Path(args.output_dir).resolve()
    if args.worker:
        _worker(args, out / f"{args.worker}_rank{os.environ['RANK']}.json")
        return
    out.mkdir(parents=True, exist_ok=True)
    print(f"cost-model accuracy benchmark, {_load()}", flush=True)
    args.cost_table = str(Path(args.cost_table).resolve()) if args.cost_table else None
    args.cost_table = args.cost_table or _profile(args, out)
    timed = _train(args, out, "time")
    traced = _train(args, out, "memory")
    points = _points(args, timed, traced)
    _write_csv(points, out / "points.csv")
    title = (
        f"GPT {args.num_layers}x{args.hidden_size}, PP={WORLD}, {args.data_path}, "
        f"iterations {args.warmup_iterations}..{args.iterations - 1}; {_load()}"
    )
    _plot(points, out / "scatter.png", title)
    print(f"predicted vs measured, iterations {args.warmup_iterations}..{args.iterations - 1}:")
    print("  " + _summary(points, "time", 0.10))
    print("  " + _summary(points, "memory", 0.06))
    print("  " + _summary(points, "busy", 0.10) + " (diagnostic, see below)")
    print(
        "busy: each stage's CPU time in the pipeline run (its compute, not its waits) against\n"
        "the table's forward + backward for its micro-batches; CPU time hardly grows when other\n"
        "processes compete for the cores, wall time does, so a small busy error next to a large\n"
        "time error points at load rather than at the per-layer costs."
    )
    print(f"points: {out / 'points.csv'}; plot: {out / 'scatter.png'}; {_load()}")


if __name__ == "__main__":
    main()
