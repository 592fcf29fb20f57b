"""Search speed and plan quality: our Galvatron-BMW search vs the public hetu-galvatron 2.4.0
engine searching its full space (issues #5, #21).

Settings. By default LLaMA-7B (32 layers) on 8, 16 and 64 A100-80GB GPUs (8 per node),
sequence length 2048, a fixed global batch of 8 samples per GPU, with 24 GB and with 40 GB
per GPU (`--layers`, `--gpus`, `--memory-gb` choose others; GPT/LLaMA-class models of 24-96
layers are available). The cost inputs are built once with our analytic model and reduced to
what Galvatron's profile files can express (`galvatron_reference.profiles.galvatron_representable`:
forward time scales as 1/TP, no backward workspace, 16 bytes of model state per parameter, no
link latency, no embedding/output layers, one bandwidth per strided group size). Both engines
read exactly those numbers: ours as `CostInputs`, Galvatron from the JSON files written from
them. Galvatron runs in a throwaway virtual environment built by `galvatron_reference.env`.

Budgets. Galvatron 2.4.0 reserves 20% of budgets above 20 GB for the allocator cache and 1 GiB
per GPU for the CUDA context; ours is given what is left (24 GB: 18.2 GiB, 40 GB: 31.0 GiB).

Search spaces, for the same global batch B = 8N:
* Galvatron: its own defaults (`runner.py`), i.e. its full space: power-of-two DP / SDP / TP
  trees with CKPT per layer (TP <= 8, TP consecutive or not, never DP with SDP), PP in
  {1, 2, 4, 8} with its own layer split, every chunk count dividing B, and vocabulary TP on
  (`disable_vtp=0`): every layer TP range [lo, hi] of 1, 2, 4, 8 is searched, each layer's TP
  in it and the vocabulary TP degree one of lo..hi, the embedding with and without SDP.
* Ours (`search()`): the same per-layer strategies, PP degrees and micro-batch counts (every
  m dividing B, 1 to B), with a memory- then time-balanced partition search (Algorithm 2)
  instead of Galvatron's split; its even-partition run (`even_partition=True`, column "ours
  even") stays inside Galvatron's partition space. The representable inputs have no
  embedding or output layer, so vocabulary TP has nothing to split in our model (it only adds
  Galvatron's TP all-reduce of the embedding output to its own prices).
Known differences, printed with the table: the engines' time formulas differ (ours: the paper's
Eq. 9 with overlap slowdown, SDP gathers and last-micro-batch gradient sync; Galvatron 2.4.0:
its own pipeline formula, DP/SDP overlap and p2p rules); ours also counts the backward peak
(Eq. 2) and Galvatron keeps 1/8 of ZeRO-3 states unsharded when accumulating gradients. So
each engine's plan is also priced by the other's cost model (ours: the public `price_plan`;
Galvatron's: its `pipeline_costmodel` and `MemoryCostModel` at the best TP range and
vocabulary TP degree that fits). Galvatron's search does not maximise its own model: per cell
(chunk count, layer TP range) its per-stage layer DP minimises each layer's time for one
micro-batch with communication included (a DP group's gradient sync charged every
micro-batch), and only that DP's pick is priced by `pipeline_costmodel`. So its model can
price a plan of its space above its pick. The target: our plan / Galvatron's plan >= 1.00
under our estimator in every setting (column "ours/galv").

Times: ours is the median of `--repeats` calls of `search()` in this process (after one
warm-up search); Galvatron's is one run of `initialize_search_engine()` +
`parallelism_optimization()` inside its environment, excluding the interpreter start and
imports (paid once: all Galvatron searches run in one process). Both are printed as wall
time and as CPU time (process time, less disturbed by other jobs on a shared machine); the
load average is printed before and after the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.search_speed")

from benchmarks.galvatron_reference import env as galvatron_env
from benchmarks.galvatron_reference import profiles
from dynapipe_planner.cluster import get_gpu
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec, llama_spec
from dynapipe_planner.search import (
    CostInputs,
    LayerStrategy,
    SearchResult,
    analytic_cost_inputs,
    price_plan,
    search,
)

MiB = 2**20
TARGET_SPEEDUP = 20.0
GPUS_PER_NODE = 8
SEQ_LENGTH = 2048
MAX_TP = 8
MAX_PP = 8


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, "gpt", layers, hidden, heads, 4 * hidden, 51200)


MODELS: dict[int, ModelSpec] = {
    24: MODEL_PRESETS["gpt-1.3b"],
    32: MODEL_PRESETS["llama-7b"],
    48: _gpt("gpt-48l-3.8b", 48, 2560, 32),
    64: llama_spec("llama-64l-7b", 64, 3072, 24, 8192),
    96: _gpt("gpt-96l-4.8b", 96, 2048, 16),
}


def galvatron_budget_bytes(memory_gb: int) -> float:
    """What Galvatron 2.4.0 leaves for layers out of `memory_gb`: it reserves 20% above 20 GB
    (allocator cache) and 1024 MiB per GPU (CUDA context)."""
    mib = memory_gb * 1024
    if memory_gb > 20:
        mib -= int(mib * 0.2)
    return float((mib - 1024) * MiB)


def galvatron_memory_gb(text: str) -> int:
    """`--memory-gb`: whole GB per GPU that leave Galvatron's reserves something (> 1 GB)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of GB") from None
    if value <= 1:
        raise argparse.ArgumentTypeError(
            f"{value} GB leaves nothing after Galvatron's 1 GiB CUDA-context reserve (need > 1)"
        )
    return value


