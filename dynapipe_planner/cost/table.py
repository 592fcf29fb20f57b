"""`PipelineCosts`: the one cost contract every planner stage reads.

A cost model (analytic or profiled) is turned into per-stage tables over a grid of
micro-batch shapes (samples b, sequence length s, target length t for encoder-decoder models),
linearly interpolated between grid points. Beyond the largest grid point a shape is infeasible,
never extrapolated; below the smallest sequence length it costs as much as the smallest point.
The same arrays are handed to the C++ core, which interpolates them with the same arithmetic
(`lerp` below), so C++ and the Python references agree bit for bit.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from ..errors import PlanningError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def locate(grid: np.ndarray | list[float], x: float) -> tuple[int, float] | None:
    """Cell of `x` on an increasing grid: (k, w) with grid[k] <= x < grid[k+1], w in [0, 1).

    Below the grid clamps to (0, 0.0); above the last point returns None (infeasible).
    The C++ core implements exactly this rule.
    """
    n = len(grid)
    if x <= grid[0]:
        return 0, 0.0
    if x > grid[n - 1]:
        return None
    k = bisect.bisect_right(grid, x) - 1
    if k >= n - 1:
        return n - 1, 0.0
    return k, (x - grid[k]) / (grid[k + 1] - grid[k])


def _locate_many(grid: np.ndarray, x: np.ndarray):
    """`locate` for an array: cell indices, weights and an in-grid mask."""
    n = len(grid)
    k = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, n - 1)
    upper = np.minimum(k + 1, n - 1)
    span = grid[upper] - grid[k]
    w = np.where((x <= grid[0]) | (k >= n - 1), 0.0, (x - grid[k]) / np.where(span > 0, span, 1.0))
    return k, w, x <= grid[n - 1]


def _lerp_many(a: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`lerp` along the last axis of `a` and `b` (one weight per column): a where w == 0."""
    if not w.any():
        return a
    with np.errstate(invalid="ignore"):
        mixed = np.where(np.isinf(a) | np.isinf(b), np.inf, a + w * (b - a))
    return np.where(w == 0.0, a, mixed)


def lerp(a: float, b: float, w: float) -> float:
    """Linear interpolation that never touches `b` at w == 0 and keeps infinities infinite."""
    if w == 0.0:
        return a
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return a + w * (b - a)


def interp3(
    table: np.ndarray, cb: tuple[int, float], cs: tuple[int, float], ct: tuple[int, float]
) -> float:
    """Trilinear interpolation of table[b, s, t] in the order t, then s, then b."""
    (kb, wb), (ks, ws), (kt, wt) = cb, cs, ct

    def along_t(ib: int, js: int) -> float:
        v0 = float(table[ib, js, kt])
        return v0 if wt == 0.0 else lerp(v0, float(table[ib, js, kt + 1]), wt)

    def along_s(ib: int) -> float:
        v0 = along_t(ib, ks)
        return v0 if ws == 0.0 else lerp(v0, along_t(ib, ks + 1), ws)

    v0 = along_s(kb)
    return v0 if wb == 0.0 else lerp(v0, along_s(kb + 1), wb)


def attention_forward_share(recompute: str) -> float:
    """The share of a micro-batch's attention time spent in its forward pass: a third (its
    backward does twice the forward's work), a quarter where the backward pass recomputes
    the attention first (selective or full recomputation)."""
    return 1 / 4 if recompute in ("selective", "full") else 1 / 3


@dataclass
class StageCosts:
    """Costs of one micro-batch on every stage (arrays of length num_stages)."""

    forward: np.ndarray
    backward: np.ndarray
    activation: np.ndarray
    transient: np.ndarray

    @property
    def feasible(self) -> bool:
        return bool(np.all(np.isfinite(self.forward)))


