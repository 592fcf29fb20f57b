"""HexiScale's asymmetric plan against the best symmetric (Megatron-style) layout, trained for
real on CPU ranks of emulated mixed speeds (seed `hexiscale.txt` §5.2: throughput of the
heterogeneous plan over symmetric layouts on the same mixed GPUs).

The emulated cluster: rank i's forward and backward passes take `--slowdowns[i]` times their
measured time (`pretrain_gpt.py --device-speed`, which sleeps after each pass). Every rank is
slowed, the fast ones too (default 4, 4, 8, 8: two ranks half as fast as the other two), so the
sleeps dominate an iteration and ranks contend less for the shared cores; communication and
the optimiser are not slowed.

1. The ranks as a HexiScale cluster: one machine per device, all of one catalogue GPU type with
   `peak_tflops` = (this core's measured fp32 matmul throughput) / slowdown, so their ratio is the
   emulated one; between devices a uniform link (`--link-gbs`, `--link-latency-us`, a rough
   figure for gloo on loopback). The YAML is written beside the plans and printed.
2. The planner (`hetero.search.hexiscale_search`, what `dynapipe-hetero` runs) plans the model
   at `--seq-length` tokens a sample, as many samples as `--tokens-per-global-batch` holds;
   `hetero.rank_binding.bind_ranks` renumbers its devices as ranks (each pipeline's stages on
   increasing ranks, as `--hetero-plan` requires) and the slowdowns follow their devices.
3. Symmetric layouts: every TP x PP x DP of the ranks that the model allows (`hetero.baselines.
   symmetric_layouts`, PP dividing the layers as Megatron needs), each run with plain Megatron
   flags (DDP, Megatron's optimiser), plus the symmetric layout of the HexiScale plan's shape run
   as a `--hetero-plan` (same disaggregated runtime as HexiScale, equal batch shares). Every
   layer of a symmetric layout does the same work on every rank, so which ranks are slow does
   not change its time: the slowest rank sets it.
4. Measurement: `torchrun ... pretrain_gpt.py` (gloo, `OMP_NUM_THREADS=1` per rank; launch and
   parsing shared with `switch_overhead.py` in `torchrun_runs.py`), same model, seed, data and
   global batches, dropout off; each run drops `--warmup-iters` iterations and keeps the log
   line's real tokens/s (real tokens over the whole iteration: forward, backward, gradient
   sync or pull/push, optimiser) of the next `--measured-iters`. Screening runs every
   symmetric layout once and takes the best by median tokens/s as the baseline (a run past
   `--run-timeout-s` is killed and reported). Then `--rounds` rounds run HexiScale and that
   baseline back to back, in alternating order (load drifts on a shared machine); the ratio
   is HexiScale's median over the baseline's, per round and pooled, printed beside the
   planner's own prediction and each side's split of the iteration.

Data: SYNTHETIC web/code-like lengths truncated at `--seq-length` (91% of the samples full
length at 128), close to HexiScale's fixed-length setting. With variable lengths the ratio also
measures how each side pads: `--hetero-plan` deals every batch to the pipelines by token share
(longest first, so each pipeline pads to about the longest length), while DynaPipe's planner for
the symmetric DP layout sorts the batch and leaves one replica the short tail
(`--data-path synthetic:flan` shows it).

Not a test: CPU numbers on a shared machine are noisy, and the script says how noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.hetero_cpu")

from benchmarks.torchrun_runs import RunTimedOut, add_model_args, alternating, model_flags, run
from dynapipe_planner.devices import load_cluster
from dynapipe_planner.hetero.baselines import symmetric_layouts, symmetric_plan
from dynapipe_planner.hetero.cost import HeteroCostModel, TrainingJob
from dynapipe_planner.hetero.plan_file import plan_table, save_plan
from dynapipe_planner.hetero.rank_binding import RankBinding, bind_ranks
from dynapipe_planner.hetero.search import SearchConfig, hexiscale_search
from dynapipe_planner.model_spec import ModelSpec

HEXISCALE = "HexiScale plan (--hetero-plan)"


def core_tflops() -> float:
    """fp32 matmul throughput of one core of this machine, TFLOPS (best of a few tries)."""
    import torch

    torch.set_num_threads(1)
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - started) / 20)
    return 2 * n**3 / best / 1e12


def cluster_description(slowdowns: list[float], tflops: float, args: argparse.Namespace) -> dict:
    """The emulated ranks as a `dynapipe_planner.devices` cluster: device i = rank i."""
    return {
        "name": f"cpu-emulated-{len(slowdowns)}",
        "network": {"bandwidth_gbs": args.link_gbs, "latency_us": args.link_latency_us},
        "machines": [
            {"name": f"rank{i}-x{s:g}", "gpu": "A100-80GB", "count": 1, "peak_tflops": tflops / s}
            for i, s in enumerate(slowdowns)
        ],
    }


def job_flags(args: argparse.Namespace) -> list[str]:
    """Every run's flags: the model, data, batch and schedule."""
    return [
        *model_flags(args),
        "--tokens-per-global-batch", str(args.tokens_per_global_batch),
        "--data-path", args.data_path, "--seed", "1234", "--dynamic-micro-batching",
        "--dynapipe-memory-limit-gib", str(args.memory_limit_gib),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--log-interval", "1",
        "--split", "1,0,0", "--eval-iters", "0",  # every document trains, as before #16
        "--lr-decay-style", "constant",
        "--train-iters", str(args.warmup_iters + args.measured_iters),
    ]  # fmt: skip


