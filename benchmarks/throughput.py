"""Real tokens/s of DynaPipe against its baselines, each the real training program
(`torchrun pretrain_gpt.py`), shared by `cpu_throughput.py` (CPU ranks) and `gpu_throughput.py`
(one rank per GPU): the same model from the same seed, the same token budget per iteration of
the same long-tailed data, dropout off. The two scripts differ only in their defaults.

Methods (seed `dynapipe.txt` §8 baselines):

- DynaPipe: `--dynamic-micro-batching --pipeline-schedule adaptive` (every micro-batch a THD
  sequence with per-sample attention, packed rows where its cost model prices them faster).
- `packing-1f1b`: the same global batches packed first-fit-decreasing into rows of exactly
  `--seq-length` tokens, each micro-batch one THD sequence with per-sample attention, run by
  megatron-core's `get_forward_backward_func()`. Its first loss must equal DynaPipe's (same
  model, same data): printed as the check.
- `megatron-1f1b`: what Megatron-LM trains, megatron-core's GPTDataset windows of the same
  documents (concatenated, cut every `--seq-length` tokens, attention across documents).
- `padding`: the planner's padding baseline, `--micro-batch-size` samples per micro-batch in
  data order, each padded to its longest, 1F1B, run by DynaPipe's executor (which runs
  megatron-core's 1F1B at its speed: `executor_overhead.py`).

Each baseline's micro-batch size is the best measured of a grid. Measurement: each run's
per-iteration log line gives real tokens / (forward-backward + optimiser step time); the first
`--warmup-iters` iterations of each run are dropped and the median of the rest is reported, with
padding efficiency. CPU work is real tokens per CPU-second (user + system) of all the run's
processes (ranks, torchrun, planner workers) between its iteration lines, which does not depend
on what else the machine runs (`torchrun_runs.tree_cpu_s`). `--rounds N` repeats every method
N times in alternating order and pools the iterations (load drifts on a shared machine); the
1-minute load average is printed around every run. Iteration i of DynaPipe, packing-1f1b and
padding trains the same global batch, so their per-iteration ratios are printed too. Each
planned method's "predicted" column is the planner's median prediction with the median
|predicted - measured| / measured; "fitted error" the same for the job's online fit
(`dynapipe_planner.online_fit`), over the measured iterations it predicted (run with
`--warmup-iters 11` for those after it has seen 10). Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass

from benchmarks.torchrun_runs import add_model_args, model_flags, run

BASELINES = {
    "packing-1f1b": ["--baseline", "packing-1f1b"],
    "megatron-1f1b": ["--baseline", "megatron-1f1b"],
    "padding": ["--batching", "padding"],
}
DYNAPIPE = "dynapipe (dynamic + adaptive)"


@dataclass
class Run:
    """One torchrun of one method: its measured iterations' log fields and the load around it."""

    label: str
    iterations: list[dict[str, float]]
    first_loss: float
    load: tuple[float, float]


@dataclass(frozen=True)
class Defaults:
    """What differs between the CPU and the GPU benchmark."""

    nproc_per_node: int
    pipeline_model_parallel_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    tokens_per_global_batch: int
    baselines: tuple[str, ...]
    micro_batch_sizes: tuple[int, ...]
    extra_args: str = ""


