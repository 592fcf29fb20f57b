"""The Galvatron-BMW search against real runs of what it predicts (seed `galvatron_bmw.txt` §V
cost estimator, App. D "Estimation Performance"; issue #20's acceptance), on 4 CPU ranks.

1. Profile cost tables of the model on this machine in this run: TP 1 on one process, TP 2 and
   TP 4 under torchrun on 2 and 4 processes (`tools/profile_costs.py`, one thread per rank as
   torchrun gives training ranks; the multi-rank ones also measure gloo's all-reduce
   bandwidth), with the runs' flags (dropout off), one profile at a time. The 4 training
   ranks share the machine's 2 cores, and a layer's pass costs more CPU among them than
   alone (caches evicted at every switch, most where ranks sleep and wake at every
   hand-off): the TP-1 profile measures that factor as the first of 4 pipeline stages
   (`cpu_contention_factor`), which the search applies to the strategies whose tables'
   processes each had a core, on the passes after a hand-off (not on a recomputed forward,
   which runs warm, right before its backward). (Running 4 / TP profilers at once, as
   earlier versions did, did not make their timed passes overlap: the TP-1 tables measured
   a CPU share of 1.0.) The host's speed drifts (the same layer's forward measured 9.3 and
   10.4 ms alone 20 minutes apart), so every round profiles anew and its runs are predicted
   from its tables.
2. Set a per-rank memory budget that forbids plain DP: `--budget-fraction` (0.5) of the least
   peak the estimator gives uniform DP4 without recomputation over every micro-batch count
   (low enough that every uniform layout either checkpoints all its layers or runs small
   micro-batches, high enough that a plan may keep some layers plain at the micro-batch size
   the checkpointed ones run best at; at 0.4 the plans that fit came within 4% of each other
   by the estimate, and the searched plan and PP4+CKPT tied within their runs' noise).
3. Search with those tables (`runnable_search`: the plans `pretrain_gpt.py --parallel-plan`
   runs) at a fixed global batch, and price the uniform layouts: DP4, SDP4, TP4, TP2+DP2, PP4,
   PP2+DP2, PP2+TP2, each with and without full recompute, each searched alone (even
   partition, the micro-batch count free) under the same budget. Layouts over the budget are
   listed as "does not fit", layouts the runtime refuses as "refused: reason".
4. Run the searched plan and every uniform layout that fits and runs, for real
   (`torchrun --nproc-per-node 4 pretrain_gpt.py --parallel-plan`), on SYNTHETIC web/code-like
   data (91% of the samples full length at 128 tokens, padded to the longest per micro-batch),
   `--warmup` + `--iterations` iterations, plus a last one traced by `--log-peak-memory`;
   `--rounds` times, the layouts in turn and the order reversed every other round (A B C C B
   A ...), so that the machine's drift falls on all of them alike. The plans stay those of
   step 3; each round prices them again with its own tables (`price_plan`).
5. Print per layout the measured tokens/s and iteration time (per round the median over its
   measured iterations; printed: the median over the rounds and their range), the iteration
   time against the estimator's (Eq. 9 and the shared-core bound; the measurement also holds
   the optimiser step, which the prediction leaves out), and the largest rank's traced peak
   tensor memory against the largest predicted stage peak, each error taken per round and its
   median printed; then the targets: memory within 10%, time within 15%, searched >= best
   uniform in tokens/s. A target missed is printed as a MISS.

`--quick` profiles fewer points and, of a layout and its CKPT twin that both fit, runs the
one predicted faster (skipped rows say so). Not a test: CPU
numbers on a shared machine are noisy; the load average is printed with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.search_vs_run")

from benchmarks.torchrun_runs import (
    ROOT,
    RunTimedOut,
    add_model_args,
    alternating,
    free_port,
    model_flags,
    run,
)
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.search import (
    CostInputs,
    LayerStrategy,
    SearchResult,
    price_plan,
    profiled_cost_inputs,
    read_cost_tables,
    search,
)
from dynapipe_planner.search.plan_file import parallel_plan_refusal, write_plan
from dynapipe_planner.search.runnable import runnable_search

WORLD = 4
MiB = 2**20
# Dropout off in the runs (the layouts' losses then agree) and so in the profiles too: on a CPU
# its random masks are a third of a TP-4 layer's forward (measured 6.5 of 16 ms CPU at b=8).
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
UNIFORM = [  # name, PP degree, decision tree (root -> leaf)
    ("DP4", 1, ("dp",), (4,)),
    ("SDP4", 1, ("sdp",), (4,)),
    ("TP4", 1, ("tp",), (4,)),
    ("TP2+DP2", 1, ("dp", "tp"), (2, 2)),
    ("PP4", 4, (), ()),
    ("PP2+DP2", 2, ("dp",), (2,)),
    ("PP2+TP2", 2, ("tp",), (2,)),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, hidden_size=256, seq_length=128, num_layers=8)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--budget-fraction", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument(
        "--rounds", type=int, default=None, help="runs of every layout, alternated (3; --quick 2)"
    )
    p.add_argument("--microbatch-sizes", default="1,2,4,8,16", help="profiled sizes")
    p.add_argument("--repeats", type=int, default=5, help="profiler's timed runs per point")
    p.add_argument("--quick", action="store_true", help="fewer profile points and runs")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: a tiny GPT and grid, one round of the searched plan and one uniform "
        "layout, one iteration each (output in a temporary folder unless --out-dir)",
    )
    p.add_argument("--run-timeout-s", type=float, default=600.0)
    p.add_argument("--out-dir", default=None, help="default /tmp/search_vs_run")
    args = p.parse_args(argv)
    if args.quick:
        args.microbatch_sizes, args.repeats = "1,2,4,8", 3
        args.warmup, args.iterations = 1, 3
    if args.smoke:
        args.num_layers, args.hidden_size, args.seq_length = 4, 32, 64
        args.global_batch_size, args.microbatch_sizes, args.repeats = 8, "1,2", 1
        args.warmup, args.iterations, args.rounds = 0, 1, 1
        args.out_dir = args.out_dir or tempfile.mkdtemp(prefix="search_vs_run-")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    args.out_dir = args.out_dir or "/tmp/search_vs_run"
    return args


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} on {os.cpu_count()} CPUs"


def profile(args: argparse.Namespace, out: Path) -> list[Path]:
    """One cost table per TP degree in `out`, measured now on this machine: TP t on t
    processes of one thread each (as torchrun gives training ranks), one profile at a time;
    the TP-1 profile also measures what a layer's CPU seconds become beside the job's other
    ranks (`--cpu-contention-ranks`), which the search applies where they share cores."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KINETO_LOG_LEVEL": "6"}
    for tp in (1, 2, 4):
        started = time.perf_counter()
        path = out / f"costs_tp{tp}.json"
        launcher = [sys.executable]
        if tp > 1:
            launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                         "--master-port", str(free_port())]  # fmt: skip
        cmd = [
            *launcher, str(ROOT / "tools" / "profile_costs.py"), *model_flags(args), *NO_DROPOUT,
            "--tensor-model-parallel-size", str(tp), "--seqlens", str(args.seq_length),
            "--microbatch-sizes", args.microbatch_sizes, "--repeats", str(args.repeats),
            "--cpu-threads", "1", "--output", str(path),
        ]  # fmt: skip
        if tp == 1:
            cmd += ["--cpu-contention-ranks", str(WORLD)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"profiling TP {tp} failed:\n{' '.join(cmd)}\n{proc.stderr[-3000:]}")
        said = [x for x in proc.stdout.splitlines() if "bandwidth" in x or "CPU seconds" in x]
        print(f"  profiled TP {tp} in {time.perf_counter() - started:.0f} s ({_load()})"
              f"{''.join('; ' + x for x in said)}", flush=True)  # fmt: skip
        paths.append(path)
    return paths


