"""Measured tensor memory: what the profiler's cost table and the accuracy benchmark both read.

DynaPipe's cost model (seed `dynapipe.txt` §3 "Cost models", §8 "cost model accuracy") is only
as good as its memory numbers, so they are measured, never derived from formulas, and the
table and the run are measured with the same instrument:

* CUDA: the caching allocator's counters (`memory_allocated`, `max_memory_allocated`).
* CPU: torch has no allocator counters, but the profiler with `profile_memory=True` reports
  every allocation and free of the CPU allocator (with its size and address) made on the
  thread that traces; the running sum of those events is the live tensor bytes allocated since
  the trace began, and its maximum the peak. Frees of tensors allocated before the trace are
  not reported, so a trace never sees memory go below its start; every region traced here
  starts after what it may free was created (e.g. a forward and its backward are traced
  together).

  Frees made on other threads are not reported either, and gloo makes many: its worker thread
  holds a collective's tensors until the collective is done, and when the caller has already
  dropped them (a TP all-reduce's partial sums) the worker's
  release is the free; so is the release of the buffers a collective allocates for its worker
  (gloo's reduce-scatter clones its input: a 3 MiB copy per FSDP2 layer here).
  Replayed as reported, those blocks would stay live to the trace's end (measured: 6-14 MiB
  of TP4 partial sums per rank, a different amount on each rank of one TP group, by the race
  between the caller and the worker; 6-12 MiB of FSDP2's reduce-scatter copies on SDP4 ranks).
  `_replay` restores the missing frees from what is certain: a block never seen freed was
  freed before its address was allocated again, and a block a collective took or allocated
  was freed when the last collective that did so ended (unless it is still alive when the
  trace ends): the worker releases it right after the collective; for an asynchronous one,
  which the trace shows only as its start, that is early by the time until its wait.

Kineto prints a line per CPU trace unless `KINETO_LOG_LEVEL=5` is set before torch is imported
(the command-line tools do so).

`traced_peak` gives a training iteration's peak per rank (`--log-peak-memory`): the live tensor
bytes when the iteration starts plus the traced peak above them during it; what it leaves out is
said there.

`live_tensor_bytes` measures what exists at one moment (weights, gradients, optimiser state):
on CUDA the allocator's count, on CPU the storages of every live tensor, each counted once.

megatron-core's local attention takes a workspace as large as the micro-batch's attention scores
from its global memory buffer and keeps the largest one ever requested for the rest of the job.
The planner prices that workspace as transient memory of the micro-batch that needs it (the
largest one in flight sets the peak), so the executor releases it after every iteration
(`release_megatron_workspace`) and the profiler counts it as transient, not as activations.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from torch._C._profiler import _EventType

_PHASE = "dynapipe::phase::"


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes above the trace's start: the maximum during a phase and the level when it ended."""

    peak: int
    end: int


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of tensor storage alive on `device` now (each storage once)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return sum(_live_storages(device).values())


def _live_storages(device: torch.device) -> dict[int, int]:
    """Address -> bytes of every tensor storage alive on `device` (a CPU one) now."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != device.type:
            continue
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue  # sparse or wrapper tensors own no storage; FSDP2's freed ones are invalid
        if pointer:
            seen[pointer] = storage.nbytes()
    return seen


def megatron_workspace_bytes() -> int:
    """Bytes held by megatron-core's global memory buffer now."""
    buffers = mpu.get_global_memory_buffer().buffer.values()
    return sum(t.untyped_storage().nbytes() for t in buffers)


def release_megatron_workspace() -> None:
    """Drop megatron-core's global memory buffer; it is re-allocated at the next request."""
    mpu.get_global_memory_buffer().buffer.clear()


@dataclass
class PeakMemory:
    """Filled when `traced_peak`'s region ends: `static` bytes alive at its start, `peak` the
    most tensor bytes alive at once during it (static included)."""

    static: int = 0
    peak: int = 0


def every_rank(peak: int) -> list[int]:
    """This rank's traced `peak` and every other rank's, in rank order (for the log line)."""
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return peaks


@contextlib.contextmanager
def traced_peak(device: torch.device) -> Iterator[PeakMemory]:
    """The peak tensor memory of the enclosed region on `device`.

    Counted: tensor storages alive at the start (`live_tensor_bytes`: weights, Megatron's
    gradient buffers, optimiser state, input tensors, megatron-core's workspace) plus the
    highest level, above that start, of the bytes allocated during the region and not yet freed
    (CPU: the allocator events of the torch profiler; CUDA: the caching allocator's counters):
    activations, received buffers, gradients, transients, Adam's temporaries. Not counted:
    the allocator's cached but free blocks and fragmentation, memory outside torch tensors
    (Python objects, gloo's and NCCL's buffers, the libraries), and on the CPU frees of tensors
    allocated before the region (the level never drops below the start). The trace slows the
    region it watches on the CPU.
    """
    result = PeakMemory()
    result.static = live_tensor_bytes(device)
    with MemoryTrace(device) as trace, trace.phase("region"):
        yield result
    result.peak = result.static + trace.phases["region"].peak


