"""Hydraulis parallel schemes and the three numbers its planner needs of each (seed
hydraulis.txt §5.1, §6.1, Appendix B and C).

A parallel scheme P = <TP, PP> is the layout of one pipeline; a heterogeneous strategy runs
several pipelines of different schemes at once. Each scheme is profiled once from the planner
core's cost tables (analytic or profiled, so no GPU is needed), for single-sequence micro-batches
(packed sequences use variable-length attention, so a packed micro-batch costs about the sum of
its sequences, §6.1):

- MaxLen(P) (App. B.1): the most tokens one micro-batch may hold when 1F1B keeps PP - j of them
  on stage j, on top of the stage's static memory. Optimiser states are sharded over all the
  job's GPUs (optimisation-propagation disaggregation, §5.2), which the cost model sees as a
  distributed optimiser over N / (TP x PP) replicas.
- T(l, P) (App. B.2): forward + backward seconds of the busiest stage for one sequence of l
  tokens. The paper fits a*l^2 + b*l + c; we keep the fit (its coefficients are reported) and
  also the sampled curve, which `latency="table"` reads directly.
- UtilLen(P) (App. C): the shortest length whose tokens per second reach `util_threshold` (0.85)
  of the scheme's best; shorter micro-batches leave GEMMs under-utilised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cluster import ClusterSpec, GpuSpec
from ..cost import AnalyticCostModel, PipelineCosts
from ..errors import PlanningError
from ..model_spec import ModelSpec
from ..planner import CostModel

LATENCY_MODES = ("fit", "table")


@dataclass(frozen=True, order=True)
class ParallelScheme:
    """One pipeline's layout: `tp` GPUs per stage, `pp` stages, on GPUs of type `gpu` ("": the
    job's one GPU type; a type name on a mixed cluster, where the same layout on different
    GPUs is a different scheme with its own profile, `strategy.mixed`)."""

    tp: int
    pp: int
    gpu: str = ""

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}PP{self.pp}" + (f"@{self.gpu}" if self.gpu else "")


def scheme_space(model: ModelSpec, num_gpus: int, *, max_tp: int = 8) -> list[ParallelScheme]:
    """The scheme space of §5.1: TP dividing the heads, K/V groups and FFN width (at most
    `max_tp`, one NVLink island), PP dividing the layer count, TP x PP <= N."""
    if num_gpus < 1:
        raise PlanningError(f"scheme space needs at least one GPU, got {num_gpus}")
    layers = model.num_layers
    schemes = [
        ParallelScheme(tp, pp)
        for tp in range(1, min(max_tp, num_gpus) + 1)
        if model.supports_tp(tp)
        for pp in range(1, layers + 1)
        if layers % pp == 0 and tp * pp <= num_gpus
    ]
    return sorted(schemes)


@dataclass(frozen=True)
class SchemeProfile:
    """MaxLen, UtilLen and T(l) of one scheme, with the samples T was fitted to."""

    scheme: ParallelScheme
    max_len: int
    util_len: int
    coef: tuple[float, float, float]  # T(l) ~ coef[0] * l^2 + coef[1] * l + coef[2]
    lengths: np.ndarray = field(repr=False)  # sampled lengths up to max_len
    stage_times: np.ndarray = field(repr=False)  # busiest stage's forward+backward seconds
    latency: str = "fit"

    def time(self, lengths: np.ndarray | float) -> np.ndarray:
        """T(l, P) in seconds, from the fit or the sampled curve (`latency`)."""
        x = np.asarray(lengths, dtype=np.float64)
        if self.latency == "table":
            return np.interp(x, self.lengths, self.stage_times)
        a, b, c = self.coef
        return (a * x + b) * x + c

    def packed_time(self, lengths: np.ndarray | float) -> np.ndarray:
        """T(l, P) of a sequence that shares a packed row: below UtilLen a sequence alone
        runs small, inefficient kernels, but packed with others it costs its share l / U of
        a UtilLen row's T(U); from UtilLen up, packing gains nothing and it costs T(l)."""
        x = np.asarray(lengths, dtype=np.float64)
        util = float(self.util_len)
        return np.where(x < util, x * (self.time(util) / util), self.time(x))

    @property
    def fit_error(self) -> float:
        """Largest relative error of the quadratic fit over the sampled lengths."""
        a, b, c = self.coef
        fitted = (a * self.lengths + b) * self.lengths + c
        return float(np.max(np.abs(fitted / self.stage_times - 1.0)))


