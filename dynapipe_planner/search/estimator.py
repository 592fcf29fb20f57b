"""Galvatron-BMW cost estimator (seed `galvatron_bmw.txt` §V, App. C).

Prices every layer of a pipeline stage under every candidate strategy, for one micro-batch of
`b` samples (split `data_degree` ways) and `m` micro-batches:

* compute: forward from `CostInputs`, backward twice the forward (§V) or as measured when the
  inputs hold it (a profiled cost table), plus one more forward under CKPT (recomputation)
  with its TP all-reduce; each pass is §V's per-sample time times the samples on the GPU,
  plus the measured time per micro-batch where the inputs hold one (a profiled table: the
  operators' fixed cost, which dominates small micro-batches on a CPU);
* communication from bandwidths: TP all-reduces (not overlapped), SDP all-gathers before
  forward and backward and a reduce-scatter after backward (3 (N-1)/N of the weights,
  Takeaway #3), DP gradient all-reduce (2 (N-1)/N) on the last micro-batch only (App. C);
  where the inputs hold FSDP2's measured time for the SDP group size (a profiled table), that
  time in place of SDP's bytes over the bandwidth (TP t: the TP-1 layer's time / t), added to
  the pass it belongs to (it already holds whatever overlapped);
* overlap: SDP/DP traffic runs beside compute and both slow down by `overlap_slowdown` while
  they overlap: `slowdown * min(a, b) + |a - b|`;
* memory: model states (weights, gradients, Adam; sharded by TP and SDP), forward activations
  (only the layer input under CKPT) times the micro-batches in flight under 1F1B (stage i of
  P keeps min(P - i, m)), and the backward peak of a layer (its workspace, its recomputed
  activations under CKPT, SDP's gathered weights), combined by Eq. 2;
* transformation cost R between neighbouring layers whose activations are laid out
  differently (Eq. 4), priced as gathering the missing samples over the stage's GPUs;
* the pipeline time of Eq. 9: (m - 1) * max_i C_nosync(M_i) + sum_i C(M_i);
* ranks that share fewer CPU cores than there are ranks (profiled CPU tables; not in the
  paper, whose stages each own a GPU): Eq. 9's stages run side by side only as far as the cores
  allow; a fluid run of the stages' 1F1B passes, each pass waiting for its input and the cores
  shared among the ranks with a pass ready as the operating system shares them
  (`shared_host_time`), gives another iteration time (the bubbles' idle cores included), and
  the estimate is the larger; the time the cores stand idle while SDP's collectives wait for
  the group's last rank (measured in FSDP2's profile) is added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..schedule.one_f_one_b import one_f_one_b_passes
from .cost_inputs import CostInputs
from .space import LayerStrategy

INF = float("inf")


def overlapped(compute: np.ndarray, comm: np.ndarray, slowdown: float) -> np.ndarray:
    """Time of `compute` and `comm` run side by side, each slowed down while both run."""
    return slowdown * np.minimum(compute, comm) + np.abs(compute - comm)


@dataclass
class StageTables:
    """Per-layer x per-strategy costs of one stage (layers in rows, strategies in columns)."""

    nosync: np.ndarray  # one micro-batch without gradient sync (s)
    sync: np.ndarray  # the last micro-batch, with DP gradient sync (s)
    objective: np.ndarray  # (m - 1) * nosync + sync: what the layer DP minimises
    fwd_bytes: np.ndarray  # O_f: activations kept, times micro-batches in flight
    state_bytes: np.ndarray  # O_ms: weights, gradients, optimiser states
    bwd_bytes: np.ndarray  # O_b: backward peak on top of the stored activations
    # what each layer would add as the stage's first: its input, kept for each micro-batch in
    # flight (a layer's profiled activations hold its output, not its input), and on all but
    # the last stage the output gradient a backward receives (`stage_fwd_bytes` adds it)
    input_bytes: np.ndarray
    transform: np.ndarray  # (L, S, S): R(previous strategy, this strategy) for all micro-batches
    transform_once: np.ndarray  # (L, S, S): R for one micro-batch
    extra_time_nosync: float  # the runtime's own and p2p time per micro-batch
    extra_time_sync: float
    extra_cpu: float  # their CPU seconds (a transfer's at both ends)
    extra_bytes: float  # embedding / output layer memory
    # one micro-batch's forward alone (s; the rest of `nosync` is its backward), the CPU
    # seconds of a rank for `forward`, `nosync` and `sync` (ranks on shared CPU cores), and
    # the share of a strategy's time its rank is on a core (`cpu_busy_fraction` of its TP)
    forward: np.ndarray
    cpu_forward: np.ndarray
    cpu_nosync: np.ndarray
    cpu_sync: np.ndarray
    busy: np.ndarray
    # per micro-batch: the time the cores stand idle while an SDP layer's collectives wait for
    # the last rank of the group (FSDP2's measured time beyond its ranks' CPU share)
    sync_idle: np.ndarray


def _layout_key(s: LayerStrategy) -> tuple:
    """Which samples a GPU holds: DP and SDP split samples alike, CKPT changes nothing."""
    levels = tuple(
        ("data" if p in ("dp", "sdp") else p, d) for p, d in zip(s.order, s.degrees, strict=True)
    )
    return levels


class Estimator:
    """Costs of `strategies` (all of one PP degree) for the layers of `inputs`."""

    def __init__(self, inputs: CostInputs, strategies: list[LayerStrategy]) -> None:
        self.inputs = inputs
        self.strategies = strategies
        self.pp = strategies[0].pp if strategies else 1
        self.group = strategies[0].group_size if strategies else 1
        types = inputs.layer_types
        s_count, t_count = len(strategies), len(types)
        lat = inputs.link_latency_s
        self.supported = np.array([inputs.supports(s) for s in strategies], dtype=bool)
        dp = np.array([s.dp for s in strategies], dtype=np.float64)
        sdp = np.array([s.sdp for s in strategies], dtype=np.float64)
        self.data = dp * sdp
        self.ckpt = np.array([s.ckpt for s in strategies], dtype=bool)

        def ring_bw(paradigm: str) -> np.ndarray:
            return np.array(
                [
                    inputs.bandwidth(s.degree(paradigm), s.stride(paradigm))
                    if s.degree(paradigm) > 1
                    else INF
                    for s in strategies
                ]
            )

        tp_bw, dp_bw, sdp_bw = ring_bw("tp"), ring_bw("dp"), ring_bw("sdp")
        # Per layer type x strategy: per-sample-on-this-GPU pieces and per-micro-batch constants.
        self.fwd_per_sample = np.zeros((t_count, s_count))
        self.bwd_per_sample = np.zeros((t_count, s_count))
        self.fwd_per_micro = np.zeros((t_count, s_count))
        self.bwd_per_micro = np.zeros((t_count, s_count))
        self.tp_per_sample = np.zeros((t_count, s_count))
        self.tp_latency = np.zeros((t_count, s_count))
        self.act_per_sample = np.zeros((t_count, s_count))
        self.work_per_sample = np.zeros((t_count, s_count))
        self.sdp_gather = np.zeros((t_count, s_count))
        self.sdp_measured_fwd = np.zeros((t_count, s_count))
        self.sdp_measured_bwd = np.zeros((t_count, s_count))
        self.dp_allreduce = np.zeros((t_count, s_count))
        self.states = np.zeros((t_count, s_count))
        self.gathered = np.zeros((t_count, s_count))
        for k, lt in enumerate(types):
            for j, s in enumerate(strategies):
                if not self.supported[j]:
                    continue
                t = s.tp
                self.fwd_per_sample[k, j] = lt.forward_s_per_sample[t]
                self.bwd_per_sample[k, j] = lt.backward_s(t)
                self.fwd_per_micro[k, j] = lt.forward_s_per_microbatch.get(t, 0.0)
                self.bwd_per_micro[k, j] = lt.backward_s_per_microbatch.get(t, 0.0)
                if t > 1 and lt.tp_allreduce_bytes_per_sample > 0:  # profiled: in the times
                    ring = 2.0 * (t - 1) / t / tp_bw[j]
                    self.tp_per_sample[k, j] = lt.tp_allreduce_bytes_per_sample * ring
                    self.tp_latency[k, j] = lat
                self.act_per_sample[k, j] = lt.activation_bytes_per_sample[t]
                self.work_per_sample[k, j] = lt.workspace_bytes_per_sample[t]
                shard = lt.param_bytes / t
                if s.sdp > 1:
                    z = s.sdp
                    if z in inputs.sdp_forward_s and z in inputs.sdp_backward_s:
                        self.sdp_measured_fwd[k, j] = inputs.sdp_forward_s[z] / t
                        self.sdp_measured_bwd[k, j] = inputs.sdp_backward_s[z] / t
                    else:
                        self.sdp_gather[k, j] = (z - 1) / z * shard / sdp_bw[j] + lat
                    self.gathered[k, j] = inputs.sdp_transient_bytes.get(z, lt.param_bytes) / t
                if s.dp > 1:
                    a = s.dp
                    self.dp_allreduce[k, j] = 2.0 * (a - 1) / a * shard / dp_bw[j] + lat
                self.states[k, j] = lt.param_bytes * inputs.model_state_factor / t / s.sdp
        # Transformation: gather the samples a GPU lacks when the layout changes.
        keys = [_layout_key(s) for s in strategies]
        self.relayout = np.zeros((s_count, s_count))  # fraction of the new shard to receive
        degrees = [s.data_degree for s in strategies]
        for i, da in enumerate(degrees):
            for j, db in enumerate(degrees):
                if keys[i] == keys[j]:
                    continue
                if db > da and db % da == 0:
                    continue  # the new shard is a slice of what the GPU holds: local
                if db < da:
                    self.relayout[i, j] = 1.0 - db / da
                else:
                    self.relayout[i, j] = 1.0
        self.stage_bw = inputs.bandwidth(self.group, 1) if self.group > 1 else INF
        # the output layer, on the last layer's columns of the last stage: measured at the
        # strategy's TP degree on its data-parallel share of the micro-batch, else the TP-1
        # time split evenly over the stage's GPUs (like a vocabulary-parallel layer)
        by_tp = inputs.output_forward_s_per_sample_by_tp
        self.head_per_sample = np.array(
            [by_tp.get(s.tp, inputs.output_forward_s_per_sample) for s in strategies]
        )
        self.head_per_micro = np.array(
            [
                inputs.output_forward_s_per_microbatch_by_tp.get(
                    s.tp, inputs.output_forward_s_per_microbatch
                )
                for s in strategies
            ]
        )
        self.head_split = np.array(
            [s.data_degree if s.tp in by_tp else self.group for s in strategies], dtype=np.float64
        )
        # share of a layer's time its rank is on a CPU core (1 where not measured), and of the
        # time FSDP2 adds to an SDP layer (its collectives wait on the other ranks)
        self.busy = np.array([inputs.cpu_busy_fraction.get(s.tp, 1.0) for s in strategies])
        self.sdp_busy = np.array(
            [
                inputs.sdp_cpu_busy_fraction.get(s.sdp, b)
                for s, b in zip(strategies, self.busy, strict=True)
            ]
        )
        # FSDP2 on z ranks over c cores, profiled: of its wall time w the ranks were on a core
        # z * busy * w core-seconds, so w (1 - z busy / c) of it no rank could use the cores
        cores = inputs.host_cores
        # strategies whose profiles gave each process a core pay the contention among the
        # job's ranks (`cpu_contention_factor`); the others' profiles already shared cores
        self.tp_had_core = np.array([s.tp <= cores for s in strategies], dtype=bool)
        self.sdp_had_core = np.array([s.sdp <= cores for s in strategies], dtype=bool)
        self.contention_sizes = sorted(inputs.cpu_contention_factor)
        self.contention_factors = [inputs.cpu_contention_factor[n] for n in self.contention_sizes]
        self.sdp_idle = np.array(
            [
                max(0.0, 1.0 - s.sdp * b / cores) if cores and s.sdp > 1 else 0.0
                for s, b in zip(strategies, self.sdp_busy, strict=True)
            ]
        )

    def stage_tables(
        self, layers: range, stage: int, microbatch: int, num_micro: int
    ) -> StageTables:
        """Costs of `layers` on pipeline stage `stage` (0-based)."""
        inputs, b, m = self.inputs, float(microbatch), num_micro
        kinds = np.array([inputs.layer_kinds[i] for i in layers], dtype=np.int64)
        n_local = b / self.data  # samples per GPU
        ok = self.supported & (microbatch % self.data.astype(np.int64) == 0)
        fwd_compute = self.fwd_per_micro[kinds] + self.fwd_per_sample[kinds] * n_local
        tp_pass = self.tp_per_sample[kinds] * n_local + self.tp_latency[kinds]
        gather = self.sdp_gather[kinds]
        forward = overlapped(fwd_compute, gather, inputs.overlap_slowdown) + tp_pass
        forward = forward + self.sdp_measured_fwd[kinds]
        bwd_compute = self.bwd_per_micro[kinds] + self.bwd_per_sample[kinds] * n_local
        bwd_compute = bwd_compute + np.where(self.ckpt, fwd_compute, 0.0)
        bwd_tp = tp_pass * np.where(self.ckpt, 2.0, 1.0)
        slow = inputs.overlap_slowdown
        nosync = forward + overlapped(bwd_compute, 2.0 * gather, slow) + bwd_tp
        nosync = nosync + self.sdp_measured_bwd[kinds]
        sync = forward + overlapped(bwd_compute, 2.0 * gather + self.dp_allreduce[kinds], slow)
        sync = sync + bwd_tp + self.sdp_measured_bwd[kinds]
        if stage == self.pp - 1 and len(layers) and layers.stop == inputs.num_layers:
            head = 3.0 * (self.head_per_micro + self.head_per_sample * b / self.head_split)
            forward[-1] += head / 3.0  # the output layer's forward: a third, as in §V
            nosync[-1] += head
            sync[-1] += head
        in_flight = min(self.pp - stage, m)
        boundary = np.array([inputs.layer_types[k].boundary_bytes_per_sample for k in kinds])
        stored = np.where(self.ckpt, boundary[:, None], self.act_per_sample[kinds])
        fwd_bytes = in_flight * n_local * stored
        held = in_flight + (stage < self.pp - 1)
        input_bytes = held * boundary[:, None] * n_local
        bwd_bytes = n_local * (
            self.work_per_sample[kinds] + np.where(self.ckpt, self.act_per_sample[kinds], 0.0)
        )
        bwd_bytes = bwd_bytes + self.gathered[kinds]
        state_bytes = self.states[kinds]
        bad = ~ok[None, :]
        nosync = np.where(bad, INF, nosync)
        sync = np.where(bad, INF, sync)
        objective = np.where(bad, INF, (m - 1) * np.where(bad, 0.0, nosync) + sync)
        # Forward and backward each move the missing activations (and their gradients).
        per_layer = 2.0 * boundary * b / self.stage_bw
        new_shard = 1.0 / self.data
        once = per_layer[:, None, None] * (self.relayout * new_shard[None, :])[None, :, :]
        extra_t, extra_cpu, extra_b = self._extras(stage, b)
        fsdp = self.sdp_measured_fwd[kinds] + self.sdp_measured_bwd[kinds]
        fsdp_forward = self.sdp_measured_fwd[kinds]
        # the contention among the job's ranks (where a strategy's profile gave its process
        # a core) falls on the passes that follow a hand-off: a recomputed forward runs right
        # before its backward, on warm caches, at the single-process price (4 pipeline stages
        # on 2 cores: a checkpointed layer read 1.17-1.19 its passes alone, recompute
        # included, a plain one 1.20-1.29, about the same extra seconds a micro-batch)
        contention = self._contention(n_local)
        busy = self.busy * np.where(self.tp_had_core, contention, 1.0)
        sdp_busy = self.sdp_busy * np.where(self.sdp_had_core, contention, 1.0)
        recompute = np.where(self.ckpt, fwd_compute + tp_pass, 0.0)
        on_cores = self.busy * recompute + sdp_busy * fsdp  # CPU of the recompute and FSDP2
        return StageTables(
            nosync=nosync,
            sync=sync,
            objective=objective,
            fwd_bytes=fwd_bytes,
            state_bytes=state_bytes,
            bwd_bytes=bwd_bytes,
            input_bytes=input_bytes,
            transform=once * m,
            transform_once=once,
            extra_time_nosync=extra_t,
            extra_time_sync=extra_t,
            extra_cpu=extra_cpu,
            extra_bytes=extra_b,
            forward=np.where(bad, INF, forward),
            cpu_forward=busy * (forward - fsdp_forward) + sdp_busy * fsdp_forward,
            cpu_nosync=busy * (nosync - fsdp - recompute) + on_cores,
            cpu_sync=busy * (sync - fsdp - recompute) + on_cores,
            busy=busy,
            sync_idle=self.sdp_idle * fsdp,
        )

    def _contention(self, samples: np.ndarray) -> np.ndarray:
        """`cpu_contention_factor` at each strategy's samples per rank, linear between the
        measured sizes and flat beyond them; 1 where nothing was measured."""
        if not self.contention_sizes:
            return np.ones_like(samples)
        return np.interp(samples, self.contention_sizes, self.contention_factors)

    def _extras(self, stage: int, b: float) -> tuple[float, float, float]:
        """Per micro-batch: the runtime's own cost (profiled) and p2p time, the CPU seconds of
        both (a transfer occupies a core at each end: the sender's and the receiver's rank
        copy it through their sockets); the embedding / output layer's memory on the end
        stages (the output layer's time is on the last layer's columns: it depends on the
        strategy's TP degree).

        The embedding and output layers' states are split evenly over the stage's GPUs (like a
        vocabulary-parallel layer); their communication is priced where measured (a profiled
        TP-t output layer), else not.
        """
        inputs, n = self.inputs, self.group
        time = cpu = inputs.runtime_s_per_microbatch
        nbytes = 0.0
        if self.pp > 1:
            bw = inputs.p2p_bandwidth[self.pp]
            first = inputs.layer_types[inputs.layer_kinds[0]]
            sends = (stage > 0) + (stage < self.pp - 1)  # as many receives
            transfer = b * first.boundary_bytes_per_sample / n / bw + inputs.link_latency_s
            time += sends * transfer
            cpu += 2 * sends * transfer
        if stage == 0:
            nbytes += inputs.embedding_param_bytes * inputs.model_state_factor / n
        if stage == self.pp - 1:
            nbytes += inputs.output_param_bytes * inputs.model_state_factor / n
            nbytes += inputs.output_activation_bytes_per_sample * b / n
        return time, cpu, nbytes


def stage_fwd_bytes(t: StageTables) -> np.ndarray:
    """`t.fwd_bytes` with the stage's input on its first layer (the layers of `t` are the
    stage's, first to last)."""
    held = t.fwd_bytes.copy()
    if len(held):
        held[0] += t.input_bytes[0]
    return held


def peak_memory(t: StageTables, chosen: list[int]) -> float:
    """Eq. 2 for the chosen strategy of each layer, plus the stage's input and the end
    stages' extra bytes."""
    running = float(t.input_bytes[0, chosen[0]]) if chosen else 0.0
    peak = 0.0
    states = 0.0
    for layer, j in enumerate(chosen):
        running += t.fwd_bytes[layer, j]
        peak = max(peak, running + t.bwd_bytes[layer, j])
        states += t.state_bytes[layer, j]
    return peak + states + t.extra_bytes


def stage_times(t: StageTables, chosen: list[int]) -> tuple[float, float]:
    """(one micro-batch without sync, the last micro-batch with sync) of a stage."""
    nosync = t.extra_time_nosync
    sync = t.extra_time_sync
    for layer, j in enumerate(chosen):
        nosync += t.nosync[layer, j]
        sync += t.sync[layer, j]
        if layer:
            r = t.transform_once[layer, chosen[layer - 1], j]
            nosync += r
            sync += r
    return nosync, sync


@dataclass(frozen=True)
class StageWork:
    """What one rank of a stage does per micro-batch, for the 1F1B run of ranks on shared
    cores (`shared_host_time`): seconds alone and CPU seconds of its forward, of a backward
    without gradient sync and of the last backward (with it)."""

    forward_s: float
    backward_s: float
    last_backward_s: float
    forward_cpu_s: float
    backward_cpu_s: float
    last_backward_cpu_s: float


def stage_work(t: StageTables, chosen: list[int]) -> StageWork:
    """The chosen strategies' `StageWork`: the layers' forwards, and the rest of `stage_times`
    as the backward; the per-micro-batch extras (p2p, the runtime) go a third to
    the forward (a layer's backward is about twice its forward), re-layouts half (the
    activations one way, their gradients back), both at the layers' mean busy share."""
    nosync, sync = stage_times(t, chosen)
    share = float(t.busy[chosen].mean()) if chosen else 1.0
    forward = t.extra_time_nosync / 3.0
    forward_cpu = t.extra_cpu / 3.0 * share
    cpu_nosync = cpu_sync = t.extra_cpu * share
    for layer, j in enumerate(chosen):
        forward += float(t.forward[layer, j])
        forward_cpu += float(t.cpu_forward[layer, j])
        cpu_nosync += float(t.cpu_nosync[layer, j])
        cpu_sync += float(t.cpu_sync[layer, j])
        if layer:
            r = float(t.transform_once[layer, chosen[layer - 1], j])
            forward += r / 2.0
            forward_cpu += r / 2.0 * share
            cpu_nosync += r * share
            cpu_sync += r * share
    return StageWork(
        forward, nosync - forward, sync - forward, forward_cpu,
        cpu_nosync - forward_cpu, cpu_sync - forward_cpu,
    )  # fmt: skip


def stage_sync_idle_s(t: StageTables, chosen: list[int], num_micro: int) -> float:
    """Seconds per iteration the cores stand idle while the stage's SDP collectives wait."""
    return num_micro * float(sum(t.sync_idle[layer, j] for layer, j in enumerate(chosen)))


def pipeline_time(nosync: list[float], sync: list[float], num_micro: int) -> float:
    """Eq. 9: (m - 1) * max_i C_nosync(M_i) + sum_i C(M_i)."""
    return (num_micro - 1) * max(nosync) + sum(sync)


def shares_cores(inputs: CostInputs, ranks: int) -> bool:
    """Whether `ranks` ranks outnumber the CPU cores they share (never on devices of their
    own: no `host_cores`)."""
    return 0 < inputs.host_cores < ranks


def core_shares(demands: Sequence[float], ranks_each: int, cores: float) -> list[float]:
    """The cores each of `ranks_each` ranks per entry gets when they all want to run:
    max-min fair, as the operating system shares cores; a rank wants `demand` cores (its CPU
    seconds per second alone, at most 1) and a rank wanting less than its fair share leaves
    the rest to the others."""
    shares = [0.0] * len(demands)
    left, waiting = float(cores), ranks_each * len(demands)
    for i in sorted(range(len(demands)), key=lambda i: demands[i]):
        fair = left / waiting
        shares[i] = min(demands[i], 1.0, fair)
        left -= ranks_each * shares[i]
        waiting -= ranks_each
    return shares


def shared_host_time(
    inputs: CostInputs,
    works: Sequence[StageWork],
    ranks_per_stage: int,
    num_micro: int,
    sync_idle: Sequence[float] = (),
) -> float:
    """The iteration time of the stages' ranks sharing `inputs.host_cores` CPU cores, each
    rank running its stage's 1F1B passes (`works`, per micro-batch). A fluid run: a pass
    starts when its input is there (the previous stage's forward, the next stage's
    backward) and its rank's turn comes; while passes run, the cores are shared among their
    ranks (`core_shares`), and a pass advances at the lesser of its speed alone and its
    cores over its CPU seconds. Pipeline bubbles thus leave cores idle, and where every
    rank keeps working it is their CPU seconds over the cores. Plus the longest time a
    stage's cores stand idle while its SDP collectives wait for the group's last rank
    (`sync_idle`, per stage: `stage_sync_idle_s`; fair sharing assumes ranks never wait on
    each other). 0 where each rank has a device of its own (no `host_cores`) or the ranks
    do not outnumber the cores."""
    stages, m = len(works), num_micro
    if not shares_cores(inputs, ranks_per_stage * stages):
        return 0.0
    order = one_f_one_b_passes(stages, m)
    turn = [0] * stages
    progress = [0.0] * stages  # fraction of the current pass done
    done: set[tuple[str, int, int]] = set()

    def ready(i: int) -> bool:
        if turn[i] == len(order[i]):
            return False
        kind, k = order[i][turn[i]]
        if kind == "F":
            return i == 0 or ("F", k, i - 1) in done
        return ("B", k, i + 1) in done if i < stages - 1 else ("F", k, i) in done

    def cost(i: int) -> tuple[float, float]:
        kind, k = order[i][turn[i]]
        w = works[i]
        if kind == "F":
            return w.forward_s, w.forward_cpu_s
        if k == m - 1:
            return w.last_backward_s, w.last_backward_cpu_s
        return w.backward_s, w.backward_cpu_s

    elapsed = 0.0
    while any(turn[i] < len(order[i]) for i in range(stages)):
        running = [i for i in range(stages) if ready(i)]
        costs = [cost(i) for i in running]
        demands = [cpu / wall if wall > 0 else 1.0 for wall, cpu in costs]
        shares = core_shares(demands, ranks_per_stage, inputs.host_cores)
        rates = [
            share / cpu if cpu > 0 else (1.0 / wall if wall > 0 else INF)
            for (wall, cpu), share in zip(costs, shares, strict=True)
        ]
        step = min((1.0 - progress[i]) / r for i, r in zip(running, rates, strict=True))
        elapsed += step
        for i, r in zip(running, rates, strict=True):
            progress[i] += r * step
            if progress[i] >= 1.0 - 1e-9:
                kind, k = order[i][turn[i]]
                done.add((kind, k, i))
                turn[i] += 1
                progress[i] = 0.0
    return float(elapsed + max(sync_idle, default=0.0))
