"""The executor's own overhead: DynaPipe's instruction-driven executor against megatron-core's
1F1B schedule (`get_forward_backward_func()`) on identical micro-batches (seed `dynapipe.txt`
§3 "instruction-driven executor"; target: at least 0.97 of megatron-core's tokens/s).

    python -m benchmarks.executor_overhead --rounds 5

Both run in the same two torchrun processes (PP=2, gloo, one CPU thread each), on the same
megatron-core GPT stage in Megatron DDP, the same global batch: `--microbatches` micro-batches
of `--micro-batch-size` rows of exactly `--seq-length` tokens. The planner's packing baseline
(`--batching packing`) plans that batch: every document fills one row, so each micro-batch is
`--micro-batch-size` full rows and the plan's schedule is 1F1B. DynaPipe's side runs that plan
with its executor (`PlanExecutor`); megatron-core's side runs the same plan's micro-batches
through its own schedule with `MegatronPackingBaseline` (`--baseline packing-1f1b`'s runner:
each micro-batch one THD sequence of its rows, fixed shapes, as `PlanExecutor` runs packed
rows). Megatron's fixed-length runner (`MegatronFixedLengthBaseline`) that this benchmark used
before is gone: `--baseline megatron-1f1b` now runs Megatron's own loop, which has no per-plan
runner to time, and the packing runner is megatron-core's schedule over identical tensors.
Each round times one iteration of each, in alternating order, as the slower rank's wall time
from a barrier to finalised gradients (no optimiser step: neither schedule includes it); the
first `--warmup` rounds are dropped. Printed: each side's median tokens/s, the per-round ratios
and their median, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.executor_overhead")

from benchmarks.torchrun_runs import ROOT, add_model_args, free_port, model_flags

WORLD = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, hidden_size=256, seq_length=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a tiny model, one round (CI's check)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # results path (a rank)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_layers, args.hidden_size, args.seq_length = 2, 32, 64
        args.micro_batch_size, args.microbatches, args.rounds, args.warmup = 1, 2, 1, 0
    return args


def _megatron_flags(args: argparse.Namespace) -> list[str]:
    return [
        *model_flags(args), "--pipeline-model-parallel-size", str(WORLD),
        "--batching", "packing", "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size * args.microbatches),
        "--train-iters", "1", "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--dynapipe-recompute", "none", "--vocab-size", "256", "--tokenizer-type",
        "NullTokenizer",
    ]  # fmt: skip


# ---------------------------------------------------------------- inside each torchrun rank


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from dynapipe_planner.megatron_model import spec_from_args
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.arguments import parse_args as parse_megatron
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.data.variable_length import in_memory_dataset
    from megatron.dynapipe.model import padded_vocab_size
    from megatron.dynapipe.pipeline.executor import PlanExecutor
    from megatron.dynapipe.pipeline.megatron_baseline import MegatronPackingBaseline
    from megatron.dynapipe.pipeline.plan_source import planner_recipe
    from megatron.dynapipe.stage import stage_in_ddp

    torch.set_num_threads(1)
    cpu_compat.install()
    margs = parse_megatron(_megatron_flags(args))
    ps.initialize(1, WORLD, 1)
    samples = args.micro_batch_size * args.microbatches
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 254, args.seq_length + 1) for _ in range(samples)]
    data = in_memory_dataset(
        "fixed", documents, args.seq_length + 1, vocab_size=256, eod_id=254, pad_id=255
    )
    vocab = padded_vocab_size(margs, 256, 1)
    config, model, _, _ = stage_in_ddp(margs, vocab)
    plan = planner_recipe(margs, spec_from_args(margs, vocab), 1).build()
    plan = plan.plan(data.lengths(), np.arange(samples))
    assert len(plan.microbatches) == args.microbatches, plan.stats
    batches = rank_microbatches(plan, 0, data)
    executor = PlanExecutor.for_this_rank(model, config, device=torch.device("cpu"))
    megatron = MegatronPackingBaseline(
        model, config, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        pad_id=255,
    )  # fmt: skip
    runners = {
        "DynaPipe executor": lambda: executor.run(plan, batches),
        "megatron-core 1F1B": lambda: megatron.run(plan, batches),
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds + args.warmup):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            model.zero_grad_buffer()
            dist.barrier()
            started = time.perf_counter()
            runners[name]()
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's wall time
            if r >= args.warmup:
                times[name].append(float(elapsed))
    if dist.get_rank() == 0:
        tokens = samples * args.seq_length
        Path(args.worker).write_text(json.dumps({"times": times, "tokens": tokens}))
    ps.destroy()


# ---------------------------------------------------------------- driver


def main() -> None:
    args = parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        passed = [a for a in sys.argv[1:]]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
            "--master-port", str(free_port()), "-m", "benchmarks.executor_overhead", *passed,
            "--worker", str(results),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        load_before = os.getloadavg()[0]
        started = time.time()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"executor_overhead: the torchrun run failed:\n{out.stderr[-3000:]}")
        measured = json.loads(results.read_text())
    times, tokens = measured["times"], measured["tokens"]
    ours, theirs = times["DynaPipe executor"], times["megatron-core 1F1B"]
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]  # tokens/s ours over theirs
    print(
        f"executor overhead: PP={WORLD} gloo CPU ranks (1 thread each), GPT {args.num_layers} "
        f"layers x {args.hidden_size}, {args.microbatches} micro-batches of "
        f"{args.micro_batch_size} x {args.seq_length} tokens, 1F1B; {args.rounds} rounds "
        f"(+{args.warmup} warm-up), alternating order"
    )
    for name, seconds in times.items():
        print(f"  {name:<20} {tokens / float(np.median(seconds)):>10,.0f} tokens/s (median)")
    print(
        f"  ratio DynaPipe / megatron-core: {float(np.median(ratios)):.3f} (median; per round "
        f"{', '.join(f'{x:.3f}' for x in ratios)}); 1-minute load {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}, {time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
