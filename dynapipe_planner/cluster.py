"""GPU types and the homogeneous cluster layout (TP x DP x PP) that a plan targets.

GPU numbers are public datasheet values: dense bf16 tensor-core peak (FP32 accumulate), memory,
HBM bandwidth, per-direction NVLink/PCIe bandwidth, and a typical per-GPU network bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanningError

GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type. Bandwidths in bytes/s, FLOPS per second, memory in bytes."""

    name: str
    peak_flops: float
    memory_bytes: int
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    link_latency_s: float = 10e-6
    kernel_launch_s: float = 4e-6


def _gpu(
    name: str, tflops: float, mem_gib: int, hbm_gbs: float, intra_gbs: float, inter_gbs: float
):
    return GpuSpec(
        name, tflops * 1e12, mem_gib * GiB, hbm_gbs * 1e9, intra_gbs * 1e9, inter_gbs * 1e9
    )


GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # NVLink figures are per direction (half the datasheet's bidirectional total).
        _gpu("A100-40GB", 312, 40, 1555, 300, 25),
        _gpu("A100-80GB", 312, 80, 2039, 300, 25),
        _gpu("A800", 312, 80, 2039, 200, 25),
        # The PCIe card: same chip, GPUs of a machine talk over PCIe 4.0 x16 (HexiScale §5.1).
        _gpu("A800-PCIe", 312, 80, 1935, 32, 25),
        _gpu("H100", 989, 80, 3350, 450, 50),
        # Same compute as the H100 SXM; 141 GB of HBM3e (140 GiB visible) at 4.8 TB/s.
        _gpu("H200", 989, 140, 4800, 450, 50),
        # GeForce: bf16 with FP32 accumulate runs at half the FP16-accumulate rate; PCIe 4.0 x16.
        _gpu("RTX3080Ti", 68.2, 12, 912, 32, 12.5),
        # Titan RTX (Turing): FP16 tensor cores with FP32 accumulate at full rate, no bf16 (we
        # price it as 16-bit); PCIe 3.0 x16 inside a machine, 100 Gb InfiniBand between
        # (Galvatron-BMW's low-performance cluster, seed galvatron_bmw.txt §VII-A, §VII-D).
        _gpu("RTX-TITAN", 130, 24, 672, 16, 12.5),
        _gpu("RTX3090", 71, 24, 936, 32, 12.5),
        _gpu("RTX4090", 165.2, 24, 1008, 32, 12.5),
    )
}


# The GPU every command plans for unless told (`--gpu`, `pretrain_gpt.py --dynapipe-gpu`).
DEFAULT_GPU = "A100-80GB"


def default_memory_limit_bytes(gpu: GpuSpec) -> int:
    """What one GPU may use unless told: its memory minus a reserve for the CUDA context, NCCL
    buffers and allocator fragmentation (`--memory-limit-gib 0`)."""
    return gpu.memory_bytes - max(2 * GiB, gpu.memory_bytes // 10)


def get_gpu(name: str) -> GpuSpec:
    key = name.upper().replace("_", "-").replace(" ", "")
    for preset_name, spec in GPU_PRESETS.items():
        if (
            preset_name.upper().replace(" ", "") == key
            or preset_name.upper().replace("-", "") == key
        ):
            return spec
    raise PlanningError(f"unknown GPU type {name!r}; known: {', '.join(GPU_PRESETS)}")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous job: `num_replicas` pipelines of `num_stages` stages, each stage `tp` GPUs.

    Ranks follow Megatron's order (tensor-parallel fastest, then data-parallel, then pipeline),
    which decides whether two adjacent stages talk over NVLink or the network.
    `memory_limit_bytes` is what one GPU may use; by default the card's memory minus a reserve
    for the CUDA context, NCCL buffers and allocator fragmentation.
    """

    gpu: GpuSpec
    num_stages: int = 1
    num_replicas: int = 1
    tp: int = 1
    gpus_per_node: int = 8
    memory_limit_bytes: int = 0

    def __post_init__(self) -> None:
        for f in ("num_stages", "num_replicas", "tp", "gpus_per_node"):
            if getattr(self, f) < 1:
                raise PlanningError(f"cluster: {f} must be >= 1, got {getattr(self, f)}")
        if self.memory_limit_bytes == 0:
            object.__setattr__(self, "memory_limit_bytes", default_memory_limit_bytes(self.gpu))
        if self.memory_limit_bytes < 0:
            raise PlanningError("cluster: memory_limit_bytes must be positive")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas * self.tp

    def rank(self, replica: int, stage: int, tp_rank: int = 0) -> int:
        return tp_rank + self.tp * (replica + self.num_replicas * stage)

    def p2p_bandwidth(self, stage: int) -> float:
        """Bandwidth from `stage` to `stage + 1` (the slowest over replicas)."""
        crosses_node = any(
            self.rank(r, stage) // self.gpus_per_node
            != self.rank(r, stage + 1) // self.gpus_per_node
            for r in range(self.num_replicas)
        )
        return self.gpu.inter_node_bandwidth if crosses_node else self.gpu.intra_node_bandwidth

    @property
    def tp_bandwidth(self) -> float:
        """Tensor-parallel groups sit inside a node when they fit, else they cross the network."""
        if self.tp <= self.gpus_per_node:
            return self.gpu.intra_node_bandwidth
        return self.gpu.inter_node_bandwidth


def cluster_to_dict(cluster: ClusterSpec) -> dict:
    return {
        "gpu": cluster.gpu.name,
        "num_stages": cluster.num_stages,
        "num_replicas": cluster.num_replicas,
        "tp": cluster.tp,
        "gpus_per_node": cluster.gpus_per_node,
        "memory_limit_bytes": cluster.memory_limit_bytes,
    }


def cluster_from_dict(data: dict) -> ClusterSpec:
    try:
        return ClusterSpec(get_gpu(data["gpu"]), **{k: v for k, v in data.items() if k != "gpu"})
    except (KeyError, TypeError) as e:
        raise PlanningError(f"cluster description {data!r} is malformed ({e})") from e
