"""HexiScale's cost model (seed hexiscale.txt App. A) on a heterogeneous device graph.

Per layer and micro-batch: TP communication (Eq. 3), DP communication (Eq. 4), the pipeline hop
between stages (Eq. 5) and compute. Compute does not use Eq. 6's flat FLOPs / peak: it is the
analytic model's forward + backward time of one layer (`cost/analytic.py`, with its
small-GEMM efficiency and recomputation) on the stage's GPU type at its TP degree, so the
heterogeneous planner and the homogeneous planners price a layer the same way. Communication
terms use the pairwise latency alpha and bandwidth beta of `devices.HeteroCluster`.

Per plan: stage time (Eq. 8), pipeline time with micro-batches (Eq. 9, with the maximum taken
over every stage, as 1F1B's steady state is set by the slowest one), DP sync bounded by the
slowest stage (Eq. 7), iteration time = slowest pipeline + DP sync (Eq. 10), and memory per
device (Eq. 11 generalised: weights, gradients and optimiser states of the stage's layers split
over TP, optimiser states optionally sharded over the pipelines as §3.2's FSDP hooks do, plus
the activations the recomputation mode keeps for each in-flight micro-batch of 1F1B).

One departure from App. A, stated: transfers that leave a machine at the same time share its
network link (pipeline hops of every pipeline in the 1F1B steady state; DP groups that span
machines during the sync). Eq. 5 and Eq. 4 price each device pair as if it had the machines'
link to itself, which would let eight pipelines crossing one Ethernet link each see all of it.
`HeteroCostModel(..., share_links=False)` prices App. A as written (every pair has the whole
link), for comparison; `benchmarks/hexiscale_breakdown.py` and the sensitivity table of
`benchmarks/hexiscale_settings.py` show what the choice moves. Which is right for a real
cluster depends on whether §5.1's "inter-machine connection is about 0.7 GB/s" is a machine's
NIC (shared: ours) or what each GPU pair gets (App. A); a cloud VM's bandwidth cap is
usually per machine, hence the default.

Memory (Eq. 11) also departs, stated: Eq. 11 counts 48 H^2 B_type / |d| per layer, i.e. four
bf16 copies of the 12 H^2 parameters; mixed-precision Adam as Megatron runs it keeps bf16
weights, fp32 gradients and fp32 master weights and moments (2 + 4 + 12 bytes), the last 12
sharded over the pipelines here (9 bytes a parameter at D_dp = 4 against Eq. 11's 8). And Eq. 11
keeps one micro-batch's layer input (B_mb S H B_type) where 1F1B keeps up to depth - j of them
at stage j. Together these are why the paper's Table 2 plan (18 Llama 30B layers on a TP=4
stage of 24 GB 4090s, first of four stages) needs 25.1 GiB here, of 21.6 GiB usable.

Recomputation: App. A assumes full recomputation on every stage (the default here). With
`TrainingJob(recompute="auto")` each stage runs the fastest mode (none, selective, full) whose
memory holds its layers, as Galvatron-BMW (seed galvatron_bmw.txt §III-B) chooses checkpointing
per layer: 1F1B's later stages keep fewer micro-batches in flight and often need none. The plan
lists the modes (`stats["recompute"]`) and the runtime runs each stage in its own.

`estimate` is the closed form the search ranks plans by; `hetero.simulate` replays the same
per-stage times event by event. Both read the stage times from `plan_stage_costs` below.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from ..cluster import ClusterSpec, GpuSpec
from ..cost.analytic import RECOMPUTE_CHOICES, RECOMPUTE_MODES, AnalyticCostModel
from ..cost.table import DTYPE_BYTES
from ..devices import HeteroCluster
from ..errors import PlanningError
from ..model_spec import ModelSpec
from .layout import HeteroPipeline, HeteroPlan, HeteroStage

# TP all-reduces per layer and micro-batch, each counted as two ring phases (App. A Eq. 3: 12
# with recomputation: 2 forward, 2 backward, 2 in the recomputed forward).
_TP_STEPS = {"none": 8, "selective": 8, "full": 12}


@dataclass(frozen=True)
class TrainingJob:
    """What one iteration trains: `global_batch` samples of `seqlen` tokens in micro-batches of
    `micro_batch_size` samples."""

    model: ModelSpec
    seqlen: int = 4096
    global_batch: int = 128
    micro_batch_size: int = 1
    recompute: str = "full"
    shard_optimizer: bool = True
    flash_attention: bool = True
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_CHOICES:
            raise PlanningError(
                f"recompute must be one of {RECOMPUTE_CHOICES}, got {self.recompute!r}"
            )
        for f in ("seqlen", "global_batch", "micro_batch_size"):
            if getattr(self, f) < 1:
                raise PlanningError(f"job: {f} must be >= 1, got {getattr(self, f)}")
        if self.global_batch % self.micro_batch_size:
            raise PlanningError(
                f"job: global_batch {self.global_batch} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size}"
            )

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // self.micro_batch_size

    def layer_flops_per_token(self) -> int:
        """Forward FLOPs of one token through one transformer layer: its GEMMs (two per weight
        entry, `ModelSpec.attention_weights` and `mlp_weights`) and the attention core over
        the job's sequence (Q K^T and the product with V, 2 s n d each)."""
        m = self.model
        return 2 * (m.attention_weights() + m.mlp_weights()) + 4 * self.seqlen * m.attention_width

    def flops_per_sample(self) -> float:
        """Model FLOPs of one sample, forward and backward, without recomputation (for MFU)."""
        m, s = self.model, self.seqlen
        per_token_layer = self.layer_flops_per_token()
        return 3.0 * s * (m.num_layers * per_token_layer + 2 * m.hidden_size * m.vocab_size)


