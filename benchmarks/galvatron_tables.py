"""Table II of Galvatron-BMW (seed `galvatron_bmw.txt` §VII-B) with our analytic cost model.

8 GPUs, 8/12/16/20 GB budgets, BERT / ViT / T5-class models and a GPT model: the maximum
throughput (samples/s) and its global batch size of each strategy family, searched by our
Galvatron-BMW engine restricted to that family's strategies:

  DP, TP, SDP           one paradigm over all 8 GPUs, no PP, no CKPT (DDP, Megatron, FSDP)
  PP                    one GPU per stage, no CKPT (the paper's GPipe row; we price 1F1B)
  3D (TP2 PP2 DP2)      a fixed expert 3D plan (the paper's DeepSpeed 3D row), no CKPT
  DP+TP, DP+PP          Galvatron restricted to two paradigms, no CKPT
  Galvatron             all of DP/SDP/TP/PP, no CKPT, memory-balanced partition
  Galvatron (1F1B+Bi-obj)  the same space with the bi-objective partition and batch search
  Galvatron-Base        the full space with CKPT, memory-balanced partition only
  Galvatron-BMW         the full space with the bi-objective partition and batch search

It then checks the paper's ordering: BMW >= Base >= each limited space >= the pure strategies
it contains, and prints every place where it does not hold. A benchmark prints what it
measured; it is not a test. Run: `python -m benchmarks.galvatron_tables [--models ...]`
(`--num-gpus 16 --gpus-per-node 8` for two nodes, where PP and the bi-objective step pay).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from dynapipe_planner.cluster import GiB, get_gpu
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.search import LayerStrategy, analytic_cost_inputs, search

NUM_GPUS = 8
BUDGETS_GB = (8, 12, 16, 20)
# Table name -> (model preset, sequence length, decoder length). Sequence lengths of the paper's
# workloads: BERT 512, ViT-Huge/16 at 224x224 (196 patches + CLS), T5 512/512, T5-512/4 (its
# SQuAD variant, §VII-A) 512 encoder / 4 decoder tokens; GPT at 1024.
MODELS = {
    "bert-huge-32": ("bert-huge-32", 512, None),
    "bert-huge-48": ("bert-huge-48", 512, None),
    "vit-huge-32": ("vit-huge-32", 197, None),
    "vit-huge-48": ("vit-huge-48", 197, None),
    "t5-large-32": ("t5-large-32", 512, 512),
    "t5-large-48": ("t5-large-48", 512, 512),
    "t5-512/4-32": ("t5-large-32", 512, 4),
    "t5-512/4-48": ("t5-large-48", 512, 4),
    "bert-xhuge": ("bert-xhuge", 512, None),
    "vit-xhuge": ("vit-xhuge", 197, None),
    "gpt-1.3b": ("gpt-1.3b", 1024, None),
}
DEFAULT_MODELS = ("bert-huge-32", "vit-huge-32", "t5-large-32", "gpt-1.3b")


# Every row searches the same global batch sizes, so a row whose strategies include another's
# can only lose to it through the layer DP's heuristic steps (discretised memory, Algorithm 3's
# largest-feasible forward budget), never through a different batch-size path.
def _grid(num_gpus: int, max_batch: int | None = None) -> list[int]:
    grid = [num_gpus * k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)]
    return [b for b in grid if max_batch is None or b <= max_batch]


def _pp(degrees: list[int] | None, num_gpus: int) -> list[int] | None:
    """The rows' PP degrees are written for 8 GPUs: PP8 means one GPU per stage."""
    if degrees == [NUM_GPUS]:
        return [num_gpus]
    return degrees


def _only(*paradigms: str, ckpt: bool = False) -> Callable[[LayerStrategy], bool]:
    return lambda s: set(s.order) <= set(paradigms) and (ckpt or not s.ckpt)


# name -> (PP degrees, strategy filter, bi-objective), in the paper's row order
ROWS: dict[str, tuple] = {
    "DP": ([1], lambda s: s.order == ("dp",) and not s.ckpt, False),
    "TP": ([1], lambda s: s.order == ("tp",) and not s.ckpt, False),
    "PP": ([NUM_GPUS], lambda s: not s.ckpt, False),
    "SDP": ([1], lambda s: s.order == ("sdp",) and not s.ckpt, False),
    "3D (TP2 PP2 DP2)": ([2], lambda s: s.order == ("dp", "tp") and not s.ckpt, False),
    "DP+TP": ([1], _only("dp", "tp"), False),
    "DP+PP": (None, _only("dp"), False),
    "Galvatron": (None, lambda s: not s.ckpt, False),
    "Galvatron (1F1B+Bi-obj)": (None, lambda s: not s.ckpt, True),
    "Galvatron-Base": (None, None, False),
    "Galvatron-BMW": (None, None, True),
}
# row -> rows whose strategy space it contains (so it should be at least as fast)
CONTAINS = {
    "DP+TP": ("DP", "TP"),
    "DP+PP": ("DP", "PP"),
    "Galvatron": ("DP", "TP", "PP", "SDP", "3D (TP2 PP2 DP2)", "DP+TP", "DP+PP"),
    "Galvatron (1F1B+Bi-obj)": ("Galvatron",),
    "Galvatron-Base": ("Galvatron",),
    "Galvatron-BMW": ("Galvatron-Base", "Galvatron (1F1B+Bi-obj)"),
}

# (model, budget in GB, row) -> (samples/s, global batch), or None where nothing fits
Results = dict[tuple[str, int, str], tuple[float, int] | None]