def profile_scheme(
    scheme: ParallelScheme,
    costs: PipelineCosts,
    *,
    length_step: int = 128,
    util_threshold: float = 0.85,
    latency: str = "fit",
) -> SchemeProfile:
    """Profile `scheme` from its pipeline cost tables (`costs` has `scheme.pp` stages).

    Lengths are sampled every `length_step` tokens up to the table's longest sequence; a
    scheme whose static memory or shortest micro-batch does not fit gets MaxLen 0.
    """
    if latency not in LATENCY_MODES:
        raise PlanningError(f"latency must be one of {LATENCY_MODES}, got {latency!r}")
    if costs.num_stages != scheme.pp:
        raise PlanningError(f"{scheme}: cost tables have {costs.num_stages} stages")
    top = int(costs.s_grid[-1])
    lengths = np.arange(length_step, top + 1, length_step, dtype=np.float64)
    ones = np.ones_like(lengths)
    fwd, bwd, act, tra = costs.stage_costs_many(ones, lengths, np.zeros_like(lengths))
    inflight = np.arange(scheme.pp, 0, -1, dtype=np.float64)  # 1F1B: PP - j on stage j
    free = costs.memory_limit - costs.static
    fits = np.isfinite(fwd).all(axis=1) & np.all(act * inflight + tra <= free, axis=1)
    count = len(fits) if fits.all() else int(np.argmin(fits))  # fits is monotone in length
    if count == 0:
        return SchemeProfile(scheme, 0, 0, (0.0, 0.0, 0.0), lengths[:0], lengths[:0], latency)
    lengths = lengths[:count]
    times = (fwd + bwd)[:count].max(axis=1)
    rate = lengths / times
    util_len = int(lengths[np.argmax(rate >= util_threshold * rate.max())])
    return SchemeProfile(
        scheme, int(lengths[-1]), util_len, _fit_quadratic(lengths, times), lengths, times, latency
    )


def _fit_quadratic(lengths: np.ndarray, times: np.ndarray) -> tuple[float, float, float]:
    """a*l^2 + b*l + c minimising relative squared error (App. B.2); fewer than three samples
    get the line or constant through them."""
    degree = min(2, len(lengths) - 1)
    basis = np.vander(lengths, degree + 1) / times[:, None]
    solution = np.linalg.lstsq(basis, np.ones_like(times), rcond=None)[0]
    return tuple(float(x) for x in np.concatenate([np.zeros(2 - degree), solution]))


@dataclass(frozen=True)
class AnalyticSchemeModels:
    """The analytic cost model of each scheme's pipeline as Hydraulis's memory model sees it
    (App. B.1): flash attention and sequence parallelism (activations linear in length and
    split over TP) and optimiser states sharded over `num_gpus`. Picklable, so planner worker
    processes rebuild the same models."""

    model: ModelSpec
    gpu: GpuSpec
    num_gpus: int
    gpus_per_node: int = 8
    memory_limit_bytes: int = 0

    def __call__(self, scheme: ParallelScheme) -> AnalyticCostModel:
        cluster = ClusterSpec(
            self.gpu,
            num_stages=scheme.pp,
            num_replicas=max(1, self.num_gpus // scheme.num_gpus),
            tp=scheme.tp,
            gpus_per_node=self.gpus_per_node,
            memory_limit_bytes=self.memory_limit_bytes,
        )
        return AnalyticCostModel(
            self.model,
            cluster,
            flash_attention=True,
            distributed_optimizer=True,
            sequence_parallel=True,
        )


def analytic_scheme_models(
    model: ModelSpec,
    gpu: GpuSpec,
    num_gpus: int,
    *,
    gpus_per_node: int = 8,
    memory_limit_bytes: int = 0,
) -> AnalyticSchemeModels:
    """`AnalyticSchemeModels` of `model` on `num_gpus` GPUs of type `gpu`."""
    return AnalyticSchemeModels(model, gpu, num_gpus, gpus_per_node, memory_limit_bytes)


def scheme_tables(
    cost_model_of: Callable[[ParallelScheme], CostModel], max_len: int, recompute: str = "none"
) -> Callable[[ParallelScheme], PipelineCosts]:
    """Single-sequence cost tables up to `max_len` tokens, what `profile_scheme` reads."""
    return lambda s: cost_model_of(s).pipeline_costs(recompute, max_samples=1, max_seqlen=max_len)


def profile_schemes(
    schemes: list[ParallelScheme],
    costs_of: Callable[[ParallelScheme], PipelineCosts],
    **options: object,
) -> list[SchemeProfile]:
    """Profiles of the schemes that can hold at least one micro-batch; an error naming every
    scheme when none can."""
    if not schemes:
        raise PlanningError("empty scheme space: no TP x PP layout fits the GPUs and the model")
    profiles = [profile_scheme(s, costs_of(s), **options) for s in schemes]
    usable = [p for p in profiles if p.max_len > 0]
    if not usable:
        names = ", ".join(str(s) for s in schemes)
        raise PlanningError(f"no scheme fits in memory even for short sequences: {names}")
    return usable
