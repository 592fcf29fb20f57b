"""Where a heterogeneous iteration's time goes: propagation, optimisation and their
interaction (pull/push), Hydraulis (seed `hydraulis.txt` §5.2, Table 1) on this machine's CPUs.

Hydraulis disaggregates optimisation from propagation: fp32 master weights and optimiser states
stay sharded over all GPUs while each iteration's strategy pulls its working weights and pushes
its gradients. Table 1 of the paper splits an iteration into propagation, optimisation and that
interaction, for a static homogeneous strategy against dynamic heterogeneous ones. Here every
row is the real training program, `torchrun --nproc-per-node 4 pretrain_gpt.py` on gloo, with the
same model, data, seed and global batches, and `--device-speed` emulating slower devices on
some ranks (sleeps after each forward/backward; default ranks 2 and 3 twice as slow):

- Megatron, static homogeneous: DP2 x PP2 with Megatron DDP and Megatron's optimiser (the log
  line does not split its time; its total is the reference);
- static homogeneous, disaggregated: the same two TP1 x PP2 pipelines as a `--hetero-plan`, run
  over the disaggregated optimiser (what pull/push cost when nothing switches);
- static heterogeneous: `examples/hetero_plan_4ranks.json` (TP2|TP1 + TP1, 70/30 of the tokens);
- dynamic heterogeneous: `--dynamic-strategies`, a strategy per iteration;
- both heterogeneous rows again with `--overlap-pull-push` (Table 1's "w/ Overlap"): each stage
  waits for its weights at its first forward and sends its gradients after its last backward.

Each time is the slowest rank's (the log line's), median over the iterations after
`--warmup-iters`, pooled over `--rounds` runs in alternating order; "propagation" is the plan's
execution including the wait for the slowest
pipeline, "pull+push" the interaction: the time a rank spends in them that propagation did not
hide (with overlap, what remains exposed). CPU numbers show the structure, not GPU magnitudes:
gloo TP all-reduces and p2p on a shared 2-core box are slow. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Collection
from pathlib import Path

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.switch_overhead")

from benchmarks.torchrun_runs import ROOT, alternating, run

TWO_PIPELINES = {
    "replicas": [
        {
            "stages": [
                {"devices": [0], "tp": 1, "layers": [0, 2]},
                {"devices": [1], "tp": 1, "layers": [2, 4]},
            ],
            "batch_fraction": 0.5,
        },
        {
            "stages": [
                {"devices": [2], "tp": 1, "layers": [0, 2]},
                {"devices": [3], "tp": 1, "layers": [2, 4]},
            ],
            "batch_fraction": 0.5,
        },
    ]
}


def _common(args: argparse.Namespace) -> list[str]:
    return [
        "--num-layers", "4", "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
        "--tokens-per-global-batch", str(args.tokens_per_global_batch),
        "--data-path", args.data_path, "--dynamic-micro-batching",
        "--dynapipe-memory-limit-gib", str(args.memory_limit_gib),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--log-interval", "1",
        "--split", "1,0,0", "--eval-iters", "0",  # every document trains, as before #16
        "--lr-decay-style", "constant", "--device-speed", args.device_speed,
        "--train-iters", str(args.warmup_iters + args.measured_iters),
    ]  # fmt: skip


def summary(label: str, kept: list[dict[str, str]]) -> dict[str, object]:
    """Medians over every measured iteration of every round."""

    def median(key: str) -> float:
        return statistics.median(float(r[key].replace(",", "")) for r in kept)

    result: dict[str, object] = {"label": label, "ms": median("ms"), "tps": median("tps")}
    result["first_loss"] = float(kept[0]["first_loss"])
    if "prop" in kept[0]:
        result.update(prop=median("prop"), opt=median("opt"), pull=median("pull"))
        result["push"] = median("push")
        result["strategies"] = sorted({r["strategy"] for r in kept})
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--tokens-per-global-batch", type=int, default=2048)
    p.add_argument("--data-path", default="synthetic:flan")
    p.add_argument("--memory-limit-gib", type=float, default=0.01)
    p.add_argument("--device-speed", default="2:2,3:2", help="emulated slowdown per rank")
    p.add_argument("--warmup-iters", type=int, default=2)
    p.add_argument("--measured-iters", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="runs per configuration, pooled")
    p.add_argument("--smoke", action="store_true", help="a tiny GPT, one measured iteration")
    return p


def smoke(args: argparse.Namespace) -> argparse.Namespace:
    """CI's check that every configuration runs (`--smoke`), not a measurement: hidden 32,
    64 tokens a sample, 512 a batch, one iteration, one round."""
    if args.smoke:
        args.hidden_size, args.seq_length, args.tokens_per_global_batch = 32, 64, 512
        args.warmup_iters, args.measured_iters, args.rounds = 0, 1, 1
    return args


def workload(args: argparse.Namespace) -> str:
    return (
        f"4 CPU ranks (gloo), GPT 4 layers hidden {args.hidden_size}, {args.data_path} at "
        f"{args.seq_length} tokens, {args.tokens_per_global_batch} tokens per batch, "
        f"emulated speeds {args.device_speed}; medians of {args.measured_iters} iterations x "
        f"{args.rounds} round(s)"
    )


def measure(args: argparse.Namespace, only: Collection[str] = ()) -> list[dict[str, object]]:
    """Every configuration's medians (`summary`), in Table 1's order; `only`: those labels."""
    hetero = ["--hetero-plan", str(ROOT / "examples" / "hetero_plan_4ranks.json")]
    with tempfile.TemporaryDirectory() as tmp:
        two = Path(tmp) / "two_pipelines.json"
        two.write_text(json.dumps(TWO_PIPELINES))
        configs = [
            ("Megatron static homogeneous DP2xPP2", ["--pipeline-model-parallel-size=2"]),
            ("static homogeneous 2xTP1PP2, disaggregated", ["--hetero-plan", str(two)]),
            ("static heterogeneous (hetero-plan)", hetero),
            ("dynamic heterogeneous strategies", ["--dynamic-strategies"]),
            ("static heterogeneous, overlapped", [*hetero, "--overlap-pull-push"]),
            ("dynamic heterogeneous, overlapped", ["--dynamic-strategies", "--overlap-pull-push"]),
        ]
        configs = [(label, extra) for label, extra in configs if not only or label in only]
        kept: dict[str, list[dict[str, str]]] = {label: [] for label, _ in configs}
        for _, (label, extra) in alternating(configs, args.rounds):
            kept[label] += run(
                label, 4, [*_common(args), *extra], args.warmup_iters, args.measured_iters
            )
    return [summary(label, kept[label]) for label, _ in configs]


def main() -> None:
    args = smoke(parser().parse_args())
    print(workload(args))
    rows = measure(args)
    print(
        f"\n{'':<44}{'iter ms':>9}{'propag.':>9}{'optim.':>8}{'pull':>7}{'push':>7}"
        f"{'pull+push %':>12}{'tokens/s':>10}{'1st loss':>10}"
    )
    for r in rows:
        if "prop" in r:
            interaction = r["pull"] + r["push"]
            cols = (
                f"{r['prop']:>9,.0f}{r['opt']:>8,.0f}{r['pull']:>7,.0f}{r['push']:>7,.0f}"
                f"{100 * interaction / r['ms']:>11.1f}%"
            )
        else:
            cols = f"{'-':>9}{'-':>8}{'-':>7}{'-':>7}{'-':>12}"
        print(f"{r['label']:<44}{r['ms']:>9,.0f}{cols}{r['tps']:>10,.0f}{r['first_loss']:>10.4f}")
    for r in rows:
        if "strategies" in r:
            print(f"  {r['label']}: {'; '.join(r['strategies'])}")


if __name__ == "__main__":
    main()
