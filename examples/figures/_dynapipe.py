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
from dynapipe_planner.model_spec import MODEL_PRESETS, ModelSpec
from dynapipe_planner.plan import ExecutionPlan
from dynapipe_planner.planner import IterationPlanner, PlannerConfig

GPU = "A100-40GB"
DATASET_SIZE = 20_000
SHORTLIST = 3  # layouts screened on one batch that run every batch of a point
# Table 1's models that have no preset (shapes from the table; vocabularies as the presets').
TABLE1_EXTRA = {
    "gpt-29b": ModelSpec("gpt-29b", "gpt", 16, 12288, 96, 49152, 51200),
    "t5-22b": ModelSpec("t5-22b", "t5", 48, 1024, 128, 65536, 32128, kv_channels=128),
    "t5-44b": ModelSpec("t5-44b", "t5", 96, 1024, 128, 65536, 32128, kv_channels=128),
}
# Table 1: the model trained on each GPU count.
TABLE1 = {
    "gpt": {4: "gpt-3.35b", 8: "gpt-6.7b", 16: "gpt-13b", 32: "gpt-29b"},
    "t5": {4: "t5-5.5b", 8: "t5-11b", 16: "t5-22b", 32: "t5-44b"},
}


def model_spec(name: str) -> ModelSpec:
    return TABLE1_EXTRA[name] if name in TABLE1_EXTRA else MODEL_PRESETS[name]


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
        return model_spec(self.model).is_encoder_decoder

    @property
    def label(self) -> str:
        return f"{self.model} TP{self.tp}xPP{self.stages}xDP{self.replicas}"

    def cost_model(self) -> AnalyticCostModel:
        cluster = ClusterSpec(get_gpu(GPU), self.stages, self.replicas, self.tp)
        return AnalyticCostModel(model_spec(self.model), cluster)

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


def layouts(model: str, gpus: int) -> list[Setup]:
    """Power-of-two TP (within a node of 8) x PP (at most the layer count) x DP on `gpus`."""
    spec = model_spec(model)
    layers = spec.num_layers * (2 if spec.is_encoder_decoder else 1)
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if tp * pp <= gpus and gpus % (tp * pp) == 0 and pp <= layers:
                out.append(Setup(model, tp, pp, gpus // (tp * pp)))
    return out


def best_layout(
    model: str, gpus: int, config: dict, global_batches_: list[np.ndarray], max_seqlen: int
) -> Setup | None:
    """The layout with the highest throughput for one method on `global_batches_` (the paper's
    grid search over 3D parallelism): every layout screened on the first batch, the best
    `SHORTLIST` of them run on all batches (a layout that wins one batch may lose the
    iterations); None when every layout runs out of memory."""
    screened = []
    for setup in layouts(model, gpus):
        out = run_method(setup.planner(max_seqlen=max_seqlen, **config), global_batches_[:1])
        if out.ok:
            screened.append((out.throughput, setup))
    best, best_tps = None, 0.0
    for _, setup in sorted(screened, key=lambda item: -item[0])[:SHORTLIST]:
        out = run_method(setup.planner(max_seqlen=max_seqlen, **config), global_batches_)
        if out.ok and out.throughput > best_tps:
            best, best_tps = setup, out.throughput
    return best


def baseline_config(encoder_decoder: bool) -> dict:
    """MLM+DS stand-in: packing for GPT; fixed-size padding for T5 (our packing is
    decoder-only); 1F1B, micro-batch size grid searched by the planner."""
    return {"batching": "padding" if encoder_decoder else "packing", "schedule": "1f1b"}


def scaling_point(
    family: str, gpus: int, max_seqlen: int, tokens: int, iterations: int
) -> list[dict]:
    """One point of Fig. 13/14: DynaPipe and the baseline, each on its grid-searched layout
    (`best_layout`), plus the baseline on DynaPipe's layout (MLM+DS (c))."""
    model = TABLE1[family][gpus]
    probe = Setup(model, 1, 1, 1)
    bs = batches(probe, max_seqlen, tokens, iterations)
    base_cfg = baseline_config(probe.encoder_decoder)
    runs = {
        "dynapipe": ({"batching": "dynamic"}, best_layout(model, gpus, {}, bs, max_seqlen)),
        "baseline": (base_cfg, best_layout(model, gpus, base_cfg, bs, max_seqlen)),
    }
    runs["baseline (c)"] = (base_cfg, runs["dynapipe"][1])
    rows = []
    for method, (config, setup) in runs.items():
        out = (
            run_method(setup.planner(max_seqlen=max_seqlen, **config), bs)
            if setup is not None
            else Outcome([], [])
        )
        rows.append(
            {
                "family": family,
                "model": model,
                "gpus": gpus,
                "max_seqlen": max_seqlen,
                "global_batch_tokens": tokens,
                "method": method,
                "layout": setup.label.split(" ", 1)[1] if setup else "",
                "tokens_per_s": round(out.throughput, 1),
                "oom": not out.ok,
            }
        )
    return rows
