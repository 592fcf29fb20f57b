"""From per-layer costs to per-stage tables: the assembly both cost models share.

A pipeline stage holds a contiguous run of layers (`split_layers`); the first stage also holds
the embedding and the last the output layer with the loss. Times and stored activations add up
over a stage's layers; transient memory does not (layers run one at a time), so it is the max.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..cluster import ClusterSpec
from ..errors import PlanningError
from ..model_spec import ModelSpec
from .table import PipelineCosts, attention_forward_share, split_layers

# (forward s, backward s, stored bytes, transient bytes), each an array over the (b, s, t) grid.
Parts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def stage_layout(
    model: ModelSpec, num_stages: int, layer_counts: Sequence[int] | None = None
) -> list[list[str]]:
    """Layer kinds ('encoder', 'decoder') of each stage, in pipeline order: `layer_counts`
    layers per stage (a HexiScale plan's uneven split), by default as even as possible."""
    kinds = model.layer_kinds()
    if layer_counts is None:
        layer_counts = split_layers(len(kinds), num_stages)
    if len(layer_counts) != num_stages or sum(layer_counts) != len(kinds) or min(layer_counts) < 1:
        raise PlanningError(
            f"layer counts {list(layer_counts)} do not split the {len(kinds)} layers of "
            f"{model.name} into {num_stages} non-empty stages"
        )
    layout, start = [], 0
    for n in layer_counts:
        layout.append(kinds[start : start + n])
        start += n
    return layout


def assemble_pipeline(
    model: ModelSpec,
    cluster: ClusterSpec,
    grids: tuple[np.ndarray, np.ndarray, np.ndarray],
    parts: dict[str, Parts],
    stage_static: Callable[[list[str], int], float],
    attention_coef: Callable[[list[list[str]], np.ndarray], np.ndarray],
    recompute: str,
    dtype: str,
    layer_counts: Sequence[int] | None = None,
) -> PipelineCosts:
    """`parts` maps 'encoder', 'decoder', 'embedding' and 'output' to their costs on `grids`;
    `stage_static(kinds, stage)` gives a stage's static bytes and `attention_coef(layout,
    forward + backward)` each stage's attention coefficient; `layer_counts` as in
    `stage_layout`."""
    c = cluster.num_stages
    layout = stage_layout(model, c, layer_counts)
    shape = (c, *(len(g) for g in grids))
    fwd, bwd, act, tra = (np.zeros(shape) for _ in range(4))
    boundary, seen_decoder = [], False
    for j, kinds in enumerate(layout):
        stage_parts = [parts[k] for k in kinds]
        if j == 0:
            stage_parts.append(parts["embedding"])
        if j == c - 1:
            stage_parts.append(parts["output"])
        for f, b, a, t in stage_parts:
            fwd[j] += f
            bwd[j] += b
            act[j] += a
            tra[j] = np.maximum(tra[j], t)
        seen_decoder = seen_decoder or "decoder" in kinds
        if j < c - 1:
            boundary.append("both" if model.is_encoder_decoder and seen_decoder else "src")
    return PipelineCosts(
        b_grid=grids[0],
        s_grid=grids[1],
        t_grid=grids[2],
        forward=fwd,
        backward=bwd,
        activation=act,
        transient=tra,
        static=np.array([stage_static(kinds, j) for j, kinds in enumerate(layout)]),
        attention_coef=bounded_attention_coef(
            attention_coef(layout, fwd + bwd), fwd, bwd, grids, attention_forward_share(recompute)
        ),
        hidden_size=model.hidden_size,
        memory_limit=float(cluster.memory_limit_bytes),
        p2p_bandwidth=np.array([cluster.p2p_bandwidth(j) for j in range(c - 1)]),
        p2p_latency=cluster.gpu.link_latency_s,
        recompute=recompute,
        dtype=dtype,
        boundary_seq=tuple(boundary),
    )


def bounded_attention_coef(
    coef: np.ndarray,
    forward: np.ndarray,
    backward: np.ndarray,
    grids: tuple[np.ndarray, np.ndarray, np.ndarray],
    forward_share: float,
) -> np.ndarray:
    """Each stage's attention coefficient, at most what its tables can give back: a packed
    micro-batch of r rows of L is priced at its table time less coef x the attention its
    per-sample boundaries skip, at most r x L^2 tokens^2, `forward_share` of it from the
    forward pass and the rest from the backward (`PipelineCosts.packed_times`). So
    coef x b x s^2 x share must stay within each pass's time at every grid point (b, s); linear
    interpolation between grid points keeps the bound (b x s^2 is linear in b and convex in s).
    A packed price is then never negative, whatever a fit or a profile gave."""
    b, s = np.meshgrid(grids[0], grids[1], indexing="ij")
    square = (b * s**2)[None, :, :, None]
    with np.errstate(invalid="ignore"):
        room = np.minimum(forward / forward_share, backward / (1 - forward_share)) / square
    bound = np.where(np.isfinite(room), room, np.inf).reshape(len(coef), -1).min(axis=1)
    return np.minimum(np.maximum(np.asarray(coef, dtype=np.float64), 0.0), bound)