def speed_flag(slowdowns: list[float]) -> list[str]:
    return ["--device-speed", ",".join(f"{s:g}" for s in slowdowns)]


def median(rows: list[dict[str, str]], key: str = "tps") -> float:
    return statistics.median(float(r[key].replace(",", "")) for r in rows)


def plan(cost: HeteroCostModel, args: argparse.Namespace) -> tuple[RankBinding, float]:
    """HexiScale's plan bound to ranks, and its estimated iteration time."""
    result = hexiscale_search(cost, SearchConfig(max_plans=args.planner_max_plans))
    print(plan_table(result.plan))
    binding = bind_ranks(result.plan)
    ranks = ", ".join(f"rank {r} = device {d}" for r, d in enumerate(binding.device_of_rank))
    print(f"bound to ranks: {ranks}")
    return binding, result.estimate.iteration_s


def layouts(cost: HeteroCostModel, binding: RankBinding, out: Path, args: argparse.Namespace):
    """(label, flags, the planner's estimate in s) of HexiScale and every symmetric layout."""
    slowdowns = args.slowdowns
    hexi_path = out / "hexiscale_plan.json"
    save_plan(binding.plan, hexi_path)
    rows = [
        (HEXISCALE, ["--hetero-plan", str(hexi_path), *speed_flag(binding.per_rank(slowdowns))])
    ]
    estimates = {}
    for tp, pp, dp in symmetric_layouts(cost):
        if args.num_layers % pp:
            continue
        label = f"symmetric TP{tp} PP{pp} DP{dp} (Megatron flags)"
        sym = symmetric_plan(cost, tp, pp, dp)
        estimates[label] = cost.estimate(sym).iteration_s
        flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        rows.append((label, [*flags, *speed_flag(slowdowns)]))
    # The HexiScale plan's shape with equal shares, on the same runtime.
    shape = binding.plan.pipelines
    tp, pp = shape[0].stages[0].tp, len(shape[0].stages)
    same_shape = all(len(p.stages) == pp and p.stages[0].tp == tp for p in shape)
    sym = symmetric_plan(cost, tp, pp, len(shape)) if same_shape else None
    if sym is not None and len(shape) * tp * pp == len(slowdowns):
        label = f"symmetric TP{tp} PP{pp} DP{len(shape)} (--hetero-plan)"
        path = out / "symmetric_plan.json"
        save_plan(sym, path)
        estimates[label] = cost.estimate(sym).iteration_s
        rows.append((label, ["--hetero-plan", str(path), *speed_flag(slowdowns)]))
    return rows, estimates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--slowdowns",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[4.0, 4.0, 8.0, 8.0],
        help="emulated slowdown of every rank (comma list; its length is the rank count)",
    )
    add_model_args(p, hidden_size=64, seq_length=128)
    p.add_argument("--tokens-per-global-batch", type=int, default=4096)
    p.add_argument("--data-path", default="synthetic:webcode")
    p.add_argument("--memory-limit-gib", type=float, default=1.0)
    p.add_argument("--link-gbs", type=float, default=1.0, help="planner's view of gloo links")
    p.add_argument("--link-latency-us", type=float, default=100.0)
    p.add_argument("--planner-max-plans", type=int, default=200)
    p.add_argument("--warmup-iters", type=int, default=1)
    p.add_argument("--measured-iters", type=int, default=3)
    p.add_argument("--run-timeout-s", type=float, default=90.0, help="a run past it is dropped")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds after the screening")
    p.add_argument("--output-dir", help="keep the cluster YAML and plans here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: 2 ranks, a tiny GPT, one iteration a run, one symmetric layout of each "
        "kind screened, one round",
    )
    args = p.parse_args()
    if args.smoke:  # CI's check that the benchmark runs, not a measurement
        args.slowdowns, args.num_layers, args.hidden_size = [1.0, 2.0], 2, 32
        args.seq_length, args.tokens_per_global_batch, args.planner_max_plans = 64, 512, 20
        args.warmup_iters, args.measured_iters, args.rounds = 0, 1, 1
    started = time.perf_counter()
    world = len(args.slowdowns)
    tflops = core_tflops()
    print(
        f"{world} CPU ranks (gloo), emulated slowdowns {args.slowdowns}; GPT {args.num_layers} "
        f"layers, hidden {args.hidden_size}, {args.data_path} at {args.seq_length} tokens, "
        f"{args.tokens_per_global_batch} tokens per batch; one core measures {tflops * 1e3:.1f} "
        f"GFLOPS (fp32 matmul)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.output_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        cluster_path = out / "cluster.yaml"
        cluster_path.write_text(yaml.safe_dump(cluster_description(args.slowdowns, tflops, args)))
        print(f"\ncluster ({cluster_path}):\n{cluster_path.read_text()}")
        from megatron.dynapipe.data.base import BYTE_VOCAB_SIZE

        spec = ModelSpec(
            "cpu-gpt", "gpt", args.num_layers, args.hidden_size, args.num_attention_heads,
            4 * args.hidden_size, BYTE_VOCAB_SIZE, max_position_embeddings=args.seq_length,
        )  # fmt: skip
        job = TrainingJob(
            spec,
            seqlen=args.seq_length,
            global_batch=args.tokens_per_global_batch // args.seq_length,
            recompute="none",
        )
        cost = HeteroCostModel(load_cluster(cluster_path), job)
        binding, hexi_estimate = plan(cost, args)
        configs, estimates = layouts(cost, binding, out, args)
        estimates[HEXISCALE] = hexi_estimate
        symmetric = [(label, flags) for label, flags in configs if label != HEXISCALE]
        if args.smoke:  # one layout run with Megatron's flags, one as a --hetero-plan
            kinds = {"--hetero-plan" in flags: (label, flags) for label, flags in symmetric[::-1]}
            symmetric = list(kinds.values())
        timed_out: list[str] = []

        def measure(label: str, flags: list[str]) -> list[dict[str, str]] | None:
            argv = [*job_flags(args), *flags]
            try:
                return run(label, world, argv, args.warmup_iters, args.measured_iters,
                           args.run_timeout_s)  # fmt: skip
            except RunTimedOut:
                timed_out.append(label)
                return None

        print(f"\nscreening: every symmetric layout once ({len(symmetric)} runs)", flush=True)
        screened = {label: measure(label, flags) for label, flags in symmetric}
        finished = [label for label, rows in screened.items() if rows]
        if not finished:
            raise SystemExit("every symmetric layout timed out; nothing to compare with")
        best = max(finished, key=lambda label: median(screened[label]))
        finalists = [(HEXISCALE, configs[0][1]), (best, dict(symmetric)[best])]
        print(f"\n{args.rounds} rounds: {HEXISCALE} against {best}", flush=True)
        paired: dict[str, list[list[dict[str, str]] | None]] = {HEXISCALE: [], best: []}
        for _, (label, flags) in alternating(finalists, args.rounds):
            paired[label].append(measure(label, flags))
    report(screened, paired, estimates, best, timed_out, args.run_timeout_s)
    print(f"\ntotal time {time.perf_counter() - started:,.0f} s")


def report(screened, paired, estimates, best: str, timed_out: list[str], timeout: float) -> None:
    """Screening table, then the paired rounds: per-round and pooled ratios."""
    print(f"\n{'layout':<46}{'tokens/s':>10}{'1st loss':>10}{'planner s/it':>14}")
    for label, rows in [(HEXISCALE, None), *screened.items()]:
        estimate = f"{estimates.get(label, float('nan')):>14.4f}"
        if label == HEXISCALE:
            print(f"{label:<46}{'(rounds)':>10}{'':>10}{estimate}")
        elif rows is None:
            print(f"{label:<46}{f'killed after {timeout:.0f} s':>20}{estimate}")
        else:
            loss = float(rows[0]["first_loss"])
            print(f"{label:<46}{median(rows):>10,.0f}{loss:>10.4f}{estimate}")
    if timed_out:
        print(f"timed out (killed, not measured): {'; '.join(timed_out)}")
    rounds = [(h, b) for h, b in zip(paired[HEXISCALE], paired[best], strict=True) if h and b]
    if not rounds:
        raise SystemExit("no round in which both HexiScale and the baseline finished")
    print(f"\n{'round':<8}{'HexiScale tokens/s':>20}{'baseline tokens/s':>20}{'ratio':>8}")
    ratios = []
    for i, (h, b) in enumerate(rounds, 1):
        ratios.append(median(h) / median(b))
        print(f"{i:<8}{median(h):>20,.0f}{median(b):>20,.0f}{ratios[-1]:>8.2f}")
    hexi = [row for h, _ in rounds for row in h]
    base = [row for _, b in rounds for row in b]
    print(
        f"\nHexiScale / best symmetric ({best}): {median(hexi) / median(base):.2f}x (medians "
        f"pooled over {len(rounds)} rounds); per round median {statistics.median(ratios):.2f}, "
        f"min {min(ratios):.2f}, max {max(ratios):.2f}"
    )
    print(
        f"planner's prediction: {estimates[best] / estimates[HEXISCALE]:.2f}x "
        "(its cost model of the emulated cluster)"
    )
    for label, rows in ((HEXISCALE, hexi), (best, base)):
        if "prop" in rows[0]:
            print(
                f"{label} iteration (medians, slowest rank): {median(rows, 'ms'):,.0f} ms = pull "
                f"{median(rows, 'pull'):,.0f} + propagation {median(rows, 'prop'):,.0f} + push "
                f"{median(rows, 'push'):,.0f} + optimizer {median(rows, 'opt'):,.0f} ms"
            )


if __name__ == "__main__":
    main()
