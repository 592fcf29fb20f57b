"""Measures the profiled cost table on this device (DynaPipe seed `dynapipe.txt` §3 "Cost
models": per-layer forward/backward time and memory profiled over micro-batch sizes and sequence
lengths, interpolated by the planner; §8 checks the result against real iterations).

Each component is a piece of a real megatron-core GPTModel wrapped in megatron's DDP with its
optimiser, exactly as `megatron.dynapipe.training` runs it:

* `embedding`: `GPTModel.embedding` (word + position embeddings, dropout);
* `decoder_layer`: the `TransformerBlock` of a one-layer model without the output layer, so
  megatron's own recompute paths (`selective`, `full`) run as in training;
* `lm_head`: final layer norm, output layer, cross-entropy and the executor's masked token sum.

Per grid point, forward and backward times are medians of timed repeats (after warm-up), and
memory comes from one traced forward + backward (`megatron.dynapipe.memory`):
`activation_bytes` are the bytes the forward allocated that are still alive when it returns (its
saved tensors and its output: what a micro-batch holds until its backward; megatron's attention
workspace excepted, see `memory.py`), `transient_bytes` the extra above that level at the peak
of the forward or the backward. `static_bytes` (weights,
DDP gradient buffers, Adam state) are live-tensor differences between models with and without
the component, after one optimiser step created Adam's state. Points that run out of memory, or
that exceed the grid's token cap, are `null` (infeasible for the planner).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from torch.distributed.device_mesh import DeviceMesh

from dynapipe_planner.cost.profiled import FORMAT
from dynapipe_planner.megatron_model import spec_from_args
from dynapipe_planner.schedule.one_f_one_b import one_f_one_b_passes

from .data.microbatches import MicroBatchTensors, thd_params
from .memory import (
    MemoryTrace,
    live_tensor_bytes,
    megatron_workspace_bytes,
    release_megatron_workspace,
)
from .model import build_gpt_model
from .model_flags import dtype_name
from .pipeline.executor import gpt_forward_step, masked_token_loss
from .sharded_layers import shard_unit

COMPONENTS = ("embedding", "decoder_layer", "lm_head")


@dataclass(frozen=True)
class ProfileGrid:
    """Micro-batch sizes x sequence lengths to measure; points above `max_tokens` (b * s) are
    not run and stay null (0: no cap)."""

    microbatch_sizes: tuple[int, ...]
    seqlens: tuple[int, ...]
    max_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("microbatch_sizes", "seqlens"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be positive and strictly increasing, got {values}")
        if self.microbatch_sizes[0] != 1:
            raise ValueError("microbatch_sizes must start at 1 (the planner's grid does)")

    def points(self) -> list[tuple[int, int]]:
        return [(b, s) for b in self.microbatch_sizes for s in self.seqlens]


@dataclass(frozen=True)
class PointCost:
    forward_s: float
    backward_s: float
    activation_bytes: int
    transient_bytes: int
    cpu_s: float = 0.0  # CPU time of the process (all its threads) over forward + backward


@dataclass
class _Component:
    """A measured piece of the model: `make_inputs(b, s)` gives the forward's arguments and the
    gradient its output receives (None for a loss)."""

    name: str
    forward: Callable[..., torch.Tensor]
    make_inputs: Callable[[int, int], tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]


@dataclass
class _Built:
    model: DistributedDataParallel
    optimizer: Any  # holds Adam's state, alive as long as the model, as in training
    static_bytes: int


def _build(
    args: argparse.Namespace,
    vocab_size: int,
    device: torch.device,
    *,
    layers: int,
    pre_process: bool,
    post_process: bool,
    recompute: str = "none",
) -> _Built:
    """A DDP-wrapped model of `layers` layers (embeddings untied, so each component owns its
    weights) with its Adam state, and the tensor bytes they added."""
    variant = argparse.Namespace(**vars(args))
    variant.num_layers = layers
    variant.untie_embeddings_and_output_weights = True
    before = live_tensor_bytes(device)
    config, model = build_gpt_model(
        variant,
        vocab_size,
        pre_process=pre_process,
        post_process=post_process,
        recompute=recompute,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            clip_grad=0.0,
            bf16=args.bf16,
            fp16=args.fp16,
        ),
        [ddp],
    )
    ddp.zero_grad_buffer()
    optimizer.step()  # Adam allocates its state at the first step
    return _Built(ddp, optimizer, live_tensor_bytes(device) - before)


def static_bytes(args: argparse.Namespace, vocab_size: int, device: torch.device) -> dict[str, int]:
    """Weights + gradient buffers + optimiser state of each component, by difference of three
    measured models: A = embedding + 1 layer, B = 1 layer + head, C = embedding + 2 layers."""
    sizes = {}
    for key, layers, pre, post in (
        ("A", 1, True, False),
        ("B", 1, False, True),
        ("C", 2, True, False),
    ):
        built = _build(args, vocab_size, device, layers=layers, pre_process=pre, post_process=post)
        sizes[key] = built.static_bytes
        del built
    layer = sizes["C"] - sizes["A"]
    return {
        "decoder_layer": layer,
        "embedding": sizes["A"] - layer,
        "lm_head": sizes["B"] - layer,
    }


def _components(
    args: argparse.Namespace, vocab_size: int, device: torch.device, recompute: str
) -> tuple[list[_Component], list[_Built]]:
    """The three components, built for `recompute`; keep the models alive while used."""
    parts = {"layers": 1, "recompute": recompute}
    front = _build(args, vocab_size, device, pre_process=True, post_process=False, **parts)
    back = _build(args, vocab_size, device, pre_process=False, post_process=True, **parts)
    first, last = front.model.module, back.model.module
    dtype, h, vocab = args.params_dtype, args.hidden_size, vocab_size

    def tokens(b: int, s: int) -> torch.Tensor:
        return torch.randint(0, vocab, (b, s), device=device)

    def hidden(b: int, s: int, grad: bool) -> torch.Tensor:
        return torch.randn(s, b, h, dtype=dtype, device=device, requires_grad=grad)

    def embedding_inputs(b, s):
        positions = torch.arange(s, device=device).repeat(b, 1)
        return (tokens(b, s), positions), hidden(b, s, False)

    def decoder_inputs(b, s):
        # b samples of s tokens as the runtime runs them: one THD sequence [b * s, 1, h] whose
        # samples attend only within themselves (`data.microbatches`, `packed_attention`).
        bounds = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=device)
        return (hidden(1, b * s, True), thd_params(bounds, s)), hidden(1, b * s, False)

    def head_inputs(b, s):
        loss_mask = torch.ones(b, s, dtype=torch.float32, device=device)
        return (hidden(b, s, True), tokens(b, s), loss_mask), None

    def head(x: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        logits, _ = last.output_layer(last.decoder.final_layernorm(x))
        return masked_token_loss(loss_mask, last.compute_language_model_loss(labels, logits))[0]

    components = [
        _Component("embedding", lambda t, p: first.embedding(t, p), embedding_inputs),
        _Component(
            "decoder_layer",
            lambda x, params: first.decoder(
                hidden_states=x, attention_mask=None, packed_seq_params=params
            ),
            decoder_inputs,
        ),
        _Component("lm_head", head, head_inputs),
    ]
    return components, [front, back]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _align_tp_ranks() -> None:
    """Start a timed pass on every rank of a TP group at once: a rank that arrives early at
    TP's first all-reduce would otherwise time its peers' lateness, which training does not
    pay pass after pass (the ranks run in step there)."""
    if mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.barrier(group=mpu.get_tensor_model_parallel_group())


def _is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "allocate" in str(err)
    )


CLOCKS = ("wall", "cpu")


def measure_point(
    component: _Component,
    b: int,
    s: int,
    device: torch.device,
    warmup: int,
    repeats: int,
    clock: str = "wall",
) -> PointCost | None:
    """Time and memory of one component at micro-batch shape (b, s); None if out of memory.
    `clock` "cpu" times passes in the process's CPU seconds (the CPU only): the work of a
    rank that has its own core, which other jobs on a shared machine do not inflate as they
    do wall time."""
    try:
        args, grad = component.make_inputs(b, s)

        def backward(out: torch.Tensor) -> None:
            torch.autograd.backward(out, grad)
            for a in args:
                if isinstance(a, torch.Tensor):
                    a.grad = None  # the executor sends the input gradient away each time

        for _ in range(warmup):
            backward(component.forward(*args))
        timer = time.process_time if clock == "cpu" and device.type == "cpu" else time.perf_counter
        forward_s, backward_s, cpu_s = [], [], []
        for _ in range(repeats):
            _synchronize(device)
            _align_tp_ranks()
            t0, cpu0 = timer(), time.process_time()
            out = component.forward(*args)
            _synchronize(device)
            t1 = timer()
            backward(out)
            _synchronize(device)
            forward_s.append(t1 - t0)
            backward_s.append(timer() - t1)
            cpu_s.append(time.process_time() - cpu0)
            del out
        release_megatron_workspace()
        with MemoryTrace(device) as trace:
            with trace.phase("forward"):
                out = component.forward(*args)
            workspace = megatron_workspace_bytes()
            with trace.phase("backward"):
                backward(out)
        del out
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if not _is_out_of_memory(err):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    fwd, bwd = trace.phases["forward"], trace.phases["backward"]
    activation = fwd.end - workspace  # megatron's attention workspace is transient (memory.py)
    return PointCost(
        statistics.median(forward_s),
        statistics.median(backward_s),
        activation,
        max(fwd.peak, bwd.peak) - activation,
        statistics.median(cpu_s),
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def profile_cost_table(
    args: argparse.Namespace,
    vocab_size: int,
    grid: ProfileGrid,
    recompute_modes: tuple[str, ...],
    device: torch.device,
    *,
    warmup: int = 1,
    repeats: int = 3,
    clock: str = "wall",
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The cost table (docs/architecture.md "Cost tables") of the model `args` (Megatron's flags)
    describe, with `vocab_size` rows, for the TP degree of the parallel state (one rank, or the TP
    group of a TP-only job: every rank runs its shard, TP's all-reduces included in the times; the
    numbers are this rank's), its passes timed by `clock` (`measure_point`). `progress` receives one
    line per measured point."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    cpu_clock = clock == "cpu" and device.type == "cpu"
    statics = static_bytes(args, vocab_size, device)
    entries, measured = [], []
    total = len(recompute_modes) * len(COMPONENTS) * len(grid.points())
    done = 0
    for mode in recompute_modes:
        components, keep_alive = _components(args, vocab_size, device, mode)
        for component in components:
            table: dict[tuple[int, int], PointCost | None] = {}
            for b, s in grid.points():
                done += 1
                where = f"[{done}/{total}] recompute={mode} {component.name} b={b} s={s}"
                if grid.max_tokens and b * s > grid.max_tokens:
                    table[b, s] = None
                    progress(f"{where}: skipped (b*s > max tokens {grid.max_tokens}), null")
                    continue
                cost = measure_point(component, b, s, device, warmup, repeats, clock)
                table[b, s] = cost
                measured += [cost] if cost is not None else []
                progress(f"{where}: {_describe(cost)}")
            entries.append(_entry(mode, component.name, grid, table, statics[component.name]))
        del components, keep_alive
    result = {
        "format": FORMAT,
        "version": 1,
        "device": device_name(device),
        "dtype": dtype_name(args),
        "model": spec_from_args(args, vocab_size, "profiled_gpt").to_dict(),
        "profile": {
            "warmup": warmup,
            "repeats": repeats,
            "max_tokens": grid.max_tokens,
            "clock": "cpu" if cpu_clock else "wall",
        },
        "entries": entries,
    }
    if device.type == "cpu" and measured and not cpu_clock:  # the CPU share of wall time
        result["host_cores"] = len(os.sched_getaffinity(0))
        tp = str(mpu.get_tensor_model_parallel_world_size())
        result["cpu_busy_fraction"] = {tp: cpu_busy_fraction(measured)}
    return result


def runtime_overhead_s(
    args: argparse.Namespace,
    vocab_size: int,
    device: torch.device,
    table: dict[str, Any],
    *,
    warmup: int = 1,
    repeats: int = 3,
) -> dict[str, float]:
    """Per profiled sequence length s: what one micro-batch of one sample costs the runtime
    beyond its decoder layer and output layer as `table` (recompute none) priced them. A
    whole one-layer model, DDP-wrapped as training runs it, goes through the executor's
    forward step, loss and backward; the median over `repeats` minus the two components' times
    at (1, s), kept >= 0, is the embedding's lookup, the batch's move to the device and the
    model's, DDP's and the loss's plumbing: what every pipeline stage pays in part per
    micro-batch, whatever its layers (the search adds it to each stage's micro-batch)."""
    priced = {
        e["component"]: e
        for e in table["entries"]
        if e["recompute"] == "none" and e["component"] in ("decoder_layer", "lm_head")
    }
    if len(priced) < 2:  # profiled with recomputation only: nothing to subtract
        return {}
    built = _build(args, vocab_size, device, layers=1, pre_process=True, post_process=True)
    overhead = {}
    for col, s in enumerate(next(iter(priced.values()))["seqlens"]):
        tokens = torch.randint(0, vocab_size, (1, s))
        batch = MicroBatchTensors(
            tokens=tokens,
            labels=tokens.roll(-1, dims=1),
            loss_mask=torch.ones(1, s),
            position_ids=torch.arange(s).unsqueeze(0),
            num_tokens=s,
            cu_seqlens=torch.tensor([0, s], dtype=torch.int32),
            row_length=s,
        )
        step = functools.partial(_one_sample_step, built.model, batch)
        whole = _median_s(step, device, warmup, repeats)
        pieces = [e[name][0][col] for e in priced.values() for name in ("forward_s", "backward_s")]
        if None not in pieces:
            overhead[str(s)] = max(0.0, whole - sum(pieces))
    return overhead


def _one_sample_step(model: DistributedDataParallel, batch: MicroBatchTensors) -> None:
    """One micro-batch through the executor's forward step, loss and backward."""
    output, loss_func = gpt_forward_step(iter([batch]), model)
    torch.autograd.backward(loss_func(output)[0])


def cpu_busy_fraction(measured: list[PointCost]) -> float:
    """The share of its passes' wall time this rank's process was on a core: all its threads'
    CPU seconds over the wall seconds of every measured forward + backward. Ranks sharing
    fewer cores than there are ranks cannot run their pipeline stages side by side; the search
    bounds a plan's time by the CPU seconds its ranks need (`estimator.shared_host_time`)."""
    wall = sum(c.forward_s + c.backward_s for c in measured)
    return sum(c.cpu_s for c in measured) / wall


def cpu_contention_factor(
    args: argparse.Namespace,
    vocab_size: int,
    device: torch.device,
    ranks: int,
    b: int,
    s: int,
    *,
    rounds: int = 3,
) -> float:
    """How many more CPU seconds a TP-1 decoder layer's passes at (b, s) take as the first of
    `ranks` pipeline stages on this machine's cores than alone. Ranks that outnumber the
    cores evict each other's caches, and more so where they sleep and wake at every hand-off,
    as pipeline stages do (on the 2-core CPU with 4 ranks, copies that only computed side by
    side read 1.03-1.09; as a pipeline 1.28-1.39 at b=1 and 1.14-1.21 at b=8, near a PP4
    run's layers: 4.6 ms CPU a forward at b=1, 3.5 alone). The
    other stages are forked copies of this process (no collectives: TP 1) that run the 1F1B
    order of 4 x `ranks` micro-batches, one layer each, handing over through pipes; stage 0's
    CPU seconds over its passes, against the same passes alone, alternated `rounds` times
    (the host's speed drifts within minutes), as the ratio of their sums."""
    components, _keep = _components(args, vocab_size, device, "none")
    layer = next(c for c in components if c.name == "decoder_layer")
    inputs, grad = layer.make_inputs(b, s)
    orders = one_f_one_b_passes(ranks, 4 * ranks)
    context = multiprocessing.get_context("fork")

    def stage(i: int, links: dict[str, Any]) -> float:
        """Stage i's 1F1B passes, each waiting for its input from the stage it comes from."""
        outputs: dict[int, torch.Tensor] = {}
        busy = 0.0
        for kind, k in orders[i]:
            if links.get(kind + "_in") is not None:
                links[kind + "_in"].recv()
            started = time.process_time()
            if kind == "F":
                outputs[k] = layer.forward(*inputs)
            else:
                torch.autograd.backward(outputs.pop(k), grad)
                for tensor in inputs:
                    tensor.grad = None
            busy += time.process_time() - started
            if links.get(kind + "_out") is not None:
                links[kind + "_out"].send(k)
        return busy

    def only(links: dict[str, Any], ends: list[Any]) -> dict[str, Any]:
        """Close every pipe end but `links`, so that a stage that dies ends its
        neighbours' waits (EOFError) instead of hanging them."""
        for end in ends:
            if all(end is not mine for mine in links.values()):
                end.close()
        return links

    def forked_stage(i: int, links: dict[str, Any], ends: list[Any]) -> None:
        stage(i, only(links, ends))

    def pipeline() -> float:
        forward = [context.Pipe(duplex=False) for _ in range(ranks - 1)]  # i -> i + 1
        backward = [context.Pipe(duplex=False) for _ in range(ranks - 1)]  # i + 1 -> i
        ends = [end for pair in forward + backward for end in pair]
        others = []
        for i in range(1, ranks):
            links = {"F_in": forward[i - 1][0], "B_out": backward[i - 1][1]}
            if i < ranks - 1:
                links.update(F_out=forward[i][1], B_in=backward[i][0])
            others.append(context.Process(target=forked_stage, args=(i, links, ends)))
        for process in others:
            process.start()
        try:
            return stage(0, only({"F_out": forward[0][1], "B_in": backward[0][0]}, ends))
        finally:
            for process in others:
                process.join()
            for end in ends:
                end.close()

    stage(0, {})  # warm-up
    alone = beside = 0.0
    for _ in range(rounds):
        alone += stage(0, {})
        beside += pipeline()
    return beside / alone


def _describe(cost: PointCost | None) -> str:
    if cost is None:
        return "out of memory, null"
    return (
        f"forward {cost.forward_s * 1e3:.2f} ms, backward {cost.backward_s * 1e3:.2f} ms, "
        f"activations {cost.activation_bytes / 2**20:.2f} MiB, "
        f"transient {cost.transient_bytes / 2**20:.2f} MiB"
    )


def _entry(
    mode: str,
    component: str,
    grid: ProfileGrid,
    table: dict[tuple[int, int], PointCost | None],
    static: int,
) -> dict[str, Any]:
    def field(name: str) -> list[list[float | int | None]]:
        return [
            [None if table[b, s] is None else getattr(table[b, s], name) for s in grid.seqlens]
            for b in grid.microbatch_sizes
        ]

    return {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "recompute": mode,
        "component": component,
        "microbatch_sizes": list(grid.microbatch_sizes),
        "seqlens": list(grid.seqlens),
        "forward_s": field("forward_s"),
        "backward_s": field("backward_s"),
        "activation_bytes": field("activation_bytes"),
        "transient_bytes": field("transient_bytes"),
        "static_bytes": static,
    }


def allreduce_bus_bandwidth(
    device: torch.device, nbytes: int = 16 * 2**20, warmup: int = 2, repeats: int = 5
) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce of `nbytes` over the world group: a ring moves
    2 (n-1)/n of the bytes through every rank, so this is the number a search divides its
    all-reduce volumes by (Galvatron-BMW §V: "size of tensor ... divided by the bandwidth").
    The median of `repeats` timed all-reduces after `warmup` untimed ones."""
    n = torch.distributed.get_world_size()
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return 2.0 * (n - 1) / n * nbytes / _median_allreduce_s(buffer, device, warmup, repeats)


def allreduce_latency_s(device: torch.device, warmup: int = 3, repeats: int = 21) -> float:
    """Seconds one all-reduce of a single number takes over the world group (the median of
    `repeats` after a barrier each): what a transfer costs beyond its bytes on this machine,
    including waking the peer processes up when they share cores."""
    one = torch.ones(1, dtype=torch.float32, device=device)
    return _median_allreduce_s(one, device, warmup, repeats)


def _median_allreduce_s(
    tensor: torch.Tensor, device: torch.device, warmup: int, repeats: int
) -> float:
    """The median seconds of `repeats` all-reduces of `tensor` over the world group, each
    after a barrier, following `warmup` untimed ones."""
    return _median_s(
        lambda: torch.distributed.all_reduce(tensor), device, warmup, repeats, barrier=True
    )


def _median_s(
    run: Callable[[], object],
    device: torch.device,
    warmup: int,
    repeats: int,
    *,
    barrier: bool = False,
) -> float:
    """The median wall seconds of `repeats` calls of `run` after `warmup` untimed ones, the
    device synchronised around each (and, with `barrier`, the world group aligned before
    each)."""
    times = []
    for i in range(warmup + repeats):
        _synchronize(device)
        if barrier:
            torch.distributed.barrier()
        started = time.perf_counter()
        run()
        _synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def decoder_layer_shapes(args: argparse.Namespace, vocab_size: int, device: torch.device) -> list:
    """The parameter shapes of one decoder layer without tensor parallelism, read from a
    layer built at this job's TP degree (a TP-split dimension times the degree)."""
    built = _build(args, vocab_size, device, layers=1, pre_process=False, post_process=False)
    tp = mpu.get_tensor_model_parallel_world_size()
    shapes = []
    for p in built.model.module.parameters():
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tp
        shapes.append(tuple(shape))
    return shapes


class _Weights(torch.nn.Module):
    """Parameters of given shapes whose forward costs next to nothing: what FSDP2 adds to a
    layer is its sharded time minus this module's replicated time."""

    def __init__(self, shapes: list, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(shape, device=device, dtype=dtype)) for shape in shapes
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(w.reshape(-1)[0] for w in self.weights)


@dataclass(frozen=True)
class SdpOverhead:
    """What FSDP2 adds to a layer's forward and backward (s), and the share of that added
    time the rank's process was on a CPU core."""

    forward_s: float
    backward_s: float
    cpu_busy_fraction: float
    transient_bytes: int  # FSDP2's peak over its sharded state in a stage of such layers


def sdp_layer_overhead_s(
    shapes: list,
    device: torch.device,
    warmup: int = 2,
    repeats: int = 7,
    dtype: torch.dtype = torch.float32,
) -> SdpOverhead:
    """What FSDP2 adds to a layer with `dtype` parameters of `shapes` sharded over the world
    group as `sharded_layers` shards an SDP layer (one unit, resharded after the forward,
    summed gradients): the all-gather before the forward and before the backward (copy-in,
    collective, copy-out), the gradients' reduce-scatter after it, its hooks. Medians of
    `repeats` timed passes after `warmup`, sharded minus replicated, each pass after a
    barrier (Galvatron-BMW §V prices these transfers as bytes over a bandwidth; on gloo
    FSDP2's copies and hooks cost as much again, so they are measured); the CPU share is the
    added CPU seconds (all threads) over the added wall seconds. A stack of such layers is
    traced for memory (`_fsdp2_stack_transient`): its peak above what it leaves (gathered
    weights, unsharded gradients, reduce-scatter buffers and gloo's copy of them, of several
    layers at once), which §V prices as one layer's gathered weights."""
    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, device.type)
    x = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    times = []
    for sharded in (False, True):
        module = _Weights(shapes, device, dtype)
        if sharded:
            shard_unit(module, mesh)
        forward_s, backward_s, cpu_s = [], [], []
        for i in range(warmup + repeats):
            module.zero_grad(set_to_none=True)
            _synchronize(device)
            torch.distributed.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            out = module(x)
            _synchronize(device)
            middle = time.perf_counter()
            out.sum().backward()
            _synchronize(device)
            if i >= warmup:
                forward_s.append(middle - started)
                backward_s.append(time.perf_counter() - middle)
                cpu_s.append(time.process_time() - cpu)
        times.append(tuple(statistics.median(v) for v in (forward_s, backward_s, cpu_s)))
    traced = _fsdp2_stack_transient(shapes, device, dtype, x, mesh)
    (plain_f, plain_b, plain_cpu), (sharded_f, sharded_b, sharded_cpu) = times
    added = sharded_f + sharded_b - plain_f - plain_b
    share = (sharded_cpu - plain_cpu) / added if added > 0 else 1.0
    return SdpOverhead(
        max(sharded_f - plain_f, 0.0),
        max(sharded_b - plain_b, 0.0),
        min(max(share, 0.0), 1.0),
        traced,
    )


def _fsdp2_stack_transient(
    shapes: list,
    device: torch.device,
    dtype: torch.dtype,
    x: torch.Tensor,
    mesh: DeviceMesh,
    depth: int = 3,
) -> int:
    """FSDP2's peak over its sharded state during one forward + backward of `depth` such
    layers, each a unit under one root as `sharded_layers` builds a stage: while one layer's
    backward runs, the next one's gather is prefetched and the previous one's reduce-scatter
    buffers are still held, so several layers' buffers are alive at once."""
    from torch.distributed.fsdp import fully_shard

    stack = torch.nn.Sequential(*(_Weights(shapes, device, dtype) for _ in range(depth)))
    for unit in stack:
        shard_unit(unit, mesh)
    fully_shard(stack, mesh=mesh, reshard_after_forward=True)  # the root, as `sharded_layers`
    stack(x).sum().backward()  # warm-up: FSDP2 allocates its lazy state at the first pass
    stack.zero_grad(set_to_none=True)
    with MemoryTrace(device) as trace, trace.phase("pass"):
        stack(x).sum().backward()
    traced = trace.phases["pass"]
    return max(traced.peak - traced.end, 0)