@dataclass
class PipelineCosts:
    """Per-stage cost tables of one pipeline (one TP degree; one recompute mode, or one per
    stage after `mix_stages`).

    forward/backward are seconds, activation is the bytes a micro-batch keeps from its forward
    to its backward pass, transient the extra bytes at the peak of either pass; all of shape
    (num_stages, len(b_grid), len(s_grid), len(t_grid)). `static` is each stage's bytes for
    weights, gradients and optimiser state. `attention_coef` is each stage's forward+backward
    seconds per sample per token^2 of self-attention (the packing baseline subtracts the
    attention between unrelated packed samples with it). `boundary_seq` tells, per stage
    boundary, whether the activation sent carries the source sequence, the target sequence or
    both (encoder-decoder pipelines), used for communication shapes.
    """

    b_grid: np.ndarray
    s_grid: np.ndarray
    t_grid: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    activation: np.ndarray
    transient: np.ndarray
    static: np.ndarray
    attention_coef: np.ndarray
    hidden_size: int
    memory_limit: float | np.ndarray  # bytes per GPU, or per stage (`stage_memory_limits`)
    p2p_bandwidth: np.ndarray
    p2p_latency: float
    recompute: str | tuple[str, ...] = "none"
    dtype: str = "bf16"
    boundary_seq: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        shape = (self.num_stages, len(self.b_grid), len(self.s_grid), len(self.t_grid))
        for name in ("forward", "backward", "activation", "transient"):
            arr = np.ascontiguousarray(getattr(self, name), dtype=np.float64)
            if arr.shape != shape:
                raise PlanningError(f"cost table {name}: shape {arr.shape}, expected {shape}")
            if np.isnan(arr).any():  # NaN would poison the DP's max-accumulated tables silently
                raise PlanningError(f"cost table {name} contains NaN (use inf for infeasible)")
            setattr(self, name, arr)
        for name in ("b_grid", "s_grid", "t_grid"):
            grid = np.ascontiguousarray(getattr(self, name), dtype=np.float64)
            if len(grid) == 0 or np.any(np.diff(grid) <= 0):
                raise PlanningError(f"cost table {name} must be non-empty and strictly increasing")
            setattr(self, name, grid)
        if self.b_grid[0] != 1:
            raise PlanningError("cost table microbatch-size grid must start at 1")
        if not self.boundary_seq:
            self.boundary_seq = ("src",) * (self.num_stages - 1)
        self._grids = (self.b_grid.tolist(), self.s_grid.tolist(), self.t_grid.tolist())

    @property
    def num_stages(self) -> int:
        return len(self.static)

    def stage_memory_limits(self) -> np.ndarray:
        """Bytes each stage's GPUs may use: one limit for all, or one per stage when the
        stages sit on different GPU types (`hetero.pipeline_costs`)."""
        return np.broadcast_to(np.asarray(self.memory_limit, dtype=np.float64), self.static.shape)

    @property
    def encoder_decoder(self) -> bool:
        return len(self.t_grid) > 1

    def available_memory(self) -> np.ndarray:
        """Bytes per stage left for activations after static memory; errors if none is left."""
        limit = self.stage_memory_limits()
        avail = limit - self.static
        for stage, a in enumerate(avail):
            if a <= 0:
                raise PlanningError(
                    f"stage {stage}: weights, gradients and optimiser state need "
                    f"{_gib(self.static[stage])} GiB, more than the memory limit of "
                    f"{_gib(limit[stage])} GiB; use more pipeline stages or TP"
                )
        return avail

    def cells(self, b: float, s: float, t: float = 0.0):
        """Grid cells of a shape, or None when it lies beyond the grid (infeasible)."""
        cb = locate(self._grids[0], b)
        cs = locate(self._grids[1], s)
        ct = locate(self._grids[2], t)
        if cb is None or cs is None or ct is None:
            return None
        return cb, cs, ct

    def stage_costs(self, b: int, s: int, t: int = 0) -> StageCosts:
        """Interpolated costs of a micro-batch of b samples padded to (s, t), per stage."""
        c = self.num_stages
        cells = self.cells(b, s, t)
        if cells is None:
            inf = np.full(c, np.inf)
            return StageCosts(inf, inf.copy(), inf.copy(), inf.copy())
        out = [
            np.array([interp3(getattr(self, name)[j], *cells) for j in range(c)])
            for name in ("forward", "backward", "activation", "transient")
        ]
        return StageCosts(*out)

    def stage_costs_many(self, b: np.ndarray, s: np.ndarray, t: np.ndarray | None = None):
        """Vectorised `stage_costs` for many micro-batches: four arrays shaped (M, num_stages),
        bit-identical to the scalar path (same cells, same lerp; the four tables are gathered
        together, and an axis no shape lies between grid points of is not interpolated)."""
        b = np.asarray(b, dtype=np.float64)
        s = np.asarray(s, dtype=np.float64)
        t = np.zeros_like(b) if t is None else np.asarray(t, dtype=np.float64)
        (kb, wb, okb), (ks, ws, oks), (kt, wt, okt) = (
            _locate_many(g, x) for g, x in ((self.b_grid, b), (self.s_grid, s), (self.t_grid, t))
        )
        ok = okb & oks & okt
        tables = self._stacked  # (4, C, nb, ns, nt)

        def along_t(ib: np.ndarray, js: np.ndarray) -> np.ndarray:  # (4, C, M)
            upper = np.minimum(kt + 1, len(self.t_grid) - 1)
            return _lerp_many(tables[:, :, ib, js, kt], tables[:, :, ib, js, upper], wt)

        def along_s(ib: np.ndarray) -> np.ndarray:
            upper = np.minimum(ks + 1, len(self.s_grid) - 1)
            return _lerp_many(along_t(ib, ks), along_t(ib, upper), ws)

        upper = np.minimum(kb + 1, len(self.b_grid) - 1)
        value = _lerp_many(along_s(kb), along_s(upper), wb)
        value = np.where(ok[None, None, :], value, np.inf).transpose(0, 2, 1)
        return tuple(np.ascontiguousarray(v) for v in value)

    @cached_property
    def _stacked(self) -> np.ndarray:
        """The forward, backward, activation and transient tables in one array, so one index
        gathers all four."""
        return np.stack([self.forward, self.backward, self.activation, self.transient])

    def dp_tables(self, inflight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tables the micro-batching DP reads: bottleneck time and memory-use ratio per shape.

        time = max over stages of forward + backward; memory ratio = max over stages of
        (inflight[j] * activation + transient) / available memory, feasible when <= 1, where
        inflight[j] is how many micro-batches' activations the schedule may hold on stage j.
        Interpolating the max over stages is conservative for memory (max is convex).
        """
        avail = self.available_memory()
        time = np.max(self.forward + self.backward, axis=0)
        k = np.asarray(inflight, dtype=np.float64).reshape(-1, 1, 1, 1)
        ratio = np.max((k * self.activation + self.transient) / avail.reshape(-1, 1, 1, 1), axis=0)
        return np.ascontiguousarray(time), np.ascontiguousarray(ratio)

    def stage_recompute(self) -> tuple[str, ...]:
        """Each stage's recomputation mode."""
        if isinstance(self.recompute, str):
            return (self.recompute,) * self.num_stages
        return tuple(self.recompute)

    def packed_times(
        self,
        forward: np.ndarray,
        backward: np.ndarray,
        rows: np.ndarray,
        seq: np.ndarray,
        saved: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(M, C) forward and backward times of M micro-batches of `rows` x `seq` tokens
        (`forward`, `backward`: the tables' times at that shape) whose per-sample boundaries
        skip `saved` tokens^2 of attention (packed rows, seed hydraulis.txt §6.1).

        Two prices, the lower taken: the tables' time less the skipped attention at
        `attention_coef`, split between the passes as `attention_forward_share` says; and the
        tables' own time at the shape of equal tokens and equal attention work, b' x s' with
        b' s' = rows x seq and b' s'^2 = rows x seq^2 - saved (a table point is b' sequences
        of s' tokens, each attending within itself: the work a packed row does, measured
        rather than extrapolated; beyond the grid it is infinite). The first is at most the
        tables' time of the same rows, so a packed price is never above the same samples
        padded, and neither is below zero. On this CPU the second was within 4% (median) of
        the measured passes of 4,096-token rows, where the coefficient's price was 14% over
        and up to 60% over for rows of short samples."""
        saved = np.asarray(saved, dtype=np.float64)
        share = np.array([attention_forward_share(m) for m in self.stage_recompute()])
        cut = saved[:, None] * self.attention_coef[None, :]
        forward, backward = forward - cut * share, backward - cut * (1 - share)
        packed = np.flatnonzero(saved > 0)
        if len(packed):
            length = np.asarray(seq, dtype=np.float64)[packed]
            tokens = np.asarray(rows, dtype=np.float64)[packed] * length
            # At least 1 (each token attends to itself); rounding at absurd lengths gives 0.
            s_eq = np.maximum((tokens * length - saved[packed]) / tokens, 1.0)
            equal_f, equal_b, _, _ = self.stage_costs_many(tokens / s_eq, s_eq)
            forward[packed] = np.minimum(forward[packed], equal_f)
            backward[packed] = np.minimum(backward[packed], equal_b)
        return forward, backward

    def boundary_shape(self, stage: int, b: int, s: int, t: int = 0) -> list[int]:
        """[b, seq, hidden] of the activation stage `stage` sends to `stage + 1`.

        Encoder-decoder boundaries after the first decoder layer carry the encoder output and
        the decoder hidden states concatenated along the sequence dimension.
        """
        kind = self.boundary_seq[stage]
        seq = {"src": s, "tgt": t, "both": s + t}[kind]
        return [b, seq, self.hidden_size]

    def p2p_times(self, b: np.ndarray, s: np.ndarray, t: np.ndarray) -> np.ndarray:
        """`p2p_time` of many micro-batches across every boundary, shaped (M, num_stages - 1)."""
        b, s, t = (np.asarray(x, dtype=np.float64)[:, None] for x in (b, s, t))
        seq = {"src": s, "tgt": t, "both": s + t}
        tokens = (
            np.hstack([b * seq[kind] for kind in self.boundary_seq])
            if self.boundary_seq
            else b[:, :0]
        )
        nbytes = tokens * self.hidden_size * DTYPE_BYTES[self.dtype]
        return self.p2p_latency + nbytes / self.p2p_bandwidth[None, :]

    def p2p_time(self, stage: int, shape: list[int]) -> float:
        nbytes = math.prod(shape) * DTYPE_BYTES[self.dtype]
        return self.p2p_latency + nbytes / float(self.p2p_bandwidth[stage])


def mix_stages(tables: list[PipelineCosts]) -> PipelineCosts:
    """Stage j's rows taken from `tables[j]` (one pipeline's tables under different recompute
    modes, on one grid): the pipeline whose stages recompute differently, as a HexiScale plan
    chooses per stage (`hetero.cost`, `recompute="auto"`); `recompute` lists each stage's mode."""
    first = tables[0]
    if len(tables) != first.num_stages:
        raise PlanningError(f"{len(tables)} tables for {first.num_stages} stages")
    for j, t in enumerate(tables):
        if t.num_stages != first.num_stages or any(
            not np.array_equal(getattr(t, g), getattr(first, g))
            for g in ("b_grid", "s_grid", "t_grid")
        ):
            raise PlanningError(f"stage {j}: its table has another shape or grid than stage 0's")

    def rows(name: str) -> np.ndarray:
        return np.stack([getattr(t, name)[j] for j, t in enumerate(tables)])

    return replace(
        first,
        **{
            n: rows(n)
            for n in ("forward", "backward", "activation", "transient", "static", "attention_coef")
        },
        recompute=tuple(str(t.recompute) for t in tables),
    )


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: an even split whose remainder goes to the middle stages first,
    because the first and last stages also carry the embedding and the output layer."""
    if num_stages > num_layers:
        raise PlanningError(f"{num_stages} pipeline stages but only {num_layers} layers")
    counts = [num_layers // num_stages] * num_stages
    middle_first = sorted(range(num_stages), key=lambda j: (j in (0, num_stages - 1), j))
    for j in middle_first[: num_layers % num_stages]:
        counts[j] += 1
    return counts


def _gib(size: float) -> str:
    """Bytes in GiB, with two decimals, or three significant digits below 0.01 GiB (so a tiny
    limit does not read as 0.00)."""
    gib = size / 2**30
    return f"{gib:.2f}" if gib >= 0.01 else f"{gib:.3g}"