def strategy_from_galvatron(pp: int, group: int, tp: int, fsdp: int, consec: int, ckpt: int):
    """A Galvatron layer strategy as our `LayerStrategy` (order root -> leaf; the leaf is the
    consecutive level, so TP-consecutive means TP last)."""
    data = group // tp
    data_name = "sdp" if fsdp else "dp"
    if tp == 1:
        order, degrees = ((data_name,), (data,)) if data > 1 else ((), ())
    elif data == 1:
        order, degrees = ("tp",), (tp,)
    elif consec:
        order, degrees = (data_name, "tp"), (data, tp)
    else:
        order, degrees = ("tp", data_name), (tp, data)
    return LayerStrategy(pp, order, degrees, bool(ckpt))


def galvatron_plan(plan: dict, num_gpus: int) -> tuple[int, list[int], list[LayerStrategy], int]:
    """(PP, partition, per-layer strategies, micro-batch count) of Galvatron's config file."""

    def ints(key: str) -> list[int]:
        return [int(x) for x in str(plan[key]).split(",")]

    pp = int(plan["pp_deg"])
    group = num_gpus // pp
    strategies = [
        strategy_from_galvatron(pp, group, tp, f, c, k)
        for tp, f, c, k in zip(
            ints("tp_sizes_enc"),
            ints("dp_types_enc"),
            ints("tp_consecutive_flags"),
            ints("checkpoint"),
            strict=True,
        )
    ]
    return pp, ints("pp_division"), strategies, int(plan["chunks"])


def galvatron_layers(result: SearchResult) -> dict:
    """Our plan in the form `runner.py` prices with Galvatron's cost model (the benchmark's
    strategies are all Galvatron-expressible: power-of-two degrees, never DP with SDP)."""
    layers = [
        [s.tp, int(s.sdp > 1), int(bool(s.order) and s.order[-1] == "tp"), int(s.ckpt)]
        for s in result.strategies
    ]
    return {
        "pp": result.pp,
        "partition": list(result.partition),
        "chunks": result.num_microbatches,
        "layers": layers,
    }


def describe(pp: int, partition: list[int], strategies: list[LayerStrategy], m: int) -> str:
    runs, prev, count = [], None, 0
    for s in strategies:
        name = str(s).removeprefix(f"PP{pp}").removeprefix("+") or "PP-only"
        if name == prev:
            count += 1
        else:
            if prev is not None:
                runs.append(f"{count}x{prev}")
            prev, count = name, 1
    runs.append(f"{count}x{prev}")
    return f"PP{pp} {partition} m={m}: " + ", ".join(runs)


