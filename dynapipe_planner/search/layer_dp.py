"""Layer DP of Galvatron-BMW (seed `galvatron_bmw.txt` §IV-A2, Eq. 4, App. A, Algorithm 3).

C(l, E_fwd) is the least time of the first l layers of a stage whose forward memory
(activations kept for backward, times micro-batches in flight, plus model states) fits in
E_fwd, with the transformation cost R between neighbouring layers' strategies; because R
depends on the previous layer's strategy, the state also carries it. Memory is discretised
into bins (weights rounded to the nearest bin, see `solve_stage`). Algorithm 3 then takes the
largest E_fwd whose plan also passes the exact Eq. 2 check (forward memory plus the backward
peak); plans with E_fwd low enough to fit whatever the rounding pass by construction.

`_reference.layer_dp.layer_dp_reference` is the plain-Python statement of that algorithm; the
C++ core (`csrc/layer_dp.cpp`) does the same arithmetic in the same order, breaks ties the same way,
and the tests hold them to identical answers. `StageSolver` keeps one C++ DP per pipeline
position and answers every prefix length from it (the DP of n layers is the first n steps of
the DP of more), again identical to the reference run on that range alone.

Two refinements over the plain recurrence, both exact in value:

* previous strategies whose transformation rows R(l, p, .) are identical (the same activation
  layout: DP and SDP of one degree, with and without CKPT) form a class, and the minimum over
  p is taken as a minimum over classes of the class's least C(l - 1, e, p) plus the shared R.
  Rounding is monotone, so the values equal the per-strategy minimum; the work per state drops
  from |S| to the number of layouts (28 strategies, 7 layouts on 64 GPUs);
* ties: a layer keeps the previous layer's strategy when that costs at most `TIE_REL`
  (relative) more than the best predecessor; otherwise the lowest index of the best class
  wins. Equal-cost plans then come out as runs of one strategy (e.g. 8xSDP8, 16xDP8 rather
  than an arbitrary mix) that map onto per-stage Megatron flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _core
from .estimator import StageTables, stage_fwd_bytes

INF = float("inf")


@dataclass(frozen=True)
class StagePlan:
    """The layer DP's answer for one stage: strategy index per layer, its objective, the
    forward budget (bins) it was found at and its Eq. 2 peak memory."""

    objective: float
    chosen: list[int]
    forward_bins: int
    peak_bytes: float


TIE_REL = 1e-13  # a layer keeps the previous layer's strategy within this relative cost


def _peak(fwd, bwd, states, chosen) -> float:
    running = peak = total = 0.0
    for layer, j in enumerate(chosen):
        running += fwd[layer][j]
        here = running + bwd[layer][j]
        if here > peak:
            peak = here
        total += states[layer][j]
    return peak + total


# No budget has this many bins: a weight above it fits nowhere, and weights clipped to it add
# up over any number of layers without overflowing int64 in the C++ DP.
_MAX_WEIGHT_BINS = 2**40


def memory_weights(tables: StageTables, granularity: float) -> np.ndarray:
    """Forward memory of each (layer, strategy) in bins, rounded to the nearest bin, at most
    `_MAX_WEIGHT_BINS` (an absurd sequence length prices memory past int64, and a wrapped
    weight would send the C++ DP out of its table)."""
    raw = np.floor((stage_fwd_bytes(tables) + tables.state_bytes) / granularity + 0.5)
    raw = np.where(np.isfinite(raw), raw, _MAX_WEIGHT_BINS)
    capped = np.clip(raw, 0, _MAX_WEIGHT_BINS)
    return np.where(np.isfinite(tables.objective), capped, 0).astype(np.int64)


def _budget_bins(limit: float, memory_budget: float, granularity: float) -> int:
    """Forward budget of the DP table in bins: the limit plus 1/32 of the budget's bins, so
    plans whose nearest-bin weights add up a little over the limit still get the exact
    check (the accumulated rounding of n layers is about sqrt(n) / 3.5 bins)."""
    return math.floor(limit / granularity) + max(2, math.ceil(memory_budget / granularity / 32))


def _unchecked_bins(limit: float, b_up: float, layers: int, granularity: float) -> int:
    """Plans at forward budgets up to this many bins fit whatever the rounding: their real
    forward memory is at most half a bin per layer above their bins, plus b_up."""
    safe = (limit - b_up) / granularity - layers / 2
    return math.floor(safe) if safe >= 0 else -1


def solve_stage(tables: StageTables, memory_budget: float, granularity: float) -> StagePlan | None:
    """Best strategies of one stage's layers within `memory_budget` bytes (None: nothing fits).

    Weights are rounded to the nearest bin, so a plan's binned forward memory is within half
    a bin per layer of its real one: the DP table runs a few bins past the budget, every plan
    above the provably safe forward budget gets Algorithm 3's exact Eq. 2 check, and a
    returned plan always fits. Rounding every weight up instead would lose up to a bin per
    layer and miss plans that fill the budget (a 6-layer stage 0.5 GiB short of 24.6 GiB).
    """
    return StageSolver(tables, memory_budget, granularity).solve(len(tables.objective))


class StageSolver:
    """`solve_stage` for every prefix of `tables`' layers from one DP (C++): the layer DP of
    n layers is the first n steps of the DP of more, so the stages of one pipeline position
    that start at the same layer, or in a model of identical layers all of them, share it."""

    def __init__(self, tables: StageTables, memory_budget: float, granularity: float):
        self.tables = tables
        self.fwd_bytes = stage_fwd_bytes(tables)
        self.granularity = granularity
        self.limit = memory_budget - tables.extra_bytes
        self._dp = None
        if self.limit < 0:
            return
        finite = np.isfinite(tables.objective)
        self._b_up = np.maximum.accumulate(np.max(np.where(finite, tables.bwd_bytes, 0.0), axis=1))
        self._dp = _core.PrefixLayerDP(
            np.where(finite, tables.objective, INF),
            memory_weights(tables, granularity),
            tables.transform,
            self.fwd_bytes,
            tables.bwd_bytes,
            tables.state_bytes,
            _budget_bins(self.limit, memory_budget, granularity),
        )

    def solve(self, layers: int) -> StagePlan | None:
        """The plan of the first `layers` layers (None: nothing fits)."""
        if self._dp is None:
            return None
        b_up = float(self._b_up[layers - 1])
        unchecked = _unchecked_bins(self.limit, b_up, layers, self.granularity)
        cost, chosen, e = self._dp.solve(layers, self.limit, unchecked)
        if not chosen or not cost < INF:
            return None
        t = self.tables
        fwd = self.fwd_bytes[:layers]
        peak = _peak(fwd, t.bwd_bytes[:layers], t.state_bytes[:layers], chosen)
        return StagePlan(cost, list(chosen), e, peak + t.extra_bytes)