@dataclass
class Layout:
    name: str
    result: SearchResult | None = None
    why_not: str = ""  # does not fit / refused / skipped
    tps_rounds: list[float] = field(default_factory=list)  # per round: median of its iterations
    seconds_rounds: list[float] = field(default_factory=list)
    peak_rounds: list[float] = field(default_factory=list)
    # per round: the plan priced with that round's cost tables
    predicted_s_rounds: list[float] = field(default_factory=list)
    predicted_peak_rounds: list[float] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return statistics.median(self.tps_rounds)

    @property
    def measured_s(self) -> float:
        return statistics.median(self.seconds_rounds)

    @property
    def measured_peak(self) -> float:
        return statistics.median(self.peak_rounds)

    @property
    def predicted_s(self) -> float:
        return statistics.median(self.predicted_s_rounds)

    @property
    def predicted_peak(self) -> float:
        return statistics.median(self.predicted_peak_rounds)

    @property
    def time_error(self) -> float:
        """The median over the rounds of each round's error (its tables against its run)."""
        pairs = zip(self.seconds_rounds, self.predicted_s_rounds, strict=True)
        return statistics.median(_error(measured, predicted) for measured, predicted in pairs)

    @property
    def memory_error(self) -> float:
        pairs = zip(self.peak_rounds, self.predicted_peak_rounds, strict=True)
        return statistics.median(_error(measured, predicted) for measured, predicted in pairs)

    def price(self, inputs: CostInputs, batch: int) -> None:
        """Predict this round's run from this round's cost tables."""
        r = self.result
        price = price_plan(inputs, r.strategies, r.partition, r.num_microbatches, batch)
        self.predicted_s_rounds.append(price.iteration_time_s)
        self.predicted_peak_rounds.append(max(price.stage_memory_bytes))