def table_results(
    models: Sequence[str],
    gpu_name: str,
    num_gpus: int,
    gpus_per_node: int,
    counts: int,
    budgets_gb: Sequence[int] = BUDGETS_GB,
    rows: Sequence[str] = tuple(ROWS),
    max_batch: int | None = None,
) -> Results:
    """Every (model, budget, row) cell of a Table II-IV style table: the best throughput and
    its global batch of that row's strategy space, searched over the batch grid (up to
    `max_batch` samples), or None when nothing fits."""
    gpu = get_gpu(gpu_name)
    results: Results = {}
    for name in models:
        preset, seq, tgt = MODELS[name]
        model = MODEL_PRESETS[preset]
        inputs = analytic_cost_inputs(
            model, gpu, num_gpus, gpus_per_node=gpus_per_node, seq_length=seq, tgt_seq_length=tgt
        )
        for budget in budgets_gb:
            for row in rows:
                pp, keep, bi = ROWS[row]
                try:
                    r = search(
                        model, inputs, num_gpus, budget * GiB, pp_degrees=_pp(pp, num_gpus),
                        strategy_filter=keep, bi_objective=bi,
                        batch_sizes=_grid(num_gpus, max_batch), microbatch_counts=counts,
                    )  # fmt: skip
                    results[(name, budget, row)] = (r.throughput, r.global_batch_size)
                except PlanningError:
                    results[(name, budget, row)] = None
    return results


def ordering_violations(results: Results) -> list[str]:
    """Cells where a row is slower than a row whose strategy space it contains (CONTAINS)."""
    broken = []
    cells = sorted({(name, budget) for name, budget, _ in results}, key=str)
    for name, budget in cells:
        for big, smalls in CONTAINS.items():
            if (name, budget, big) not in results:
                continue
            top = results[(name, budget, big)]
            for small in smalls:
                low = results.get((name, budget, small))
                if low is None:
                    continue
                if top is None or top[0] < low[0] * (1 - 1e-9):
                    have = "OOM" if top is None else f"{top[0]:.2f}"
                    broken.append(f"{name} {budget}G: {big} {have} < {small} {low[0]:.2f}")
    return broken


def run(models: list[str], gpu_name: str, num_gpus: int, gpus_per_node: int, counts: int) -> None:
    started = time.perf_counter()
    results = table_results(models, gpu_name, num_gpus, gpus_per_node, counts)
    spent = time.perf_counter() - started
    width = 18
    print(
        f"Table II structure: {num_gpus} x {get_gpu(gpu_name).name}, {gpus_per_node} per node "
        "(analytic cost model), max throughput in samples/s (global batch)\n"
    )
    print(f"{'memory':<8}{'strategy':<25}" + "".join(f"{m:>{width}}" for m in models))
    for budget in BUDGETS_GB:
        for i, row in enumerate(ROWS):
            cells = []
            for name in models:
                got = results[(name, budget, row)]
                cells.append("OOM" if got is None else f"{got[0]:.2f} ({got[1]})")
            label = f"{budget}G" if i == 0 else ""
            print(f"{label:<8}{row:<25}" + "".join(f"{c:>{width}}" for c in cells))
    print(f"\n{len(results)} searches in {spent:.1f} s")
    broken = ordering_violations(results)
    if broken:
        print("ordering BMW >= Base >= limited spaces >= pure strategies does NOT hold at:")
        print("\n".join(f"  {b}" for b in broken))
    else:
        print("ordering BMW >= Base >= limited spaces >= pure strategies holds everywhere")
    print()
    print(DIFFERENCES)


DIFFERENCES = """\
Where these numbers differ from the paper's Table II, and why:
- The paper measured real runs on 8 RTX TITAN GPUs over PCIe 3.0; these are the §V estimator's
  predictions with the analytic A100 model (312 TFLOPS bf16, 300 GB/s NVLink), so absolute
  throughputs are several times higher and communication is much cheaper.
- §V prices compute linearly in the batch (per-sample time x samples), so a bigger batch only
  pays through amortised per-iteration costs (gradient sync, pipeline bubbles). With cheap
  NVLink those are small: SDP or DP over all 8 GPUs hides its traffic under compute, and
  CKPT's larger batches rarely beat its 33% recomputation. The paper's large CKPT gains
  (Galvatron -> Galvatron-Base) come from measured GPU efficiency growing with the batch and
  from PCIe-bound communication; on two A100 nodes (--num-gpus 16) PP and the bi-objective
  partition do pay (BMW over Base by up to 14%).
- Our search also tries m = P, 2P, 4P, 8P micro-batches (gradient accumulation without PP),
  which lets every row reach large batches without CKPT; --microbatch-counts 1 removes that.
- Model states take 18 bytes per parameter (bf16 weights, fp32 gradients and Adam), PP is
  priced as 1F1B (the paper's PP row is GPipe), and the 3D row is searched with a memory-
  balanced partition rather than DeepSpeed's even split.
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(MODELS))
    p.add_argument("--gpu", default="A100-40GB")
    p.add_argument("--num-gpus", type=int, default=NUM_GPUS)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--microbatch-counts",
        type=int,
        default=4,
        help="micro-batch counts tried per PP degree P (P, 2P, 4P, ...); 1: m = P, i.e. no "
        "gradient accumulation without PP, closer to the paper's baselines",
    )
    p.add_argument("--smoke", action="store_true", help="CI's check: ViT-Huge-32 alone, m = P")
    args = p.parse_args()
    if args.smoke:
        args.models, args.microbatch_counts = ["vit-huge-32"], 1
    run(args.models, args.gpu, args.num_gpus, args.gpus_per_node, args.microbatch_counts)


if __name__ == "__main__":
    main()