@dataclass(frozen=True)
class StageOption:
    """A stage under one recomputation mode, per micro-batch: seconds per transformer layer,
    seconds that do not depend on its layer count (embedding / output layer, and the sends once
    layer assignment adds them), and the most layers its memory holds."""

    mode: str
    per_layer_s: float
    fixed_s: float
    capacity: int


@dataclass(frozen=True)
class StageCost:
    """One stage of one pipeline, per micro-batch: forward and backward compute (TP
    communication included), the sends this stage makes (activations to the next stage, half
    of Eq. 5's hop; gradients to the previous stage, half of that link's hop), memory, and the
    recomputation mode it runs."""

    forward_s: float
    backward_s: float
    send_forward_s: float
    send_backward_s: float
    memory_bytes: float
    memory_limit_bytes: float
    recompute: str

    @property
    def busy_s(self) -> float:
        """Eq. 8 plus its sends: what bounds the 1F1B steady state at this stage. Summed over
        the stages this is Eq. 9's sum of Stage + Comm-PP-Hop."""
        return self.forward_s + self.backward_s + self.send_forward_s + self.send_backward_s


@dataclass
class Estimate:
    """Closed-form cost of a plan (App. A Eq. 7-11)."""

    iteration_s: float
    pipeline_s: list[float]
    dp_sync_s: float
    stages: list[list[StageCost]]
    mfu: float
    fits: bool
    oom: list[str] = field(default_factory=list)

    def as_stats(self) -> dict:
        return {
            "iteration_s": self.iteration_s,
            "pipeline_s": self.pipeline_s,
            "dp_sync_s": self.dp_sync_s,
            "mfu": self.mfu,
            "fits_memory": self.fits,
            "peak_memory_bytes": [[s.memory_bytes for s in p] for p in self.stages],
            "recompute": [[s.recompute for s in p] for p in self.stages],
        }


def pipeline_time(busy: list[float], micro_batches: int) -> float:
    """App. A Eq. 9 over the stages' busy times per micro-batch: one micro-batch through every
    stage, then `m - 1` more at the pace of the slowest stage."""
    return sum(busy) + (micro_batches - 1) * max(busy)


def fastest_holding(options: tuple[StageOption, ...], layers: int) -> StageOption:
    """The fastest option whose memory holds `layers`; when none does, the one holding most
    (so that an over-full stage is reported under its most frugal mode)."""
    fits = [o for o in options if o.capacity >= layers]
    if not fits:
        return max(options, key=lambda o: o.capacity)
    return min(fits, key=lambda o: o.fixed_s + layers * o.per_layer_s)


