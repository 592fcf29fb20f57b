"""The numbers the Galvatron-BMW search reads (seed `galvatron_bmw.txt` §V, App. C).

`CostInputs` is deliberately small and explicit: per layer type, what one sample costs at the
job's sequence length (forward compute per TP degree, stored and transient activation bytes,
the layer input's bytes, TP all-reduce bytes) and the layer's weight bytes; per communication
group, its bandwidth; and the overlap slowdown. §V's estimator needs nothing else, and the
same numbers can be written into another engine's profile format so that two searches see the
same data. `analytic_cost_inputs` fills it from the analytic cost model and the GPU's
datasheet bandwidths; a profiler or a test can construct it directly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..cluster import ClusterSpec, GpuSpec
from ..cost.analytic import AnalyticCostModel
from ..errors import PlanningError
from ..model_spec import ModelSpec
from .space import LayerStrategy, group_crosses_nodes, pipeline_degrees, strategy_space

# bf16 weights (2) + fp32 gradients (4) + fp32 Adam master, m, v (12) per 2 bytes of weights.
MIXED_PRECISION_ADAM_STATE_FACTOR = 9.0
_PER_TP_FIELDS = (
    "forward_s_per_sample",
    "activation_bytes_per_sample",
    "workspace_bytes_per_sample",
    "backward_s_per_sample",
    "forward_s_per_microbatch",
    "backward_s_per_microbatch",
)

# int-keyed dicts: by SDP group size, by TP degree for `cpu_busy_fraction` and the output
# layer's times, by samples for `cpu_contention_factor`
_BY_GROUP_SIZE = (
    "sdp_forward_s",
    "sdp_backward_s",
    "sdp_cpu_busy_fraction",
    "sdp_transient_bytes",
    "cpu_busy_fraction",
    "cpu_contention_factor",
    "output_forward_s_per_sample_by_tp",
    "output_forward_s_per_microbatch_by_tp",
)
# fields whose JSON form `to_dict` / `from_dict` convert (the rest are copied as they are)
_CONVERTED = ("layer_types", "layer_kinds", "allreduce_bandwidth", "p2p_bandwidth", *_BY_GROUP_SIZE)


@dataclass(frozen=True)
class LayerTypeCosts:
    """One kind of transformer layer (e.g. 'decoder') at the job's sequence length.

    Per-sample numbers scale linearly with the samples a GPU processes (§V: "the product of the
    batch size and the per-sample computation time"); keys of the per-TP dicts are TP degrees,
    and a TP degree missing from them cannot split this layer (heads or FFN not divisible).
    The backward pass takes twice the forward (§V) unless `backward_s_per_sample` holds a
    measured time for the TP degree (a profiled cost table does). A profiled table also gives
    a time per micro-batch, whatever its size (`forward_s_per_microbatch`,
    `backward_s_per_microbatch`: the intercept of the measured times over the micro-batch
    sizes; on a CPU one sample's forward took 1.5-3.9x the per-sample time of eight); missing
    degrees are 0 (§V's model).
    """

    name: str
    forward_s_per_sample: dict[int, float]  # TP degree -> forward compute, no communication
    activation_bytes_per_sample: dict[int, float]  # TP -> forward activations kept for backward
    workspace_bytes_per_sample: dict[int, float]  # TP -> transient bytes of its backward pass
    param_bytes: float  # weight bytes of one layer (bf16; a profiled table: its dtype), unsharded
    boundary_bytes_per_sample: float  # the layer's input: kept under CKPT, sent between stages
    tp_allreduce_bytes_per_sample: float  # bytes TP all-reduces per sample in one forward pass
    backward_s_per_sample: dict[int, float] = field(default_factory=dict)  # TP -> measured
    forward_s_per_microbatch: dict[int, float] = field(default_factory=dict)  # TP -> measured
    backward_s_per_microbatch: dict[int, float] = field(default_factory=dict)  # TP -> measured

    def backward_s(self, tp: int) -> float:
        """Backward compute per sample at TP `tp`: measured, else twice the forward (§V)."""
        return self.backward_s_per_sample.get(tp, 2.0 * self.forward_s_per_sample[tp])


@dataclass(frozen=True)
class CostInputs:
    """Everything the estimator prices a layer strategy with; times in s, sizes in bytes.

    `allreduce_bandwidth[(size, stride)]` is the bus bandwidth (bytes/s per GPU, ring
    all-reduce of V bytes takes 2 (size-1)/size V / bw) of a group of `size` GPUs whose
    members are `stride` GPU ids apart (stride 1: consecutive). `p2p_bandwidth[pp]` is the
    bandwidth between neighbouring stages of a `pp`-stage pipeline.
    """

    layer_types: tuple[LayerTypeCosts, ...]
    layer_kinds: tuple[int, ...]  # index into layer_types, one entry per layer, pipeline order
    allreduce_bandwidth: dict[tuple[int, int], float]
    p2p_bandwidth: dict[int, float]
    overlap_slowdown: float = 1.3
    model_state_factor: float = MIXED_PRECISION_ADAM_STATE_FACTOR
    link_latency_s: float = 10e-6
    embedding_param_bytes: float = 0.0  # first stage; states sharded over the stage's GPUs
    output_param_bytes: float = 0.0  # last stage (untied output layer)
    output_forward_s_per_sample: float = 0.0
    output_forward_s_per_microbatch: float = 0.0  # profiled: see LayerTypeCosts
    # the output layer measured at a TP degree (vocabulary-parallel, its all-reduces inside),
    # per sample on the rank and per micro-batch; a degree missing: the two above, split over
    # the stage's GPUs
    output_forward_s_per_sample_by_tp: dict[int, float] = field(default_factory=dict)
    output_forward_s_per_microbatch_by_tp: dict[int, float] = field(default_factory=dict)
    # Measured time FSDP2 adds to an SDP layer (TP 1) sharded over a group of this many GPUs,
    # per micro-batch: its forward (all-gather) and its backward (all-gather, reduce-scatter,
    # their copies and hooks); where a size is missing, §V's bytes over the bandwidth.
    sdp_forward_s: dict[int, float] = field(default_factory=dict)
    sdp_backward_s: dict[int, float] = field(default_factory=dict)
    # FSDP2's measured peak above an SDP layer's (TP 1) sharded state during its forward and
    # backward, by SDP group size; where missing, §V's gathered weights
    sdp_transient_bytes: dict[int, float] = field(default_factory=dict)
    # What one micro-batch costs a stage's rank beyond its layers (profiled, TP 1: the batch,
    # the embedding lookup, the model's and loss's plumbing).
    runtime_s_per_microbatch: float = 0.0
    # Ranks on CPU cores (profiled tables of a CPU): the cores the job's ranks share (0: each
    # rank has a device of its own, as on GPUs) and, per TP degree, the share of a layer's
    # measured wall time its rank's process spent on a core (`estimator.shared_host_time`).
    host_cores: int = 0
    cpu_busy_fraction: dict[int, float] = field(default_factory=dict)
    # by SDP group size: the share of the time FSDP2 adds (`sdp_forward_s` + `sdp_backward_s`)
    # that the rank is on a core
    sdp_cpu_busy_fraction: dict[int, float] = field(default_factory=dict)
    # by samples a rank holds: how much more CPU its passes take where the job's ranks
    # outnumber the cores, for strategies whose profiles gave each process a core (TP and SDP
    # degrees up to `host_cores`); interpolated between sizes, 1 where empty
    cpu_contention_factor: dict[int, float] = field(default_factory=dict)
    output_activation_bytes_per_sample: float = 0.0
    seq_length: int = 0
    description: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            raise PlanningError("cost inputs: no layers")
        for i, k in enumerate(self.layer_kinds):
            if not 0 <= k < len(self.layer_types):
                raise PlanningError(f"cost inputs: layer {i} has unknown layer type {k}")
        if self.overlap_slowdown < 1.0:
            raise PlanningError(
                f"cost inputs: overlap_slowdown must be >= 1, got {self.overlap_slowdown}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def to_dict(self) -> dict:
        """JSON-ready form (dict keys become strings: TP degrees, "size,stride", PP degrees)."""
        return {
            "layer_types": [
                {
                    **dataclasses.asdict(t),
                    **{k: {str(tp): v for tp, v in getattr(t, k).items()} for k in _PER_TP_FIELDS},
                }
                for t in self.layer_types
            ],
            "layer_kinds": list(self.layer_kinds),
            "allreduce_bandwidth": {
                f"{a},{b}": v for (a, b), v in self.allreduce_bandwidth.items()
            },
            "p2p_bandwidth": {str(k): v for k, v in self.p2p_bandwidth.items()},
            **{k: {str(n): v for n, v in getattr(self, k).items()} for k in _BY_GROUP_SIZE},
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in _CONVERTED
            },
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostInputs:
        """Inverse of `to_dict`."""
        try:
            types = tuple(
                LayerTypeCosts(
                    **{
                        **t,
                        **{
                            k: {int(tp): v for tp, v in t[k].items()}
                            for k in _PER_TP_FIELDS
                            if k in t  # the measured ones are optional
                        },
                    }
                )
                for t in data["layer_types"]
            )
            rest = {k: v for k, v in data.items() if k not in _CONVERTED}
            return cls(
                layer_types=types,
                layer_kinds=tuple(data["layer_kinds"]),
                allreduce_bandwidth={
                    tuple(int(x) for x in k.split(",")): v
                    for k, v in data["allreduce_bandwidth"].items()
                },
                p2p_bandwidth={int(k): v for k, v in data["p2p_bandwidth"].items()},
                **{k: {int(n): v for n, v in data.get(k, {}).items()} for k in _BY_GROUP_SIZE},
                **rest,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanningError(f"cost inputs: malformed description ({e})") from e

    def bandwidth(self, size: int, stride: int) -> float:
        try:
            return self.allreduce_bandwidth[(size, stride)]
        except KeyError:
            raise PlanningError(
                f"cost inputs: no all-reduce bandwidth for a group of {size} GPUs at stride "
                f"{stride}; known: {sorted(self.allreduce_bandwidth)}"
            ) from None

    def supports(self, strategy: LayerStrategy) -> bool:
        """Whether every layer type can be split `strategy.tp` ways."""
        return all(strategy.tp in t.forward_s_per_sample for t in self.layer_types)


def topology_bandwidths(
    gpu: GpuSpec, num_gpus: int, gpus_per_node: int
) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """Bandwidth of every (group size, stride) the strategy space uses and of PP neighbours:
    NVLink/PCIe when a group stays inside a node, the network when it crosses one."""
    if gpus_per_node < 1:
        raise PlanningError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    allreduce: dict[tuple[int, int], float] = {}
    for pp, strategies in strategy_space(num_gpus, prune=False).items():
        for s in strategies:
            for paradigm in s.order:
                key = (s.degree(paradigm), s.stride(paradigm))
                crosses = any(
                    group_crosses_nodes(s, paradigm, stage, gpus_per_node) for stage in range(pp)
                )
                bw = gpu.inter_node_bandwidth if crosses else gpu.intra_node_bandwidth
                allreduce[key] = min(bw, allreduce.get(key, bw))
    p2p = {}
    for pp in pipeline_degrees(num_gpus):
        n = num_gpus // pp
        crosses = any(
            (s * n + n - 1) // gpus_per_node != ((s + 1) * n) // gpus_per_node
            for s in range(pp - 1)
        )
        p2p[pp] = gpu.inter_node_bandwidth if crosses else gpu.intra_node_bandwidth
    return allreduce, p2p


def analytic_cost_inputs(
    model: ModelSpec,
    gpu: GpuSpec,
    num_gpus: int,
    *,
    gpus_per_node: int = 8,
    seq_length: int = 1024,
    tgt_seq_length: int | None = None,
    overlap_slowdown: float = 1.3,
    flash_attention: bool = False,
    reference_tokens: int = 8192,
) -> CostInputs:
    """`CostInputs` of `model` on `num_gpus` GPUs of type `gpu` from `AnalyticCostModel`.

    The analytic model's kernel efficiency grows with the micro-batch, so per-sample numbers
    are taken at a reference micro-batch of about `reference_tokens` tokens: the §V linear
    model then holds around the micro-batch sizes a search ends up with.
    """
    tgt = seq_length if tgt_seq_length is None else tgt_seq_length
    ref_b = max(1, math.ceil(reference_tokens / seq_length))
    kinds = list(dict.fromkeys(model.layer_kinds()))
    fwd: dict[str, dict[int, float]] = {k: {} for k in kinds}
    act: dict[str, dict[int, float]] = {k: {} for k in kinds}
    work: dict[str, dict[int, float]] = {k: {} for k in kinds}
    output_fwd = output_act = 0.0
    for tp in (d for d in range(1, num_gpus + 1) if num_gpus % d == 0):
        try:
            cm = AnalyticCostModel(
                model,
                ClusterSpec(gpu, tp=tp, gpus_per_node=max(gpus_per_node, tp)),
                flash_attention=flash_attention,
            )
        except PlanningError:
            continue  # the model cannot be split this many ways
        for kind in kinds:
            f, _, stored, transient = cm._layer(kind, float(ref_b), float(seq_length), tgt, "none")
            sq = tgt if (model.is_encoder_decoder and kind == "decoder") else seq_length
            count = 3 if (model.is_encoder_decoder and kind == "decoder") else 2
            comm = cm._allreduce_time(float(ref_b * sq), count)
            fwd[kind][tp] = float(f - comm) / ref_b
            act[kind][tp] = float(stored) / ref_b
            work[kind][tp] = float(transient) / ref_b
        if tp == 1:
            f, _, stored, _ = cm._output_layer(float(ref_b), float(seq_length), float(tgt))
            output_fwd, output_act = float(f) / ref_b, float(stored) / ref_b
    types = []
    for kind in kinds:
        sq = tgt if (model.is_encoder_decoder and kind == "decoder") else seq_length
        count = 3 if (model.is_encoder_decoder and kind == "decoder") else 2
        types.append(
            LayerTypeCosts(
                name=kind,
                forward_s_per_sample=fwd[kind],
                activation_bytes_per_sample=act[kind],
                workspace_bytes_per_sample=work[kind],
                param_bytes=2.0 * model.layer_params(kind),
                boundary_bytes_per_sample=2.0 * sq * model.hidden_size,
                tp_allreduce_bytes_per_sample=2.0 * count * sq * model.hidden_size,
            )
        )
    allreduce, p2p = topology_bandwidths(gpu, num_gpus, gpus_per_node)
    index = {k: i for i, k in enumerate(kinds)}
    return CostInputs(
        layer_types=tuple(types),
        layer_kinds=tuple(index[k] for k in model.layer_kinds()),
        allreduce_bandwidth=allreduce,
        p2p_bandwidth=p2p,
        overlap_slowdown=overlap_slowdown,
        link_latency_s=gpu.link_latency_s,
        embedding_param_bytes=2.0 * model.embedding_params(),
        output_param_bytes=2.0 * model.output_params(),
        output_forward_s_per_sample=output_fwd,
        output_activation_bytes_per_sample=output_act,
        seq_length=seq_length,
        description={
            "kind": "analytic",
            "model": model.name,
            "gpu": gpu.name,
            "num_gpus": num_gpus,
            "gpus_per_node": gpus_per_node,
            "seq_length": seq_length,
            "tgt_seq_length": tgt,
        },
    )