def parser(description: str, defaults: Defaults) -> argparse.ArgumentParser:
    """The benchmark's flags, with `defaults`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--data-path",
        default="synthetic:flan",
        help="as pretrain_gpt.py's; 'builtin': its built-in corpus (no --data-path)",
    )
    p.add_argument("--tokens-per-global-batch", type=int, default=defaults.tokens_per_global_batch)
    add_model_args(
        p,
        hidden_size=defaults.hidden_size,
        seq_length=defaults.seq_length,
        num_layers=defaults.num_layers,
        num_attention_heads=defaults.num_attention_heads,
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=defaults.nproc_per_node,
        help="ranks (one GPU each where CUDA is)",
    )
    p.add_argument(
        "--pipeline-model-parallel-size", type=int, default=defaults.pipeline_model_parallel_size
    )
    p.add_argument(
        "--extra-args",
        default=defaults.extra_args,
        help="pretrain_gpt.py flags for every method, e.g. '--bf16'",
    )
    p.add_argument("--warmup-iters", type=int, default=1)
    p.add_argument("--measured-iters", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every method this many times, alternating the order, and pool the iterations "
        "(evens out load that drifts on a shared machine)",
    )
    p.add_argument(
        "--baseline-micro-batch-sizes",
        type=int,
        nargs="+",
        default=list(defaults.micro_batch_sizes),
        metavar="ROWS",
    )
    p.add_argument(
        "--baselines",
        nargs="+",
        choices=list(BASELINES),
        default=list(defaults.baselines),
        metavar="BASELINE",
    )
    p.add_argument(
        "--dynapipe-args",
        default="",
        help="extra pretrain_gpt.py flags for DynaPipe, e.g. '--dynapipe-memory-limit-gib 1'",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: a tiny GPT, one round of one measured iteration, micro-batch size 1",
    )
    return p


def _model_args(args: argparse.Namespace) -> list[str]:
    return [
        *model_flags(args),
        "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size),
        "--tokens-per-global-batch", str(args.tokens_per_global_batch),
        *(["--data-path", args.data_path] if args.data_path != "builtin" else []),
        "--seed", str(args.seed),
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
        "--split", "1,0,0", "--eval-iters", "0",  # every document trains, as before #16
        "--train-iters", str(args.warmup_iters + args.measured_iters),
    ]  # fmt: skip


def run_method(label: str, method_args: list[str], args: argparse.Namespace) -> Run:
    """One torchrun of pretrain_gpt.py (`torchrun_runs.run`); keeps the iterations after the
    warm-up, as numbers."""
    load_before = os.getloadavg()[0]
    argv = [*_model_args(args), *method_args, *args.extra_args.split()]
    rows = run(label, args.nproc_per_node, argv, args.warmup_iters, args.measured_iters)
    iterations = [
        {k: float(v.replace(",", "")) for k, v in row.items() if v is not None} for row in rows
    ]
    result = Run(label, iterations, iterations[0]["first_loss"], (load_before, os.getloadavg()[0]))
    tokens_per_s = ", ".join(f"{r['tps']:,.0f}" for r in result.iterations)
    per_cpu_s = ", ".join(f"{cpu_work(r):,.0f}" for r in result.iterations)
    print(
        f"  {label:<32} tokens/s {tokens_per_s} | tokens/CPU-s {per_cpu_s} | load "
        f"{result.load[0]:.1f} -> {result.load[1]:.1f}",
        flush=True,
    )
    return result


def _median(runs: list[Run], key: str) -> float:
    return statistics.median(row[key] for run in runs for row in run.iterations)


def _median_error(rows: list[dict[str, float]], key: str) -> float:
    """Median |rows' `key` prediction - measured| / measured iteration time."""
    return statistics.median(abs(row[key] - row["ms"]) / row["ms"] for row in rows)


def cpu_work(row: dict[str, float]) -> float:
    """Real tokens per CPU-second of one iteration (its tokens are tokens/s x its time)."""
    return row["tps"] * row["ms"] / 1000 / row["cpu_s"]


def _median_cpu_work(runs: list[Run]) -> float:
    return statistics.median(cpu_work(row) for run in runs for row in run.iterations)


def _where(args: argparse.Namespace) -> str:
    import torch

    if torch.cuda.is_available():
        return f"{args.nproc_per_node} x {torch.cuda.get_device_name()} (nccl)"
    return f"{os.cpu_count()} CPUs (gloo, OMP_NUM_THREADS=1 per rank)"


