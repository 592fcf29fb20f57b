"""Real tokens/s of DynaPipe (dynamic micro-batching + adaptive schedule) against megatron-core's
1F1B on fixed-length rows, on this machine (seed `dynapipe.txt` §8: throughput against the
packing baseline on long-tailed data). CPU ranks by default; `--nproc-per-node` GPUs with CUDA.

Every method is the real training program: `torchrun --nproc-per-node 2 pretrain_gpt.py`
(PP=2, gloo), the same small GPT from the same seed and the same token budget per iteration of
a long-tailed dataset truncated at 4,096 tokens.

- DynaPipe: `--dynamic-micro-batching --pipeline-schedule adaptive`, planned with the analytic
  cost model of `--dynapipe-gpu` (no CPU cost table is needed to run).
- `--baseline packing-1f1b`: the same global batches (same data, seed and token budget; the
  sampler depends on nothing else) packed first-fit-decreasing into rows of exactly
  `--seq-length` tokens, run by megatron-core's `get_forward_backward_func()`. Dropout is off, so
  its first iteration's loss must equal DynaPipe's: the script prints both as the check that
  they trained the same model on the same data.
- `--baseline megatron-1f1b`: what Megatron-LM trains, megatron-core's GPTDataset windows of
  the same documents (concatenated, cut every `--seq-length` tokens, attention across document
  boundaries), token budget / seq-length windows per iteration, other samples than DynaPipe's.

Each baseline's micro-batch size is the best measured of a small grid (default 1, 2, 4 rows).

What the ratio measures on CPU: megatron-core's local attention (the only one without a GPU)
computes every row's full seq-length x seq-length scores, then masks all but the diagonal blocks,
so a packed row pays attention for 4,096^2 positions whatever it holds, while a DynaPipe
micro-batch pays for its own padded length. At 4,096 tokens and hidden 128 attention is most of a
row's FLOPs, so this is where the gain comes from. With TransformerEngine or flash-attention
varlen kernels on GPU, packed rows pay only their samples' own attention; the planner's analytic
A100 model prices packing that way and predicts close throughputs for this small model (README).

Measurement: each run's per-iteration log line gives real tokens / (forward-backward + optimiser
step time) (data loading and planning are outside that time, for both methods); the first
`--warmup-iters` iterations of each run are dropped and the median of the rest is reported, with
padding efficiency. The methods run one after another, so load from other processes on a shared
machine shifts them unequally: `--rounds N` repeats every method N times in alternating order and
pools the iterations, and the 1-minute load average is printed around every run. Iteration i of
DynaPipe and of packing-1f1b trains the same global batch, so their per-iteration ratios are
printed too. Not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.torchrun_runs import add_model_args, run

BASELINES = ("packing-1f1b", "megatron-1f1b")


@dataclass
class Run:
    """One torchrun of one method: its measured iterations' log fields and the load around it."""

    label: str
    iterations: list[dict[str, float]]
    first_loss: float
    load: tuple[float, float]


def _model_args(args: argparse.Namespace) -> list[str]:
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length),
        "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size),
        "--tokens-per-global-batch", str(args.tokens_per_global_batch),
        "--data-path", args.data_path, "--seed", str(args.seed),
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
    print(f"  {label:<32} tokens/s {tokens_per_s}", flush=True)
    return result


def _median(runs: list[Run], key: str) -> float:
    return statistics.median(row[key] for run in runs for row in run.iterations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", default="synthetic:flan", help="as pretrain_gpt.py's")
    parser.add_argument("--tokens-per-global-batch", type=int, default=16384)
    add_model_args(parser, hidden_size=128, seq_length=4096)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--nproc-per-node", type=int, default=2, help="ranks (one GPU each where CUDA is)"
    )
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    parser.add_argument(
        "--extra-args", default="", help="pretrain_gpt.py flags for every method, e.g. '--bf16'"
    )
    parser.add_argument("--warmup-iters", type=int, default=1)
    parser.add_argument("--measured-iters", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every method this many times, alternating the order, and pool the iterations "
        "(evens out load that drifts on a shared machine)",
    )
    parser.add_argument(
        "--baseline-micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4], metavar="ROWS"
    )
    parser.add_argument(
        "--baselines", nargs="+", choices=BASELINES, default=list(BASELINES), metavar="BASELINE"
    )
    parser.add_argument(
        "--dynapipe-args",
        default="",
        help="extra pretrain_gpt.py flags for DynaPipe, e.g. '--dynapipe-memory-limit 1'",
    )
    args = parser.parse_args()
    import torch

    where = (
        f"{args.nproc_per_node} x {torch.cuda.get_device_name()} (nccl)"
        if torch.cuda.is_available()
        else f"{os.cpu_count()} CPUs (gloo, OMP_NUM_THREADS=1 per rank)"
    )
    print(
        f"PP={args.pipeline_model_parallel_size}, {args.nproc_per_node} ranks on {where}; GPT "
        f"{args.num_layers} layers x {args.hidden_size} hidden; {args.data_path} truncated at "
        f"{args.seq_length}; {args.tokens_per_global_batch:,} tokens per global batch; median "
        f"of {args.measured_iters} iterations after {args.warmup_iters} warm-up per run, "
        f"{args.rounds} round(s)",
        flush=True,
    )
    dynapipe = "dynapipe (dynamic + adaptive)"
    methods = {
        dynapipe: [
            "--dynamic-micro-batching",
            "--pipeline-schedule",
            "adaptive",
            *args.dynapipe_args.split(),
        ],
        **{
            f"{baseline} (mbs={mbs})": ["--baseline", baseline, "--micro-batch-size", str(mbs)]
            for baseline in args.baselines
            for mbs in args.baseline_micro_batch_sizes
        },
    }
    runs: dict[str, list[Run]] = {label: [] for label in methods}
    for round_index in range(args.rounds):
        order = list(methods) if round_index % 2 == 0 else list(reversed(methods))
        for label in order:
            runs[label].append(run_method(label, methods[label], args))
    print("method                           median tokens/s  padding eff  micro-batches  iter ms")
    for label, method_runs in runs.items():
        tps, eff = _median(method_runs, "tps"), _median(method_runs, "eff")
        mbs, ms = _median(method_runs, "mbs"), _median(method_runs, "ms")
        print(f"{label:<32} {tps:>15,.0f}  {eff:>11.3f}  {mbs:>13.0f}  {ms:>7,.0f}")
    for baseline in args.baselines:
        best = max(
            (label for label in runs if label.startswith(baseline)),
            key=lambda k: _median(runs[k], "tps"),
        )
        ratio = _median(runs[dynapipe], "tps") / _median(runs[best], "tps")
        print(
            f"ratio: {ratio:.2f}x median real tokens/s of DynaPipe over the best {baseline} "
            f"({best}); target 1.5x {'met' if ratio >= 1.5 else 'NOT met'}"
        )
        if baseline != "packing-1f1b":
            continue  # other samples: neither the losses nor single iterations compare
        losses = ", ".join(f"{run.first_loss:.4f}" for run in [*runs[dynapipe], *runs[best]])
        print(f"  first-iteration losses (same model, same data): {losses}")
        paired = [
            ours["tps"] / theirs["tps"]
            for dyn_run, best_run in zip(runs[dynapipe], runs[best], strict=True)
            for ours, theirs in zip(dyn_run.iterations, best_run.iterations, strict=True)
        ]
        print(
            "  per-iteration ratios (same global batch, same round): "
            + ", ".join(f"{r:.2f}" for r in paired)
            + f"; median {statistics.median(paired):.2f}x"
        )


if __name__ == "__main__":
    main()
