"""DynaPipe workloads shared by the DynaPipe figure scripts (dynapipe.txt §8).

SYNTHETIC FLAN-like lengths (the `flan` preset stands in for FLANv2, which we do not ship),
Table 1's model sizes on A100-40GB GPUs (the p4d testbed), the analytic cost model, and the
planner core (`IterationPlanner`) for every method: each method is planned on the same global
batches and its throughput is real tokens over the sum of predicted iteration times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynapipe_planner.cluster import ClusterSpec, get_gpu
from dynapipe_planner.cost import AnalyticCostModel
from dynapipe_planner.data import global_batches, sample_lengths
from dynapipe_planner.errors import PlanningError
from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig

GPU = "A100-40GB"
DATASET_SIZE = 20_000


@dataclass(frozen=True)
class Setup:
    """A model on a fixed parallel layout (8 GPUs: TP x PP x DP)."""

    model: str
    tp: int
    stages: int
    replicas: int

    @property
    def gpus(self) -> int:
        return self.tp * self.stages * self.replicas

    @property
    def encoder_decoder(self) -> bool:
        return MODEL_PRESETS[self.model].is_encoder_decoder

    @property
    def label(self) -> str:
        return f"{self.model} TP{self.tp}xPP{self.stages}xDP{self.replicas}"

    def cost_model(self) -> AnalyticCostModel:
        cluster = ClusterSpec(get_gpu(GPU), self.stages, self.replicas, self.tp)
        return AnalyticCostModel(MODEL_PRESETS[self.model], cluster)

    def planner(self, **config) -> IterationPlanner:
        return IterationPlanner(
            self.cost_model(), self.stages, PlannerConfig(num_replicas=self.replicas, **config)
        )


# 8-GPU layouts of Table 1's 8-GPU models (GPT 6.7B, T5 11B), fixed instead of grid-searched.
GPT_8 = Setup("gpt-6.7b", tp=2, stages=4, replicas=1)
T5_8 = Setup("t5-11b", tp=4, stages=2, replicas=1)


def batches(
    setup: Setup, max_seqlen: int, tokens: int, iterations: int, seed: int = 1
) -> list[np.ndarray]:
    """`iterations` global batches of `tokens` tokens from the FLAN-like preset, truncated."""
    data = sample_lengths(
        "flan", DATASET_SIZE, seed=0, max_seqlen=max_seqlen, with_targets=setup.encoder_decoder
    )
    stream = global_batches(data, tokens, seed=seed)
    return [data[next(stream)] for _ in range(iterations)]


@dataclass
class Outcome:
    """A method over several iterations; `plans` is empty when every iteration ran out of
    memory under every recomputation mode (plotted as OOM)."""

    plans: list[ExecutionPlan]
    lengths: list[np.ndarray]

    @property
    def ok(self) -> bool:
        return bool(self.plans)

    @property
    def throughput(self) -> float:
        if not self.plans:
            return float("nan")
        tokens = sum(p.stats["tokens"] for p in self.plans)
        return tokens / sum(p.stats["predicted_iteration_s"] for p in self.plans)

    @property
    def padding_efficiency(self) -> float:
        return self.efficiency(None)

    def efficiency(self, side: int | None) -> float:
        """Real over padded tokens: both sides (None), encoder input (0) or decoder (1)."""
        if not self.plans:
            return float("nan")
        real = padded = 0
        for plan, lengths in zip(self.plans, self.lengths, strict=True):
            src = lengths if lengths.ndim == 1 else lengths[:, 0]
            tgt = np.zeros_like(src) if lengths.ndim == 1 else lengths[:, 1]
            for mb in plan.microbatches:
                rows = mb.num_rows
                if side in (None, 0):
                    padded += rows * mb.seqlen
                if side in (None, 1):
                    padded += rows * mb.tgt_seqlen
            if side in (None, 0):
                real += int(src.sum())
            if side in (None, 1):
                real += int(tgt.sum())
        return real / padded if padded else float("nan")


def run_method(planner: IterationPlanner, global_batches_: list[np.ndarray]) -> Outcome:
    """Plan every batch; an out-of-memory iteration makes the whole method OOM."""
    plans = []
    for batch in global_batches_:
        try:
            plans.append(planner.plan(batch))
        except PlanningError:
            return Outcome([], [])
    return Outcome(plans, list(global_batches_))