def measure(args: argparse.Namespace) -> None:
    """Run every method (`--rounds` times, alternating) and print the comparison."""
    if args.smoke:  # the warm-up iteration stays: the first one has no CPU seconds
        args.num_layers, args.hidden_size, args.num_attention_heads = 2, 32, 4
        args.seq_length, args.tokens_per_global_batch = 128, 512
        args.warmup_iters, args.measured_iters = 1, 1
        args.rounds, args.baseline_micro_batch_sizes = 1, [1]
    print(
        f"PP={args.pipeline_model_parallel_size}, {args.nproc_per_node} ranks on {_where(args)}; "
        f"GPT {args.num_layers} layers x {args.hidden_size} hidden; {args.data_path} truncated "
        f"at {args.seq_length}; {args.tokens_per_global_batch:,} tokens per global batch; "
        f"median of {args.measured_iters} iterations after {args.warmup_iters} warm-up per run, "
        f"{args.rounds} round(s); extra flags: {args.extra_args or 'none'}",
        flush=True,
    )
    methods = {
        DYNAPIPE: [
            "--dynamic-micro-batching",
            "--pipeline-schedule",
            "adaptive",
            *args.dynapipe_args.split(),
        ],
        **{
            f"{baseline} (mbs={mbs})": [*BASELINES[baseline], "--micro-batch-size", str(mbs)]
            for baseline in args.baselines
            for mbs in args.baseline_micro_batch_sizes
        },
    }
    runs: dict[str, list[Run]] = {label: [] for label in methods}
    for round_index in range(args.rounds):
        order = list(methods) if round_index % 2 == 0 else list(reversed(methods))
        for label in order:
            runs[label].append(run_method(label, methods[label], args))
    _report(runs, args.baselines)


def _report(runs: dict[str, list[Run]], baselines: list[str]) -> None:
    print(
        "method                           median tokens/s  tokens/CPU-s  padding eff  "
        "micro-batches  iter ms  predicted ms (error)  fitted error"
    )
    for label, method_runs in runs.items():
        tps, eff = _median(method_runs, "tps"), _median(method_runs, "eff")
        mbs, ms = _median(method_runs, "mbs"), _median(method_runs, "ms")
        work = _median_cpu_work(method_runs)
        rows = [row for run in method_runs for row in run.iterations]
        predicted = (
            f"{statistics.median(row['predicted'] for row in rows):>12,.1f} "
            f"({_median_error(rows, 'predicted'):>5.1%})"
            if all("predicted" in row for row in rows)
            else f"{'-':>20}"
        )
        fitted = [row for row in rows if "fitted" in row]
        fit_error = f"{_median_error(fitted, 'fitted'):>12.1%}" if fitted else f"{'-':>12}"
        print(
            f"{label:<32} {tps:>15,.0f}  {work:>12,.0f}  {eff:>11.3f}  {mbs:>13.0f}  "
            f"{ms:>7,.0f}  {predicted}  {fit_error}"
        )
    for baseline in baselines:
        best = max(
            (label for label in runs if label.startswith(baseline)),
            key=lambda k: _median(runs[k], "tps"),
        )
        ratio = _median(runs[DYNAPIPE], "tps") / _median(runs[best], "tps")
        work = _median_cpu_work(runs[DYNAPIPE]) / _median_cpu_work(runs[best])
        print(
            f"ratio: {ratio:.2f}x median real tokens/s, {work:.2f}x tokens per CPU-second, of "
            f"DynaPipe over the best {baseline} ({best})"
        )
        if baseline == "megatron-1f1b":
            continue  # other samples: neither the losses nor single iterations compare
        losses = ", ".join(f"{run.first_loss:.4f}" for run in [*runs[DYNAPIPE], *runs[best]])
        print(f"  first-iteration losses (same model, same data): {losses}")
        paired = [
            ours["tps"] / theirs["tps"]
            for dyn_run, best_run in zip(runs[DYNAPIPE], runs[best], strict=True)
            for ours, theirs in zip(dyn_run.iterations, best_run.iterations, strict=True)
        ]
        print(
            "  per-iteration ratios (same global batch, same round): "
            + ", ".join(f"{r:.2f}" for r in paired)
            + f"; median {statistics.median(paired):.2f}x"
        )