class MemoryTrace:
    """Allocations on `device` during a region, split into named phases.

    Use `with MemoryTrace(device) as trace:` around the region and `with trace.phase(name):`
    around each part; after the region `trace.phases[name]` holds that phase's `PhaseMemory`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, PhaseMemory] = {}
        self._profiler: torch.profiler.profile | None = None
        self._base = 0

    def __enter__(self) -> MemoryTrace:
        if self.device.type == "cuda":
            self._base = live_tensor_bytes(self.device)
        else:
            self._profiler = torch.profiler.profile(  # shapes: the collectives' tensors
                activities=[torch.profiler.ProfilerActivity.CPU],
                profile_memory=True,
                record_shapes=True,
            )
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(*exc_info)
        if exc_info[0] is None:
            tree = self._profiler.profiler.kineto_results.experimental_event_tree()
            self.phases = _replay(*_trace_events(tree), lambda: set(_live_storages(self.device)))
        self._profiler = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark the enclosed code as phase `name`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.phases[name] = PhaseMemory(
                torch.cuda.max_memory_allocated(self.device) - self._base,
                torch.cuda.memory_allocated(self.device) - self._base,
            )
            return
        with torch.profiler.record_function(_PHASE + name):
            yield


def _trace_events(
    tree: list,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, str]], dict[int, list[int]]]:
    """From the profiler's event tree: the CPU allocator's events (time, address, bytes; a
    free has negative bytes) in time order, the phase windows, and for every address a
    collective (`c10d::` op) took or allocated, when each such collective ended (in time
    order). What a collective allocates inside its op is its own buffer for the worker thread
    (gloo's reduce-scatter clones its input, its all-gather allocates a staging buffer),
    which the worker frees when the collective is done."""
    allocations, windows, collective_ends = [], [], {}
    stack = [(event, None) for event in tree]  # (event, end of the collective it is inside)
    while stack:
        event, inside = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
                if inside is not None and fields.alloc_size > 0:
                    collective_ends.setdefault(fields.ptr, []).append(inside)
        elif event.tag == _EventType.TorchOp:
            if event.name.startswith(_PHASE):
                windows.append((event.start_time_ns, event.end_time_ns, event.name[len(_PHASE) :]))
            elif event.name.startswith("c10d::"):
                inside = event.end_time_ns
                for pointer in _tensor_addresses(event.extra_fields.inputs):
                    collective_ends.setdefault(pointer, []).append(inside)
        stack.extend((child, inside) for child in event.children)
    allocations.sort(key=lambda a: (a[0], a[2] > 0))
    windows.sort()
    for ends in collective_ends.values():
        ends.sort()
    return allocations, windows, collective_ends


def _tensor_addresses(inputs: list) -> Iterator[int]:
    """Storage addresses of an op's tensor arguments (tensor lists included)."""
    for value in inputs:
        for item in value if isinstance(value, list) else [value]:
            pointer = getattr(item, "storage_data_ptr", None)
            if pointer:
                yield pointer


def _replay(
    allocations: list[tuple[int, int, int]],
    windows: list[tuple[int, int, str]],
    collective_ends: dict[int, list[int]],
    alive_now: Callable[[], set[int]],
) -> dict[str, PhaseMemory]:
    """Replay the allocator's events in time order, with the frees another thread made
    restored (module docstring), and read each phase's window. `alive_now()`: the addresses
    of the storages alive when the trace ended (asked only if a collective's block was never
    seen freed nor reallocated)."""
    blocks: list[list] = []  # [address, bytes, allocated at, freed at (None: not seen), seen]
    open_blocks: dict[int, int] = {}
    for time_ns, pointer, nbytes in allocations:
        if nbytes > 0:
            if pointer in open_blocks:  # reallocated: freed before, on another thread
                blocks[open_blocks[pointer]][3] = time_ns
            open_blocks[pointer] = len(blocks)
            blocks.append([pointer, nbytes, time_ns, None, False])
        elif pointer in open_blocks:  # else allocated before the trace, not counted either
            block = blocks[open_blocks.pop(pointer)]
            block[3], block[4] = time_ns, True
    alive: set[int] | None = None
    events = []
    for pointer, nbytes, allocated, freed, seen in blocks:
        events.append((allocated, nbytes))
        if not seen:  # freed on another thread: when the last collective that took it ended
            ends = [t for t in collective_ends.get(pointer, ()) if t >= allocated]
            ends = [t for t in ends if freed is None or t <= freed]
            if ends and freed is None:
                alive = set(alive_now()) if alive is None else alive
                if pointer in alive:
                    ends = []
            freed = ends[-1] if ends else freed
        if freed is not None:
            events.append((freed, -nbytes))
    events.sort(key=lambda e: (e[0], e[1] > 0))
    phases, live, k = {}, 0, 0
    for start, end, name in windows:
        while k < len(events) and events[k][0] < start:
            live += events[k][1]
            k += 1
        peak = live
        while k < len(events) and events[k][0] <= end:
            live += events[k][1]
            peak = max(peak, live)
            k += 1
        phases[name] = PhaseMemory(peak, live)
    return phases
