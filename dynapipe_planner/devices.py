"""A heterogeneous cluster as a device graph: machines of (possibly different) GPU types, each
device's peak FLOPS and memory, and the bandwidth and latency between every pair of devices.

This is the input of the HexiScale planner (seed hexiscale.txt §4.1, Table 1: c_d, m_d,
alpha_{d,d'}, beta_{d,d'}). It lives next to `cluster.py` rather than inside it: `cluster.py`
describes the homogeneous TP x DP x PP layout of one job and its GPU catalogue, this module
describes hardware that no single symmetric layout fits, and reads it from YAML.

YAML shape (bandwidths in GB/s, latencies in microseconds, memory in GiB, FLOPS in TFLOPS;
`peak_tflops`, `hbm_bandwidth_gbs` and `memory_gib` override the GPU type's figures)::

    name: setting-1
    network: {bandwidth_gbs: 0.7, latency_us: 50}     # default between machines
    machines:
      - {name: a, gpu: RTX3090, count: 8, intra_bandwidth_gbs: 24}
      - {name: b, gpu: A800, count: 8, peak_tflops: 300, memory_gib: 80}
    links:                                            # optional per-pair overrides
      - {machines: [a, b], bandwidth_gbs: 5, latency_us: 20}
    bandwidth_matrix_gbs: [[0, 0.7], [0.7, 0]]        # optional: every pair, machine order

Validation names the offending item: the machine, the link or the matrix entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .cluster import GPU_PRESETS, GiB, GpuSpec, get_gpu
from .errors import PlanningError
from .input_files import check_input_file

GB = 1e9
_MACHINE_KEYS = {
    "name",
    "gpu",
    "count",
    "intra_bandwidth_gbs",
    "intra_latency_us",
    "peak_tflops",
    "hbm_bandwidth_gbs",
    "memory_gib",
    "memory_reserve_gib",
}
_TOP_KEYS = {"name", "network", "machines", "links", "bandwidth_matrix_gbs", "latency_matrix_us"}
DEFAULT_INTER_LATENCY_US = 50.0

# The cost model holds device-by-device matrices; a cluster past this is a typo.
MAX_CLUSTER_DEVICES = 16384


@dataclass(frozen=True)
class Machine:
    """`count` GPUs of one type that share a fast interconnect (NVLink or PCIe)."""

    name: str
    gpu: GpuSpec
    count: int
    first_device: int
    intra_bandwidth: float
    intra_latency_s: float
    memory_limit_bytes: int

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.count)


@dataclass(frozen=True)
class HeteroCluster:
    """Devices are numbered machine by machine; `bandwidth[d, d']` (bytes/s) and
    `latency[d, d']` (s) hold every pair, symmetric, with an infinite bandwidth and zero
    latency on the diagonal so a device never pays to talk to itself."""

    name: str
    machines: tuple[Machine, ...]
    bandwidth: np.ndarray
    latency: np.ndarray

    @cached_property
    def num_devices(self) -> int:
        return sum(m.count for m in self.machines)

    def machine_of(self, device: int) -> Machine:
        if not 0 <= device < self.num_devices:
            raise PlanningError(f"cluster {self.name!r} has no device {device}")
        return self.machines[int(self.device_machine[device])]

    @cached_property
    def device_machine(self) -> np.ndarray:
        """Machine index of every device."""
        return np.concatenate([np.full(m.count, i) for i, m in enumerate(self.machines)])

    def gpu(self, device: int) -> GpuSpec:
        return self.machine_of(device).gpu

    @cached_property
    def peak_flops(self) -> np.ndarray:
        return np.concatenate([np.full(m.count, m.gpu.peak_flops) for m in self.machines])

    @property
    def total_peak_flops(self) -> float:
        return float(sum(m.gpu.peak_flops * m.count for m in self.machines))

    def memory_limit(self, device: int) -> int:
        return self.machine_of(device).memory_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        """YAML/JSON form that `cluster_from_dict` reads back (every pair written out)."""
        n = len(self.machines)
        firsts = [m.first_device for m in self.machines]
        bw = [
            [0.0 if i == j else self.bandwidth[firsts[i], firsts[j]] / GB for j in range(n)]
            for i in range(n)
        ]
        lat = [
            [0.0 if i == j else self.latency[firsts[i], firsts[j]] * 1e6 for j in range(n)]
            for i in range(n)
        ]
        return {
            "name": self.name,
            "machines": [
                {
                    "name": m.name,
                    "gpu": m.gpu.name,
                    "count": m.count,
                    "intra_bandwidth_gbs": m.intra_bandwidth / GB,
                    "intra_latency_us": m.intra_latency_s * 1e6,
                    "peak_tflops": m.gpu.peak_flops / 1e12,
                    "hbm_bandwidth_gbs": m.gpu.hbm_bandwidth / GB,
                    "memory_gib": m.gpu.memory_bytes / GiB,
                    "memory_reserve_gib": (m.gpu.memory_bytes - m.memory_limit_bytes) / GiB,
                }
                for m in self.machines
            ],
            "bandwidth_matrix_gbs": bw,
            "latency_matrix_us": lat,
        }


def _number(value: Any, where: str, *, positive: bool = True) -> float:
    """A finite number, positive (bandwidths, FLOPS) or, with `positive=False`, non-negative
    (latencies: a link cannot answer before it is asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanningError(f"{where} must be a number, got {value!r}")
    if positive and not value > 0:
        raise PlanningError(f"{where} must be positive, got {value!r}")
    if not positive and not value >= 0:
        raise PlanningError(f"{where} must be non-negative, got {value!r}")
    if not np.isfinite(value):
        raise PlanningError(f"{where} must be finite, got {value!r}")
    return float(value)


def _machine(raw: Any, index: int, first_device: int) -> Machine:
    if not isinstance(raw, dict):
        raise PlanningError(f"machine #{index} must be a mapping, got {raw!r}")
    name = str(raw.get("name", f"machine{index}"))
    where = f"machine {name!r}"
    unknown = sorted(set(raw) - _MACHINE_KEYS)
    if unknown:
        raise PlanningError(f"{where}: unknown key(s) {unknown}; known: {sorted(_MACHINE_KEYS)}")
    if "gpu" not in raw:
        raise PlanningError(f"{where}: missing 'gpu' (one of {', '.join(GPU_PRESETS)})")
    try:
        gpu = get_gpu(str(raw["gpu"]))
    except PlanningError:
        raise PlanningError(
            f"{where}: unknown GPU type {raw['gpu']!r}; known: {', '.join(GPU_PRESETS)} "
            "(or give peak_tflops and memory_gib with a known type to override it)"
        ) from None
    count = raw.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlanningError(f"{where}: count must be a positive integer, got {count!r}")
    if count > MAX_CLUSTER_DEVICES:
        raise PlanningError(f"{where}: count {count} is past {MAX_CLUSTER_DEVICES} GPUs")
    if "peak_tflops" in raw:
        gpu = replace(gpu, peak_flops=_number(raw["peak_tflops"], f"{where}: peak_tflops") * 1e12)
    if "hbm_bandwidth_gbs" in raw:
        hbm = _number(raw["hbm_bandwidth_gbs"], f"{where}: hbm_bandwidth_gbs") * GB
        gpu = replace(gpu, hbm_bandwidth=hbm)
    if "memory_gib" in raw:
        mem = _number(raw["memory_gib"], f"{where}: memory_gib")
        gpu = replace(gpu, memory_bytes=int(mem * GiB))
    intra_bw = gpu.intra_node_bandwidth
    if "intra_bandwidth_gbs" in raw:
        intra_bw = _number(raw["intra_bandwidth_gbs"], f"{where}: intra_bandwidth_gbs") * GB
        gpu = replace(gpu, intra_node_bandwidth=intra_bw)
    intra_lat = gpu.link_latency_s
    if "intra_latency_us" in raw:
        intra_lat = _number(raw["intra_latency_us"], f"{where}: intra_latency_us", positive=False)
        intra_lat *= 1e-6
    if "memory_reserve_gib" in raw:
        reserve = int(
            _number(raw["memory_reserve_gib"], f"{where}: memory_reserve_gib", positive=False) * GiB
        )
    else:  # CUDA context, NCCL buffers, fragmentation: as ClusterSpec reserves
        reserve = max(2 * GiB, gpu.memory_bytes // 10)
    if gpu.memory_bytes - reserve <= 0:
        raise PlanningError(
            f"{where}: no usable memory ({gpu.memory_bytes / GiB:g} GiB minus a reserve of "
            f"{reserve / GiB:g} GiB)"
        )
    return Machine(name, gpu, count, first_device, intra_bw, intra_lat, gpu.memory_bytes - reserve)


def _matrix(raw: Any, names: list[str], what: str, *, positive: bool) -> np.ndarray:
    n = len(names)
    if not isinstance(raw, list) or len(raw) != n:
        raise PlanningError(f"{what} must be a {n}x{n} list of lists (one row per machine)")
    out = np.zeros((n, n))
    for i, row in enumerate(raw):
        if not isinstance(row, list) or len(row) != n:
            raise PlanningError(f"{what} row {i} (machine {names[i]!r}) must have {n} entries")
        for j, v in enumerate(row):
            if i != j:
                out[i, j] = _number(
                    v, f"{what}[{i}][{j}] ({names[i]!r} -> {names[j]!r})", positive=positive
                )
    for i in range(n):
        for j in range(i + 1, n):
            if not np.isclose(out[i, j], out[j, i]):
                raise PlanningError(
                    f"{what} is asymmetric: [{i}][{j}] ({names[i]!r} -> {names[j]!r}) = "
                    f"{out[i, j]:g} but [{j}][{i}] = {out[j, i]:g}; links are symmetric"
                )
    return out


def cluster_from_dict(data: Any, source: str = "cluster") -> HeteroCluster:
    """Validate a cluster description and build the device graph; errors name the item."""
    if not isinstance(data, dict):
        raise PlanningError(f"{source}: expected a mapping at the top level, got {type(data)}")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise PlanningError(f"{source}: unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    raw_machines = data.get("machines")
    if not isinstance(raw_machines, list) or not raw_machines:
        raise PlanningError(f"{source}: 'machines' must be a non-empty list")
    machines: list[Machine] = []
    for i, raw in enumerate(raw_machines):
        machines.append(_machine(raw, i, sum(m.count for m in machines)))
        if sum(m.count for m in machines) > MAX_CLUSTER_DEVICES:
            raise PlanningError(f"{source}: more than {MAX_CLUSTER_DEVICES} GPUs")
    names = [m.name for m in machines]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanningError(f"{source}: duplicate machine name(s) {dup}")
    network = data.get("network", {})
    if not isinstance(network, dict):
        raise PlanningError(f"{source}: 'network' must be a mapping")
    if len(machines) > 1 and "bandwidth_gbs" not in network and "bandwidth_matrix_gbs" not in data:
        raise PlanningError(
            f"{source}: network.bandwidth_gbs (default between machines) or "
            "bandwidth_matrix_gbs is required with more than one machine"
        )
    n = len(machines)
    bw = np.full((n, n), _number(network.get("bandwidth_gbs", 1.0), "network.bandwidth_gbs"))
    lat = np.full(
        (n, n),
        _number(
            network.get("latency_us", DEFAULT_INTER_LATENCY_US),
            "network.latency_us",
            positive=False,
        ),
    )
    if "bandwidth_matrix_gbs" in data:
        bw = _matrix(data["bandwidth_matrix_gbs"], names, "bandwidth_matrix_gbs", positive=True)
    if "latency_matrix_us" in data:
        lat = _matrix(data["latency_matrix_us"], names, "latency_matrix_us", positive=False)
    links = data.get("links", [])
    if not isinstance(links, list):
        raise PlanningError(f"{source}: 'links' must be a list")
    for k, link in enumerate(links):
        where = f"link #{k}"
        if not isinstance(link, dict) or "machines" not in link:
            raise PlanningError(f"{where} must be a mapping with 'machines: [a, b]'")
        pair = link["machines"]
        if not isinstance(pair, list) or len(pair) != 2:
            raise PlanningError(f"{where}: 'machines' must name two machines, got {pair!r}")
        for name in pair:
            if name not in names:
                raise PlanningError(f"{where}: unknown machine {name!r}; known: {names}")
        i, j = names.index(pair[0]), names.index(pair[1])
        if i == j:
            raise PlanningError(f"{where}: links a machine {pair[0]!r} to itself")
        extra = sorted(set(link) - {"machines", "bandwidth_gbs", "latency_us"})
        if extra:
            raise PlanningError(f"{where}: unknown key(s) {extra}")
        if "bandwidth_gbs" in link:
            bw[i, j] = bw[j, i] = _number(link["bandwidth_gbs"], f"{where}: bandwidth_gbs")
        if "latency_us" in link:
            lat[i, j] = lat[j, i] = _number(
                link["latency_us"], f"{where}: latency_us", positive=False
            )
    return _device_graph(str(data.get("name", source)), machines, bw * GB, lat * 1e-6)


def _device_graph(
    name: str, machines: list[Machine], machine_bw: np.ndarray, machine_lat: np.ndarray
) -> HeteroCluster:
    """Expand machine-level links to every device pair (intra-machine links on the diagonal)."""
    of = np.concatenate([np.full(m.count, i) for i, m in enumerate(machines)])
    bw = machine_bw[np.ix_(of, of)].copy()
    lat = machine_lat[np.ix_(of, of)].copy()
    for i, m in enumerate(machines):
        same = np.ix_(of == i, of == i)
        bw[same] = m.intra_bandwidth
        lat[same] = m.intra_latency_s
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(lat, 0.0)
    return HeteroCluster(name, tuple(machines), bw, lat)


def load_cluster(path: str | Path) -> HeteroCluster:
    """Read a cluster YAML (or JSON, a subset of YAML) file."""
    import yaml

    path = Path(path)
    check_input_file(path, "cluster file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PlanningError(f"cluster file {path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise PlanningError(f"cluster file {path}: not UTF-8 text ({e.reason})") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = " ".join(str(e).split())  # PyYAML quotes the line under a caret: one line here
        raise PlanningError(f"cluster file {path}: not valid YAML ({where})") from e
    except RecursionError:
        raise PlanningError(f"cluster file {path}: nested too deeply") from None
    return cluster_from_dict(data, str(path))


def homogeneous_cluster(
    gpu: str | GpuSpec,
    num_devices: int,
    *,
    gpus_per_machine: int = 8,
    inter_bandwidth_gbs: float = 25.0,
    inter_latency_us: float = DEFAULT_INTER_LATENCY_US,
    name: str = "",
) -> HeteroCluster:
    """`num_devices` GPUs of one type in machines of `gpus_per_machine` (the last may be
    smaller): the reference cluster HexiScale compares against (§5.1)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    counts = [gpus_per_machine] * (num_devices // gpus_per_machine)
    if num_devices % gpus_per_machine:
        counts.append(num_devices % gpus_per_machine)
    return cluster_from_dict(
        {
            "name": name or f"{num_devices}x{spec.name}",
            "network": {"bandwidth_gbs": inter_bandwidth_gbs, "latency_us": inter_latency_us},
            "machines": [
                {
                    "name": f"m{i}",
                    "gpu": spec.name,
                    "count": c,
                    "peak_tflops": spec.peak_flops / 1e12,
                }
                for i, c in enumerate(counts)
            ],
        }
    )


def emulated_cluster(
    gpu: GpuSpec, slowdowns: Sequence[float], memory_limit_bytes: int | None = None
) -> HeteroCluster:
    """The cluster that `--device-speed` emulates on one host: device r is `gpu` with its
    compute (peak FLOPS and memory bandwidth) `slowdowns[r]` times slower, consecutive devices of
    one factor forming a machine, every link `gpu`'s intra-node one; each factor its own GPU
    type (`"<gpu>/<f>x"`, the fastest keeping `gpu`'s name), so typed schemes
    (`strategy.mixed`) tell them apart. `memory_limit_bytes` replaces each device's usable
    memory (the planner's `--dynapipe-memory-limit-gib`)."""
    if not slowdowns:
        raise PlanningError("an emulated cluster needs at least one device")
    bad = [f"{k}:{f}" for k, f in enumerate(slowdowns) if not f >= 1.0]
    if bad:
        raise PlanningError(f"slowdown factors must be >= 1 (1: full speed), got {bad}")
    runs: list[tuple[float, int]] = []
    for factor in slowdowns:
        if runs and runs[-1][0] == factor:
            runs[-1] = (factor, runs[-1][1] + 1)
        else:
            runs.append((factor, 1))
    cluster = cluster_from_dict(
        {
            "name": "emulated " + ",".join(f"{f:g}" for f in slowdowns),
            "network": {
                "bandwidth_gbs": gpu.intra_node_bandwidth / GB,
                "latency_us": gpu.link_latency_s * 1e6,
            },
            "machines": [
                {"name": f"ranks{k}", "gpu": gpu.name, "count": count}
                for k, (_, count) in enumerate(runs)
            ],
        }
    )
    fastest = min(slowdowns)
    machines = []
    for machine, (factor, _) in zip(cluster.machines, runs, strict=True):
        slower = replace(
            machine.gpu,
            name=gpu.name if factor == fastest else f"{gpu.name}/{factor:g}x",
            peak_flops=machine.gpu.peak_flops / factor,
            hbm_bandwidth=machine.gpu.hbm_bandwidth / factor,
        )
        limit = machine.memory_limit_bytes if memory_limit_bytes is None else memory_limit_bytes
        machines.append(replace(machine, gpu=slower, memory_limit_bytes=limit))
    return replace(cluster, machines=tuple(machines))