def uniform_layout(model, inputs, budget, batch, name, pp, order, degrees, ckpt) -> Layout:
    """The uniform layout's best micro-batch count under the budget, by the same estimator."""
    layout = Layout(name + ("+CKPT" if ckpt else ""))
    strategy = LayerStrategy(pp, order, degrees, ckpt)
    refusal = parallel_plan_refusal([strategy] * model.num_layers, [model.num_layers // pp] * pp)
    try:
        layout.result = search(
            model, inputs, WORLD, budget, global_batch_size=batch, pp_degrees=[pp],
            strategy_filter=lambda s: s == strategy, even_partition=True,
        )  # fmt: skip
    except PlanningError as e:
        layout.why_not = f"does not fit: {e}"
        return layout
    if refusal is not None:
        layout.why_not = f"refused: {refusal}"
    return layout


def least_dp_peak(inputs, batch: int, num_layers: int) -> float:
    """The least Eq. 2 peak of uniform DP4 without recomputation over micro-batch counts."""
    dp4 = LayerStrategy(1, ("dp",), (4,), False)
    peaks = [
        max(price_plan(inputs, [dp4] * num_layers, [num_layers], m, batch).stage_memory_bytes)
        for m in range(1, batch + 1)
        if batch % m == 0 and (batch // m) % 4 == 0
    ]
    return min(peaks)


def run_layout(layout: Layout, model: ModelSpec, args, out: Path) -> None:
    path = out / f"plan_{layout.name.replace('+', '_')}.json"
    write_plan(layout.result, path, model, seq_length=args.seq_length, num_gpus=WORLD)
    argv = [
        *model_flags(args), "--parallel-plan", str(path), "--data-path", "synthetic:webcode",
        "--seed", "1234", *NO_DROPOUT, "--lr", "1e-4",
        "--lr-decay-style", "constant", "--log-interval", "1", "--split", "1,0,0",
        "--eval-iters", "0", "--log-peak-memory",
        "--train-iters", str(args.warmup + args.iterations + 1),
    ]  # fmt: skip
    try:
        rows = run(layout.name, WORLD, argv, args.warmup, args.iterations + 1, args.run_timeout_s)
    except (SystemExit, RunTimedOut) as failure:  # printed as a row, not hidden
        lines = str(failure).splitlines()
        errors = [x for x in lines if "error:" in x] or [x for x in lines if "Error" in x]
        layout.why_not = f"run failed: {(errors or lines[:1])[0].strip()[:200]}"
        print(f"  {layout.name}: {layout.why_not}", flush=True)
        return
    timed, traced = rows[:-1], rows[-1]
    layout.tps_rounds.append(statistics.median(float(r["tps"].replace(",", "")) for r in timed))
    seconds = statistics.median(float(r["ms"].replace(",", "")) for r in timed) / 1e3
    layout.seconds_rounds.append(seconds)
    layout.peak_rounds.append(float(traced["peak_mib"].replace(",", "")) * MiB)


def _error(measured: float, predicted: float) -> float:
    return (predicted - measured) / measured


def report(layouts: list[Layout], searched: Layout) -> list[str]:
    lines = [
        f"{'layout':<22}{'tokens/s':>10}{'iter s':>9}{'range s':>14}{'pred s':>9}{'err':>8}"
        f"{'peak MiB':>10}{'pred MiB':>10}{'err':>8}  plan"
    ]
    for layout in [searched, *layouts]:
        if layout.why_not:
            lines.append(f"{layout.name:<22}{layout.why_not}")
            continue
        r = layout.result
        lines.append(
            f"{layout.name:<22}{layout.tps:>10,.0f}{layout.measured_s:>9.3f}"
            f"{min(layout.seconds_rounds):>8.3f}-{max(layout.seconds_rounds):<5.3f}"
            f"{layout.predicted_s:>9.3f}{layout.time_error:>+8.1%}"
            f"{layout.measured_peak / MiB:>10.1f}{layout.predicted_peak / MiB:>10.1f}"
            f"{layout.memory_error:>+8.1%}  "
            f"m={r.num_microbatches}, partition {r.partition}"
        )
    lines.append(
        "err = (predicted - measured) / measured in each round (its cost tables against its "
        "run), median over the rounds; iter s: median over the rounds of each round's median "
        "iteration (optimiser step included), range s: the rounds' lowest and highest; pred: "
        "median over the rounds; peak MiB: the largest rank's traced peak tensor memory"
    )
    return lines


def targets(layouts: list[Layout], searched: Layout) -> list[str]:
    ran = [x for x in [searched, *layouts] if not x.why_not]
    lines = []
    for x in ran:
        mem, time_err = abs(x.memory_error), abs(x.time_error)
        lines.append(
            f"{x.name}: memory error {mem:.1%} ({'ok' if mem <= 0.10 else 'MISS'}, target 10%); "
            f"time error {time_err:.1%} ({'ok' if time_err <= 0.15 else 'MISS'}, target 15%)"
        )
    uniform = [x for x in layouts if not x.why_not]
    plan = (searched.result.strategies, searched.result.partition, searched.result.num_microbatches)
    for x in uniform:
        if (x.result.strategies, x.result.partition, x.result.num_microbatches) == plan:
            lines.append(
                f"note: the searched plan is the uniform layout {x.name}; their tokens/s differ "
                "by run-to-run noise only"
            )
    if uniform:
        best = max(uniform, key=lambda x: x.tps)
        ratio = searched.tps / best.tps
        verdict = "ok" if ratio >= 1.0 else "MISS"
        lines.append(
            f"tokens/s searched / best uniform ({best.name}): {ratio:.3f} ({verdict}, target >= 1)"
        )
    else:
        lines.append("no uniform layout fits and runs: no ratio (MISS)")
    return lines


def _record(x: Layout) -> dict:
    return {
        "layout": x.name,
        "why_not": x.why_not,
        "tokens_per_s_rounds": x.tps_rounds,
        "measured_s_rounds": x.seconds_rounds,
        "measured_peak_bytes_rounds": x.peak_rounds,
        "predicted_s_rounds": x.predicted_s_rounds,
        "predicted_peak_bytes_rounds": x.predicted_peak_rounds,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"search vs run on {WORLD} CPU ranks; start {_load()} (the machine is shared)")
    data = read_cost_tables(profile(args, out / "round1"))
    model = ModelSpec.from_dict({**data[0]["model"], "name": "tiny-gpt"})
    inputs = profiled_cost_inputs(model, data, WORLD, seq_length=args.seq_length)
    batch = args.global_batch_size
    budget = args.budget_fraction * least_dp_peak(inputs, batch, model.num_layers)
    print(f"model {model.to_dict()}\nglobal batch {batch}; memory budget {budget / MiB:.1f} MiB "
          f"per rank ({args.budget_fraction} x uniform DP4's least predicted peak)")  # fmt: skip
    started = time.perf_counter()
    found = runnable_search(model, inputs, WORLD, budget, global_batch_size=batch)
    print(f"searched in {time.perf_counter() - started:.2f} s: "
          f"{', '.join(sorted({str(s) for s in found.strategies}))} per layer "
          f"{[str(s) for s in found.strategies]}")  # fmt: skip
    searched = Layout("searched", found)
    layouts = []
    for name, pp, order, degrees in UNIFORM:
        plain = uniform_layout(model, inputs, budget, batch, name, pp, order, degrees, False)
        ckpt = uniform_layout(model, inputs, budget, batch, name, pp, order, degrees, True)
        if args.quick and not plain.why_not and not ckpt.why_not:
            slower, faster = sorted([plain, ckpt], key=lambda x: -x.result.iteration_time_s)
            slower.why_not = f"skipped (--quick: {faster.name} is predicted faster)"
        layouts += [plain, ckpt]
    if args.smoke:  # the searched plan and the first uniform layout that runs
        for x in [x for x in layouts if not x.why_not][1:]:
            x.why_not = "skipped (--smoke)"
    runnable = [x for x in [searched, *layouts] if not x.why_not]
    profiled_round = 0
    for round_, layout in alternating(runnable, args.rounds):
        if round_ != profiled_round:  # the host's speed drifts: every round profiles anew
            data = read_cost_tables(profile(args, out / f"round{round_ + 1}"))
            inputs = profiled_cost_inputs(model, data, WORLD, seq_length=args.seq_length)
            profiled_round = round_
        if not layout.why_not:  # a failed run drops the layout from the later rounds
            print(f"  round {round_ + 1}:", end="", flush=True)
            run_layout(layout, model, args, out)
            if not layout.why_not:
                layout.price(inputs, batch)
    lines = [
        f"search vs run: {WORLD} CPU ranks (gloo, 1 thread each), {model.num_layers} layers, "
        f"hidden {model.hidden_size}, seq {args.seq_length}, global batch {batch}, budget "
        f"{budget / MiB:.1f} MiB; {args.warmup} warm-up + {args.iterations} timed iterations "
        f"(+1 traced for memory) per run, {args.rounds} alternated runs per layout; end "
        f"{_load()} (the machine was shared)",
        *report(layouts, searched),
        *targets(layouts, searched),
    ]
    print("\n".join(lines))
    records = [_record(x) for x in [searched, *layouts]]
    (out / "summary.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