@dataclasses.dataclass
class Row:
    layers: int
    gpus: int
    memory_gb: int
    model: str
    ours_s: float
    galv_s: float
    ours_cpu_s: float
    galv_cpu_s: float
    same_plan: bool
    same_strategies: bool
    ours_tput: float
    galv_tput: float
    ours_on_galv: float
    galv_fits_ours: bool
    galv_on_ours: float
    ours_fits_galv: bool
    galv_self_check: float
    ours_plan: str
    galv_plan: str
    even_tput: float  # our search restricted to even partitions (Galvatron's space)
    even_on_galv: float  # that plan priced by Galvatron
    even_fits_galv: bool
    ours_even: bool  # our full search's partition is even (Galvatron can express it)
    narrow_tput: float  # our search over m = P, 2P, 4P, 8P only (before #21)
    narrow_cpu_s: float


@dataclasses.dataclass
class Setting:
    """One model x GPU count: our result and the Galvatron job built from the same inputs."""

    layers: int
    gpus: int
    memory_gb: int
    model: ModelSpec
    inputs: CostInputs
    batch: int
    budget: float
    ours: SearchResult
    ours_s: float
    ours_cpu_s: float
    even: SearchResult
    narrow: SearchResult
    narrow_cpu_s: float
    job: dict


def run_ours(
    layers: int, gpus: int, memory_gb: int, batch_per_gpu: int, work: str, repeats: int
) -> Setting:
    """Build the cost inputs once, time our search on them and write them for Galvatron."""
    model = MODELS[layers]
    full = analytic_cost_inputs(
        model, get_gpu("A100-80GB"), gpus, gpus_per_node=GPUS_PER_NODE, seq_length=SEQ_LENGTH
    )
    inputs = profiles.galvatron_representable(full, gpus)
    batch = batch_per_gpu * gpus
    pp_degrees = [p for p in (1, 2, 4, 8) if p <= min(MAX_PP, gpus)]
    budget = galvatron_budget_bytes(memory_gb)
    kwargs = dict(global_batch_size=batch, pp_degrees=pp_degrees, max_tp=MAX_TP)
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        ours = search(model, inputs, gpus, budget, **kwargs)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    # The micro-batch counts of earlier versions (m = P, 2P, 4P, 8P), for the before/after.
    cpu_start = time.process_time()
    narrow = search(model, inputs, gpus, budget, microbatch_counts=4, **kwargs)
    narrow_cpu_s = time.process_time() - cpu_start
    # Galvatron's partition space (even splits), for the comparison where ours is uneven.
    even = search(model, inputs, gpus, budget, even_partition=True, **kwargs)
    name = f"bench{layers}l{gpus}g{memory_gb}gb"
    profile_dir = os.path.join(work, name)
    docs = profiles.profile_documents(
        inputs,
        model_name=name,
        num_gpus=gpus,
        gpus_per_node=GPUS_PER_NODE,
        hidden_size=model.hidden_size,
    )
    profiles.write_profiles(profile_dir, docs)
    job = {
        "profile_dir": profile_dir,
        "model_name": name,
        "hidden_size": model.hidden_size,
        "num_layers": layers,
        "seq_len": SEQ_LENGTH,
        "num_nodes": max(1, gpus // GPUS_PER_NODE),
        "gpus_per_node": min(GPUS_PER_NODE, gpus),
        "memory_gb": memory_gb,
        "global_batch": batch,
        "max_tp": MAX_TP,
        "max_pp": MAX_PP,
        "evaluate": [galvatron_layers(ours), galvatron_layers(even)],
    }
    ours_s, ours_cpu_s = statistics.median(times), statistics.median(cpu_times)
    return Setting(
        layers, gpus, memory_gb, model, inputs, batch, budget, ours, ours_s, ours_cpu_s, even,
        narrow, narrow_cpu_s, job,
    )  # fmt: skip


def compare(st: Setting, galv: dict) -> Row:
    """The table row of one setting from our result and Galvatron's."""
    ours = st.ours
    galv_on_ours = galv["priced"][0]
    if galv["plan"] is None:
        g_pp, g_part, g_strat, g_m = 0, [], [], 0
        ours_on_galv, fits = 0.0, False
        g_desc = "none found"
    else:
        g_pp, g_part, g_strat, g_m = galvatron_plan(galv["plan"], st.gpus)
        price = price_plan(st.inputs, g_strat, g_part, g_m, st.batch)
        ours_on_galv, fits = price.throughput, price.fits(st.budget)
        g_desc = describe(g_pp, g_part, g_strat, g_m) + f", vocab TP {galv['plan'].get('vtp')}"
    same_strategies = ours.pp == g_pp and ours.strategies == g_strat
    return Row(
        layers=st.layers,
        gpus=st.gpus,
        memory_gb=st.memory_gb,
        model=st.model.name,
        ours_s=st.ours_s,
        galv_s=galv["search_s"],
        ours_cpu_s=st.ours_cpu_s,
        galv_cpu_s=galv["search_cpu_s"],
        same_plan=same_strategies and ours.partition == g_part,
        same_strategies=same_strategies,
        ours_tput=ours.throughput,
        galv_tput=galv["throughput"],
        ours_on_galv=ours_on_galv,
        galv_fits_ours=fits,
        galv_on_ours=galv_on_ours["throughput"],
        ours_fits_galv=galv_on_ours["fits"],
        galv_self_check=galv["self_check"]["throughput"] if galv["self_check"] else 0.0,
        ours_plan=describe(ours.pp, ours.partition, ours.strategies, ours.num_microbatches),
        galv_plan=g_desc,
        even_tput=st.even.throughput,
        even_on_galv=galv["priced"][1]["throughput"],
        even_fits_galv=galv["priced"][1]["fits"],
        ours_even=len(set(ours.partition)) <= 1 + (st.layers % ours.pp > 0),
        narrow_tput=st.narrow.throughput,
        narrow_cpu_s=st.narrow_cpu_s,
    )


def smoke(batch_per_gpu: int) -> None:
    """`--smoke`: `run_ours` on the smallest setting, its plan and the files Galvatron reads."""
    work = tempfile.mkdtemp(prefix="search-speed-")
    try:
        st = run_ours(24, 8, 24, batch_per_gpu, work, repeats=1)
        files = sorted(os.listdir(st.job["profile_dir"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = st.ours
    print(
        f"smoke: ours on {st.layers} layers, {st.gpus} GPUs, {st.memory_gb} GB in {st.ours_s:.3f} "
        f"s: {describe(r.pp, r.partition, r.strategies, r.num_microbatches)}, "
        f"{r.throughput:.2f} samples/s predicted; Galvatron's inputs: {', '.join(files)}; "
        "Galvatron not run (--smoke)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 16 GPUs only")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[32], choices=sorted(MODELS),
        help="models by layer count (32: LLaMA-7B)",
    )  # fmt: skip
    parser.add_argument("--gpus", type=int, nargs="+", default=None, choices=[8, 16, 64])
    parser.add_argument(
        "--memory-gb", type=galvatron_memory_gb, nargs="+", default=[24, 40],
        help="GB per GPU before Galvatron's reserves",
    )  # fmt: skip
    parser.add_argument("--batch-per-gpu", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="our search: median of N runs")
    parser.add_argument("--rebuild-galvatron", action="store_true")
    parser.add_argument("--galvatron-env", default=None, help="default: ~/.cache/dynapipe/...")
    parser.add_argument("--show-plans", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check: our side of the smallest setting (24 layers, 8 GPUs, 24 GB), once, "
        "with Galvatron's profile files written but Galvatron not run (its environment comes "
        "from PyPI)",
    )
    args = parser.parse_args()
    if args.smoke:
        smoke(args.batch_per_gpu)
        return
    gpus = args.gpus or ([8, 16] if args.quick else [8, 16, 64])

    start = time.perf_counter()
    env_dir = galvatron_env.build_env(
        args.galvatron_env, rebuild=args.rebuild_galvatron, verbose=True
    )
    print(f"Galvatron environment ready in {time.perf_counter() - start:.1f} s: {env_dir}")
    budgets = ", ".join(
        f"{gb} GB ({galvatron_budget_bytes(gb) / 2**30:.1f} GiB)" for gb in args.memory_gb
    )
    print(
        f"A100-80GB x {{{', '.join(map(str, gpus))}}}, {GPUS_PER_NODE}/node, seq {SEQ_LENGTH}, "
        f"global batch {args.batch_per_gpu}/GPU, budgets {budgets} after Galvatron's reserves, "
        f"TP <= {MAX_TP}, PP in {{1,2,4,8}}; Galvatron: its full space (vocabulary TP on)"
    )
    # One small search first, so that no timed run pays for lazy imports and first calls.
    warm = MODELS[24]
    search(
        warm,
        profiles.galvatron_representable(
            analytic_cost_inputs(warm, get_gpu("A100-80GB"), 8, seq_length=SEQ_LENGTH), 8
        ),
        8,
        galvatron_budget_bytes(max(args.memory_gb)),
        global_batch_size=64,
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    work = tempfile.mkdtemp(prefix="search-speed-")
    try:
        settings = []
        for n in gpus:
            for memory_gb in args.memory_gb:
                for layer_count in args.layers:
                    st = run_ours(layer_count, n, memory_gb, args.batch_per_gpu, work, args.repeats)
                    print(
                        f"  ours: {layer_count} layers on {n} GPUs at {memory_gb} GB in "
                        f"{st.ours_s:.3f} s",
                        flush=True,
                    )
                    settings.append(st)
        print(f"  Galvatron: {len(settings)} searches in one process ...", flush=True)
        galv = galvatron_env.run_searches(env_dir, [st.job for st in settings])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [compare(st, g) for st, g in zip(settings, galv["results"], strict=True)]
    header = (
        f"{'layers':>6} {'GPUs':>4} {'GB':>3} {'model':<12} {'ours s':>7} {'galv s':>7} "
        f"{'ours cpu':>8} {'galv cpu':>8} {'cpu x':>7} {'plan':>6} {'ours tput':>9} "
        f"{'galv tput':>9} {'ours@galv':>9} {'ours/galv':>9} {'galv@ours':>9} {'ours even':>9} "
        f"{'galv@even':>9} {'P..8P':>7} {'P..8P cpu':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        same = "same" if r.same_plan else ("layers" if r.same_strategies else "diff")
        on_galv = f"{r.ours_on_galv:9.2f}" if r.galv_fits_ours else "   no fit"
        on_ours = f"{r.galv_on_ours:9.2f}" if r.ours_fits_galv else "   no fit"
        on_even = f"{r.even_on_galv:9.2f}" if r.even_fits_galv else "   no fit"
        ratio = f"{r.ours_tput / r.ours_on_galv:9.3f}" if r.galv_fits_ours else "        -"
        print(
            f"{r.layers:>6} {r.gpus:>4} {r.memory_gb:>3} {r.model:<12} {r.ours_s:7.3f} "
            f"{r.galv_s:7.2f} {r.ours_cpu_s:8.3f} {r.galv_cpu_s:8.2f} "
            f"{r.galv_cpu_s / r.ours_cpu_s:6.0f}x {same:>6} {r.ours_tput:9.2f} "
            f"{r.galv_tput:9.2f} {on_galv} {ratio} {on_ours} {r.even_tput:9.2f} {on_even} "
            f"{r.narrow_tput:7.2f} {r.narrow_cpu_s:9.3f}"
        )
        if args.show_plans:
            print(f"        ours: {r.ours_plan}\n        galv: {r.galv_plan}")
    print(
        f"Galvatron process: {galv['total_s']:.1f} s in all, of which {galv['import_s']:.1f} s "
        "interpreter start-up and imports (not counted above)"
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        "ours/galv s: search wall time; ours/galv cpu: search CPU time (process time, less "
        "disturbed by other jobs on a shared machine); cpu x: galv cpu / ours cpu. tput: "
        "predicted samples/s, each engine's plan priced by its own cost model; ours@galv: "
        "Galvatron's plan priced by ours (`price_plan`); ours/galv: ours tput / ours@galv, our "
        "plan over Galvatron's under our estimator ('-': Galvatron's plan is over our memory "
        "model); galv@ours: our plan priced by Galvatron's at its best vocabulary TP ('no fit': "
        "over that engine's memory model); ours even: our search restricted to even "
        "partitions (`even_partition=True`, Galvatron's partition space), galv@even: that plan "
        "priced by Galvatron's. P..8P (cpu): our search over m = P, 2P, 4P, 8P only, the "
        "micro-batch counts before issue #21 (one run's CPU s). plan: same = per-layer "
        "strategies, PP and partition equal; layers = strategies equal, partition not; diff = "
        "otherwise."
    )
    print(
        "Both engines search the same layer strategies, PP degrees and micro-batch counts "
        "(every count dividing the batch); Galvatron splits layers its own way (ours: memory- "
        "then time-balanced), also searches vocabulary TP (nothing to split here: the inputs "
        "have no embedding or output layer) and prices with its own pipeline formula, DP/SDP "
        "overlap rules and p2p price, without a backward-peak memory term. So plans and "
        "predicted throughputs differ where those terms decide; each engine's pick is checked "
        "against the other's under its own model."
    )
    tol = 1e-9
    self_ok = all(abs(r.galv_self_check - r.galv_tput) <= 1e-6 * r.galv_tput for r in rows)
    print(
        "pricing harness: Galvatron's plan repriced by its cost model reproduces its search's "
        f"throughput: {'yes' if self_ok else 'NO'}"
    )
    ours_bad = [r for r in rows if r.galv_fits_ours and r.ours_tput < r.ours_on_galv * (1 - tol)]
    galv_bad = [r for r in rows if r.ours_fits_galv and r.galv_tput < r.galv_on_ours * (1 - tol)]
    even_bad = [r for r in rows if r.galv_fits_ours and r.even_tput < r.ours_on_galv * (1 - tol)]
    # Galvatron's search only splits evenly: where our partition is uneven, hold it to our
    # even-partition plan instead (a plan its space contains).
    galv_even_bad = [
        r
        for r in rows
        if (r.ours_fits_galv and r.galv_tput < r.galv_on_ours * (1 - tol))
        if r.ours_even
    ] + [
        r
        for r in rows
        if not r.ours_even and r.even_fits_galv and r.galv_tput < r.even_on_galv * (1 - tol)
    ]
    same = sum(r.same_plan for r in rows)
    close = sum(abs(r.ours_tput - r.galv_tput) <= 0.01 * r.galv_tput for r in rows)
    print(
        f"same plan: {same}/{len(rows)}; same predicted throughput (within 1%): {close}/{len(rows)}"
    )
    print(
        "ours >= Galvatron's plan under our model: "
        + ("every setting" if not ours_bad else f"NO in {len(ours_bad)} setting(s)")
        + "; Galvatron >= our plan under its model: "
        + ("every setting" if not galv_bad else f"NO in {len(galv_bad)} setting(s)")
    )
    print(
        "on Galvatron's space (even partitions): ours >= Galvatron's plan under our model: "
        + ("every setting" if not even_bad else f"NO in {len(even_bad)} setting(s)")
        + "; Galvatron >= our plan of that space under its model: "
        + ("every setting" if not galv_even_bad else f"NO in {len(galv_even_bad)} setting(s)")
    )
    ratios = [r.ours_tput / r.ours_on_galv for r in rows if r.galv_fits_ours]
    if ratios:
        print(
            f"our plan / Galvatron's plan under our estimator: {min(ratios):.3f}-"
            f"{max(ratios):.3f} over the {len(ratios)} settings where Galvatron's plan fits our "
            "memory model (target >= 1.00: "
            + ("met" if min(ratios) >= 1 - tol else "NOT met")
            + ")"
            + ("" if len(ratios) == len(rows) else f"; {len(rows) - len(ratios)} not comparable")
        )
    gain = [r.ours_tput / r.narrow_tput for r in rows]
    print(
        f"every micro-batch count vs m = P..8P only: plans {min(gain):.3f}-{max(gain):.3f}x, "
        f"CPU time {sum(r.ours_cpu_s for r in rows):.2f} s vs "
        f"{sum(r.narrow_cpu_s for r in rows):.2f} s over the {len(rows)} settings"
    )
    cpu = [r.galv_cpu_s / r.ours_cpu_s for r in rows]
    print(
        f"search time: ours {min(r.ours_s for r in rows):.3f}-{max(r.ours_s for r in rows):.3f} s "
        f"wall, Galvatron {min(r.galv_s for r in rows):.1f}-{max(r.galv_s for r in rows):.1f} s "
        f"wall; Galvatron / ours in CPU time {min(cpu):.0f}-{max(cpu):.0f}x "
        f"(target >= {TARGET_SPEEDUP:.0f}x: "
        + ("met" if min(cpu) >= TARGET_SPEEDUP else "NOT met")
        + ")"
    )


if __name__ == "__main__":
    main()