class HeteroCostModel:
    """Prices stages, pipelines and plans of `job` on `cluster`. Per-(GPU, TP) analytic
    models and per-device-set communication terms are cached: the search prices the same
    groups many times."""

    def __init__(
        self, cluster: HeteroCluster, job: TrainingJob, *, share_links: bool = True
    ) -> None:
        self.cluster = cluster
        self.job = job
        # False: App. A literally (Eq. 4, 5), every device pair has the machines' link to itself.
        self.share_links = share_links
        self._analytic: dict[tuple, AnalyticCostModel] = {}
        self._layer: dict[tuple, tuple[float, float, float, float]] = {}
        self._tp: dict[tuple, float] = {}
        self._hop: dict[tuple, float] = {}
        self._memo: dict[tuple, Any] = {}

    # ---- building blocks ------------------------------------------------------------------
    @cached_property
    def recompute_modes(self) -> tuple[str, ...]:
        """Modes a stage may run, fastest first: the job's one, or all of them for "auto"."""
        mode = self.job.recompute
        return RECOMPUTE_MODES if mode == "auto" else (mode,)

    def valid_tp(self, tp: int) -> bool:
        return self.job.model.supports_tp(tp)

    def _gpu(self, devices: tuple[int, ...]) -> GpuSpec:
        """TP runs at the pace of its slowest member (App. A assumes one type per stage)."""
        machines = self.cluster.machines
        kinds = {int(self.cluster.device_machine[d]) for d in devices}
        return min((machines[i].gpu for i in kinds), key=lambda g: g.peak_flops)

    def _model(self, gpu: GpuSpec, tp: int) -> AnalyticCostModel:
        key = (gpu, tp)
        if key not in self._analytic:
            self.job.model.check_tp(tp)
            # Compute only: TP communication is Eq. 3 over the real links, not the catalogue's,
            # and memory limits are the machines' (`memory_limit`), not a catalogue reserve's.
            compute_gpu = replace(gpu, intra_node_bandwidth=math.inf, link_latency_s=0.0)
            self._analytic[key] = AnalyticCostModel(
                self.job.model,
                ClusterSpec(compute_gpu, tp=tp, memory_limit_bytes=gpu.memory_bytes),
                flash_attention=self.job.flash_attention,
                dtype=self.job.dtype,
            )
        return self._analytic[key]

    def part(
        self, gpu: GpuSpec, tp: int, part: str, mode: str
    ) -> tuple[float, float, float, float]:
        """(forward s, backward s, stored bytes, transient bytes) of one micro-batch under
        recomputation `mode` (which only the transformer layers depend on)."""
        key = (gpu, tp, part, mode)
        if key not in self._layer:
            self._layer[key] = self._model(gpu, tp).part_costs(
                part, self.job.micro_batch_size, self.job.seqlen, mode
            )
        return self._layer[key]

    @cached_property
    def _activation_bytes(self) -> float:
        j = self.job
        return j.micro_batch_size * j.seqlen * j.model.hidden_size * DTYPE_BYTES[j.dtype]

    def tp_comm_s(self, devices: tuple[int, ...], mode: str) -> float:
        """App. A Eq. 3: per layer and micro-batch, the slowest member's exchanges."""
        if len(devices) < 2:
            return 0.0
        key = (devices, mode)
        if key not in self._tp:
            idx = np.array(devices)
            bw = self.cluster.bandwidth[np.ix_(idx, idx)]
            lat = self.cluster.latency[np.ix_(idx, idx)]
            per_peer = lat + self._activation_bytes / (len(devices) * bw)
            np.fill_diagonal(per_peer, 0.0)
            self._tp[key] = _TP_STEPS[mode] * float(per_peer.sum(1).max())
        return self._tp[key]

    def hop_s(
        self, sender: tuple[int, ...], receiver: tuple[int, ...], flows: float = 1.0
    ) -> float:
        """App. A Eq. 5: leader to leader over the best pair, then the receiving leader
        broadcasts within its TP group; forward and backward (factor 2). `flows` transfers
        share the machines' network link when the leaders sit on different machines."""
        if not self.share_links:
            flows = 1.0
        key = (sender, receiver, flows)
        if key not in self._hop:
            bw = self.cluster.bandwidth[np.ix_(sender, receiver)]
            lat = self.cluster.latency[np.ix_(sender, receiver)]
            machine = self.cluster.device_machine
            crosses = machine[np.array(sender)][:, None] != machine[np.array(receiver)][None, :]
            bw = np.where(crosses, bw / flows, bw)
            x = self._activation_bytes
            inner_bw = self.cluster.bandwidth[np.ix_(receiver, receiver)]
            inner_lat = self.cluster.latency[np.ix_(receiver, receiver)]
            inner = inner_lat + x / (len(receiver) * inner_bw)
            np.fill_diagonal(inner, 0.0)
            total = lat + x / bw + inner.sum(1)[None, :]
            self._hop[key] = 2.0 * float(total.min())
        return self._hop[key]

    def leader_machines(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int] | None:
        """Machines of the hop's leader pair when every pair crosses machines, else None."""
        machine = self.cluster.device_machine
        ma = {int(machine[d]) for d in a}
        mb = {int(machine[d]) for d in b}
        if ma & mb:
            return None
        bw = self.cluster.bandwidth[np.ix_(a, b)]
        i, j = np.unravel_index(int(np.argmax(bw)), bw.shape)
        return int(machine[a[i]]), int(machine[b[j]])

    def hop_flows(self, plan: HeteroPlan) -> dict[tuple[int, int], float]:
        """Concurrent transfers behind every cross-machine stage boundary of a plan: in the
        steady state all pipelines send at once, so a machine's link carries every boundary
        that leaves it (and, in the other direction, every one that enters it)."""
        out_of: dict[int, int] = {}
        into: dict[int, int] = {}
        ends = []
        for p in plan.pipelines:
            for a, b in zip(p.stages, p.stages[1:], strict=False):
                pair = self.leader_machines(a.devices, b.devices)
                if pair is not None:
                    out_of[pair[0]] = out_of.get(pair[0], 0) + 1
                    into[pair[1]] = into.get(pair[1], 0) + 1
                    ends.append(pair)
        return {(a, b): float(max(out_of[a], into[b])) for a, b in ends}

    def _flows(self, a: tuple[int, ...], b: tuple[int, ...], flows: dict | None) -> float:
        if not flows:
            return 1.0
        pair = self.leader_machines(a, b)
        return flows.get(pair, 1.0) if pair is not None else 1.0

    def layer_time_s(self, devices: tuple[int, ...], mode: str) -> float:
        """Forward + backward of one transformer layer and micro-batch on this TP group."""
        key = ("layer", devices, mode)
        if key not in self._memo:
            f, b, _, _ = self.part(self._gpu(devices), len(devices), "decoder", mode)
            self._memo[key] = f + b + self.tp_comm_s(devices, mode)
        return self._memo[key]

    def extra_time_s(self, devices: tuple[int, ...], first: bool, last: bool) -> float:
        """Embedding on the first stage, output layer and loss on the last."""
        gpu, tp, t = self._gpu(devices), len(devices), 0.0
        if first:
            f, b, _, _ = self.part(gpu, tp, "embedding", "none")
            t += f + b
        if last:
            f, b, _, _ = self.part(gpu, tp, "output", "none")
            t += f + b
        return t

    def _forward_share(self, devices: tuple[int, ...], mode: str) -> float:
        f, b, _, _ = self.part(self._gpu(devices), len(devices), "decoder", mode)
        return f / (f + b)

    # ---- memory -----------------------------------------------------------------------------
    def memory_limit(self, devices: tuple[int, ...]) -> float:
        machines = self.cluster.machines
        return float(
            min(machines[int(self.cluster.device_machine[d])].memory_limit_bytes for d in devices)
        )

    def _bytes_per_param(self, num_pipelines: int) -> float:
        optimizer = 12.0 / (num_pipelines if self.job.shard_optimizer else 1)
        return 2 + 4 + optimizer

    def layer_memory(
        self, devices: tuple[int, ...], in_flight: int, num_pipelines: int, mode: str
    ) -> float:
        """Bytes one transformer layer adds to each device of the stage."""
        m, tp = self.job.model, len(devices)
        _, _, stored, _ = self.part(self._gpu(devices), tp, "decoder", mode)
        static = m.layer_params("decoder") / tp * self._bytes_per_param(num_pipelines)
        return static + in_flight * stored

    def fixed_memory(
        self,
        devices: tuple[int, ...],
        first: bool,
        last: bool,
        in_flight: int,
        num_pipelines: int,
        mode: str,
    ) -> float:
        """Bytes a stage holds however many layers it has: the largest transient workspace,
        and the embedding / output layer with their activations on the first / last stage."""
        m, tp, gpu = self.job.model, len(devices), self._gpu(devices)
        per_param = self._bytes_per_param(num_pipelines)
        _, _, _, transient = self.part(gpu, tp, "decoder", mode)
        total = transient
        if first:
            _, _, stored, _ = self.part(gpu, tp, "embedding", "none")
            total += m.embedding_params() / tp * per_param + in_flight * stored
        if last:
            _, _, stored, out_transient = self.part(gpu, tp, "output", "none")
            total += m.output_params() / tp * per_param + in_flight * stored
            total += out_transient
        return total

    def stage_options(
        self,
        devices: tuple[int, ...],
        first: bool,
        last: bool,
        in_flight: int,
        num_pipelines: int,
    ) -> tuple[StageOption, ...]:
        """The stage under each recomputation mode it may run (fastest first), per
        micro-batch: what layer assignment balances (memoised: searches ask often)."""
        key = ("options", devices, first, last, in_flight, num_pipelines)
        if key not in self._memo:
            extra = self.extra_time_s(devices, first, last)
            limit = self.memory_limit(devices)
            options = []
            for mode in self.recompute_modes:
                room = limit - self.fixed_memory(
                    devices, first, last, in_flight, num_pipelines, mode
                )
                per_layer = self.layer_memory(devices, in_flight, num_pipelines, mode)
                capacity = max(0, math.floor(room / per_layer)) if room > 0 else 0
                options.append(StageOption(mode, self.layer_time_s(devices, mode), extra, capacity))
            self._memo[key] = tuple(options)
        return self._memo[key]  # type: ignore[return-value]

    # ---- stages, pipelines, plans -----------------------------------------------------------
    def stage_costs(
        self,
        pipeline: HeteroPipeline,
        num_pipelines: int,
        flows: dict[tuple[int, int], float] | None = None,
    ) -> list[StageCost]:
        """Per-stage times and memory of one pipeline (Eq. 5, 8, 11); `flows` from
        `hop_flows` of the whole plan (none: the pipeline alone on the network)."""
        stages = pipeline.stages
        depth = len(stages)
        out = []
        for j, s in enumerate(stages):
            first, last = j == 0, j == depth - 1
            in_flight = min(depth - j, pipeline.micro_batches)
            options = self.stage_options(s.devices, first, last, in_flight, num_pipelines)
            mode = fastest_holding(options, s.num_layers).mode
            busy = s.num_layers * self.layer_time_s(s.devices, mode) + self.extra_time_s(
                s.devices, first, last
            )
            share = self._forward_share(s.devices, mode)
            if last:
                hop_next = 0.0
            else:
                nxt = stages[j + 1].devices
                hop_next = self.hop_s(s.devices, nxt, self._flows(s.devices, nxt, flows))
            if first:
                hop_prev = 0.0
            else:
                prv = stages[j - 1].devices
                hop_prev = self.hop_s(prv, s.devices, self._flows(prv, s.devices, flows))
            mem = s.num_layers * self.layer_memory(
                s.devices, in_flight, num_pipelines, mode
            ) + self.fixed_memory(s.devices, first, last, in_flight, num_pipelines, mode)
            out.append(
                StageCost(
                    busy * share,
                    busy * (1 - share),
                    hop_next / 2,
                    hop_prev / 2,
                    mem,
                    self.memory_limit(s.devices),
                    mode,
                )
            )
        return out

    def dp_sync_s(self, plan: HeteroPlan) -> float:
        """App. A Eq. 4 and 7. A layer's gradients live on one stage of every pipeline; with
        different TP degrees they are cut into chunks of the smallest shard (§3.2) and chunk
        c is reduced among device c mod tp of each of those stages. A device reduces its
        chunks one after the other; all stages reduce at once, so the devices of a machine
        whose groups leave it share its network link; the slowest bounds the sync."""
        pipes = plan.pipelines
        if len(pipes) < 2:
            return 0.0
        m = self.job.model
        grad_bytes = DTYPE_BYTES[self.job.dtype]
        # Runs of layers held by the same stage in every pipeline, plus embedding and output.
        cuts = sorted({b for p in pipes for s in p.stages for b in s.layers})
        runs = [(a, b, m.layer_params("decoder") * (b - a)) for a, b in itertools.pairwise(cuts)]
        groups: list[tuple[list[HeteroStage], float]] = []
        for a, _b, params in runs:
            holders = [next(s for s in p.stages if s.layers[0] <= a < s.layers[1]) for p in pipes]
            groups.append((holders, params))
        groups.append(([p.stages[0] for p in pipes], m.embedding_params()))
        groups.append(([p.stages[-1] for p in pipes], m.output_params()))
        machine = self.cluster.device_machine
        # A machine's link carries the traffic of every device on it whose DP group leaves it.
        leaving: dict[int, set[int]] = {}
        for holders, _ in groups:
            for c in range(max(s.tp for s in holders)):
                members = [s.devices[c % s.tp] for s in holders]
                for d in members:
                    if any(machine[o] != machine[d] for o in members):
                        leaving.setdefault(int(machine[d]), set()).add(d)
        share = np.array([len(leaving.get(m, ())) or 1 for m in range(len(self.cluster.machines))])
        if not self.share_links:
            share[:] = 1
        busy: dict[int, float] = {}
        for holders, params in groups:
            chunks = max(s.tp for s in holders)
            chunk_bytes = params * grad_bytes / chunks
            for c in range(chunks):
                members = np.array([s.devices[c % s.tp] for s in holders])
                mm = machine[members]
                flows = np.maximum(share[mm][:, None], share[mm][None, :])
                bw = self.cluster.bandwidth[np.ix_(members, members)]
                bw = np.where(mm[:, None] != mm[None, :], bw / flows, bw)
                lat = self.cluster.latency[np.ix_(members, members)]
                per_peer = lat + chunk_bytes / (len(members) * bw)
                np.fill_diagonal(per_peer, 0.0)
                t = 2.0 * float(per_peer.sum(1).max())
                for d in members:
                    busy[int(d)] = busy.get(int(d), 0.0) + t
        return max(busy.values())

    def hierarchical_sync_s(self, pipelines: list[HeteroPipeline]) -> float:
        """A lower bound on the gradient sync of any pipelines, however many and however
        unequal (per-iteration strategies change them, so `dp_sync_s`'s per-chunk groups of
        one plan do not apply): each parameter's gradients are reduced inside every machine
        that holds a copy first (taken as free), then by a ring over those k machines, which
        puts 2 (k - 1) / k of its bytes on each one's network link; the busiest link, at the
        best bandwidth it has to another machine, bounds the sync."""
        if len(pipelines) < 2:
            return 0.0
        m = self.job.model
        machine = self.cluster.device_machine
        holders: list[tuple[set[int], float]] = []
        for layer in range(m.num_layers):
            where = {
                int(machine[d])
                for p in pipelines
                for s in p.stages
                if s.layers[0] <= layer < s.layers[1]
                for d in s.devices
            }
            holders.append((where, m.layer_params("decoder")))
        for ends, params in (
            ([p.stages[0] for p in pipelines], m.embedding_params()),
            ([p.stages[-1] for p in pipelines], m.output_params()),
        ):
            holders.append(({int(machine[d]) for s in ends for d in s.devices}, params))
        sent = np.zeros(len(self.cluster.machines))
        for where, params in holders:
            k = len(where)
            for i in where:
                sent[i] += 2.0 * (k - 1) / k * params * DTYPE_BYTES[self.job.dtype]
        firsts = [mc.first_device for mc in self.cluster.machines]
        between = self.cluster.bandwidth[np.ix_(firsts, firsts)].copy()
        np.fill_diagonal(between, 0.0)
        return float(np.max(sent / np.maximum(between.max(axis=1), 1e-30)))

    def plan_stage_costs(self, plan: HeteroPlan) -> list[list[StageCost]]:
        """Every pipeline's stage costs with the plan's network sharing: what both the
        closed form and the 1F1B replay read."""
        flows = self.hop_flows(plan)
        n = len(plan.pipelines)
        return [self.stage_costs(p, n, flows) for p in plan.pipelines]

    def estimate(self, plan: HeteroPlan) -> Estimate:
        """Eq. 10: the slowest pipeline plus DP sync; MFU over the whole cluster's peak."""
        stages = self.plan_stage_costs(plan)
        times = [
            pipeline_time([x.busy_s for x in s], p.micro_batches)
            for s, p in zip(stages, plan.pipelines, strict=True)
        ]
        dp = self.dp_sync_s(plan)
        iteration = max(times) + dp
        oom = [
            f"pipeline {i} stage {j}: {c.memory_bytes / 2**30:.1f} GiB > "
            f"{c.memory_limit_bytes / 2**30:.1f} GiB"
            for i, p in enumerate(stages)
            for j, c in enumerate(p)
            if c.memory_bytes > c.memory_limit_bytes
        ]
        return Estimate(iteration, times, dp, stages, self.mfu(plan, iteration), not oom, oom)

    def mfu(self, plan: HeteroPlan, iteration_s: float) -> float:
        flops = self.job.flops_per_sample() * plan.global_batch
        return flops / (iteration_s * self.cluster.total_peak_flops)
