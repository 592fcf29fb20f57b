"""Profiled cost model: measured per-layer tables, linearly interpolated (DynaPipe seed
dynapipe.txt §3 "Cost models": profile forward/backward time and memory at power-of-two
micro-batch sizes and sequence lengths per TP degree, interpolate in between).

File format (JSON, documented in docs/architecture.md "Cost tables"):

    {"format": "dynapipe-cost-table", "version": 1, "device": "A100-80GB", "dtype": "bf16",
     "entries": [{"tp": 1, "recompute": "none", "component": "decoder_layer",
                  "microbatch_sizes": [1, 2, 4], "seqlens": [128, 256, 512],
                  "forward_s": [[...], ...], "backward_s": [[...]],
                  "activation_bytes": [[...]], "transient_bytes": [[...]],
                  "static_bytes": 123456789}, ...]}

A table whose passes were timed in CPU seconds (`"profile": {"clock": "cpu"}`: one rank's work
on one core) is read with each sequence length's times as the least-squares line over the
micro-batch sizes, `time(b) = per micro-batch + per sample x b` (`affine_time`): on one core a
layer's work is that line, and the line averages out what single points carry of the machine's
noise (on the shared 2-core CPU one decoder point read 1.3x its neighbours' per-sample time, and
the planner chose micro-batches of that size for it).

Components: `decoder_layer` (and `encoder_layer` for encoder-decoder models), `embedding` (first
stage) and `lm_head` (last stage, with the loss). Values are indexed [microbatch size][seqlen]
(plus [tgt seqlen] with a `tgt_seqlens` grid for encoder-decoder decoder entries); `null` marks a
point that could not run (out of memory) and is infeasible. All entries of one (tp, recompute)
share one grid. Shapes past the grid are infeasible, never extrapolated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cluster import ClusterSpec, cluster_to_dict
from ..errors import PlanningError
from ..input_files import load_json_file
from ..model_spec import ModelSpec
from .stages import assemble_pipeline
from .table import PipelineCosts

FORMAT = "dynapipe-cost-table"
FIELDS = ("forward_s", "backward_s", "activation_bytes", "transient_bytes")


@dataclass(frozen=True)
class ProfiledCostModel:
    """Stage costs assembled from measured layer tables for `cluster.tp`."""

    model: ModelSpec
    cluster: ClusterSpec
    entries: tuple[dict[str, Any], ...]
    source: str = "cost table"
    dtype: str = "bf16"
    device: str = "unknown device"  # the table's own word for what it measured
    cpu_clock: bool = False  # passes timed in CPU seconds: times read as lines over b

    @classmethod
    def load(cls, path: str | Path, model: ModelSpec, cluster: ClusterSpec) -> ProfiledCostModel:
        path = Path(path)
        data = load_json_file(path, "cost table", kind=None)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
            raise PlanningError(f"cost table {path}: expected format {FORMAT!r} version 1")
        entries = data.get("entries")
        if not isinstance(entries, list) or not entries:
            raise PlanningError(f"cost table {path}: 'entries' must be a non-empty list")
        device = str(data.get("device", "unknown device"))
        profile = data.get("profile")
        cpu_clock = isinstance(profile, dict) and profile.get("clock") == "cpu"
        dtype = data.get("dtype", "bf16")
        return cls(model, cluster, tuple(entries), str(path), dtype, device, cpu_clock)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "profiled",
            "path": self.source,
            "device": self.device,
            "model": self.model.to_dict(),
            "cluster": cluster_to_dict(self.cluster),
        }

    def recompute_modes(self) -> list[str]:
        modes = {e.get("recompute") for e in self.entries if e.get("tp") == self.cluster.tp}
        return [m for m in ("none", "selective", "full") if m in modes]

    def _entry(self, component: str, recompute: str) -> dict[str, Any]:
        for e in self.entries:
            if (e.get("tp"), e.get("recompute"), e.get("component")) == (
                self.cluster.tp,
                recompute,
                component,
            ):
                return e
        have = sorted({f"tp={e.get('tp')}/{e.get('recompute')}" for e in self.entries})
        raise PlanningError(
            f"{self.source}: no entry for tp={self.cluster.tp}, recompute={recompute}, "
            f"component={component}; it has {', '.join(have)}"
        )

    def _arrays(self, e: dict[str, Any], nb: int, ns: int, nt: int) -> list[np.ndarray]:
        where = f"{self.source} entry tp={e['tp']}/{e['recompute']}/{e['component']}"
        out = []
        for name in FIELDS:
            if name not in e:
                raise PlanningError(f"{where}: missing {name!r}")
            raw = e[name]
            try:
                arr = np.array(raw, dtype=np.float64)  # null -> nan
            except (TypeError, ValueError) as err:
                raise PlanningError(f"{where}: {name} is not a numeric table") from err
            if arr.ndim == 2:
                arr = np.repeat(arr[:, :, None], nt, axis=2)
            if arr.shape != (nb, ns, nt):
                raise PlanningError(
                    f"{where}: {name} has shape {arr.shape}, grid is {(nb, ns, nt)}"
                )
            if np.any(arr[np.isfinite(arr)] < 0):
                raise PlanningError(f"{where}: {name} has negative values")
            if self.cpu_clock and name in ("forward_s", "backward_s"):
                arr = _lines_over_b(arr, np.array(e["microbatch_sizes"], dtype=np.float64))
            out.append(np.where(np.isnan(arr), np.inf, arr))
        return out

    def pipeline_costs(self, recompute: str = "none", **_grid_hints: int) -> PipelineCosts:
        """Stage tables on the profiled grid (grid hints are for the analytic model)."""
        m = self.model
        decoder = self._entry("decoder_layer", recompute)
        b_grid = np.array(decoder["microbatch_sizes"], dtype=np.float64)
        s_grid = np.array(decoder["seqlens"], dtype=np.float64)
        t_grid = np.array(decoder.get("tgt_seqlens", [0]), dtype=np.float64)
        if m.is_encoder_decoder and len(t_grid) < 2:
            raise PlanningError(f"{self.source}: encoder-decoder decoder_layer needs tgt_seqlens")
        components = {
            "decoder": decoder,
            "embedding": self._entry("embedding", recompute),
            "lm_head": self._entry("lm_head", recompute),
        }
        if m.is_encoder_decoder:
            components["encoder"] = self._entry("encoder_layer", recompute)
        for name, e in components.items():
            if (
                e["microbatch_sizes"] != decoder["microbatch_sizes"]
                or e["seqlens"] != decoder["seqlens"]
            ):
                raise PlanningError(f"{self.source}: {name} grid differs from decoder_layer's grid")
        nb, ns, nt = len(b_grid), len(s_grid), len(t_grid)
        names = {
            "decoder": "decoder",
            "encoder": "encoder",
            "embedding": "embedding",
            "lm_head": "output",
        }
        parts = {names[k]: tuple(self._arrays(e, nb, ns, nt)) for k, e in components.items()}
        last = self.cluster.num_stages - 1

        def stage_static(kinds: list[str], j: int) -> float:
            extra = [
                k
                for k, first_or_last in (("embedding", j == 0), ("lm_head", j == last))
                if first_or_last
            ]
            return float(sum(components[k]["static_bytes"] for k in [*kinds, *extra]))

        return assemble_pipeline(
            m,
            self.cluster,
            (b_grid, s_grid, t_grid),
            parts,
            stage_static,
            lambda _layout, total: _fit_attention(total, s_grid),
            recompute,
            self.dtype,
        )


def affine_time(rows: list[tuple[int, float]]) -> tuple[float, float]:
    """(per micro-batch, per sample): the least-squares line through measured (micro-batch
    size, time) points, both >= 0: a negative intercept gives the line through the origin, a
    negative slope the mean, per micro-batch."""
    sizes = np.array([b for b, _ in rows], dtype=np.float64)
    times = np.array([t for _, t in rows], dtype=np.float64)
    if len(set(sizes)) < 2:
        return 0.0, float(times @ sizes / (sizes @ sizes))
    slope, intercept = np.polyfit(sizes, times, 1)
    if intercept < 0:
        return 0.0, float(times @ sizes / (sizes @ sizes))
    if slope < 0:
        return float(times.mean()), 0.0
    return float(intercept), float(slope)


def _lines_over_b(times: np.ndarray, b_grid: np.ndarray) -> np.ndarray:
    """`times` [b, s, t] with each (s, t) column's measured points replaced by `affine_time`'s
    line over b; points not measured (NaN) stay so."""
    out = times.copy()
    for k in np.ndindex(times.shape[1:]):
        column = times[(slice(None), *k)]
        measured = np.isfinite(column)
        if measured.any():
            fixed, per_sample = affine_time(
                list(zip(b_grid[measured], column[measured], strict=True))
            )
            out[(measured, *k)] = fixed + per_sample * b_grid[measured]
    return out


def _fit_attention(total: np.ndarray, s_grid: np.ndarray) -> np.ndarray:
    """Quadratic coefficient of a*s^2 + b*s + c fitted to each stage's single-sample times:
    the part of the cost that grows with the square of the sequence length (attention)."""
    coef = np.zeros(total.shape[0])
    for j in range(total.shape[0]):
        row = total[j, 0, :, 0]
        ok = np.isfinite(row)
        if ok.sum() >= 3:
            coef[j] = max(0.0, float(np.polyfit(s_grid[ok], row[ok], 2)[0]))
    return coef
