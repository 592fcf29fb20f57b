"""Per-layer strategy space of Galvatron-BMW: decision trees over DP, SDP and TP (seed
`galvatron_bmw.txt` §III-B).

PP is applied first and across the slowest links (Takeaway #1): stage `i` of `P` owns the
`N / P` consecutive GPUs `[i N/P, (i+1) N/P)`, so pipeline boundaries fall between nodes
whenever a stage fills whole nodes. Inside a stage, one decision tree is an ordered sequence of
distinct paradigms from {DP, SDP, TP} whose degrees (each >= 2) multiply to the group size
(Takeaway #2: equal-size groups); the order is the tree's levels from root to leaf. The leaf
level holds consecutive GPUs, each level above is strided by the product of the degrees below
it, so the node topology (GPUs per node) decides which groups stay on NVLink. Every tree comes
with and without activation checkpointing (CKPT). Takeaway #3 (never DP together with SDP)
prunes the space.

For 8 GPUs this gives the paper's 68 strategies before and 44 after pruning (see
tests/unit/test_search_space.py). Degrees are any divisors, not only powers of two, so 6 or 12 GPUs
get a space too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ..errors import PlanningError

PARADIGMS = ("dp", "sdp", "tp")


@dataclass(frozen=True, order=True)
class LayerStrategy:
    """One layer's parallel strategy inside a stage of `pp` pipeline stages.

    `order` names the paradigms of the decision tree from root (most strided) to leaf
    (consecutive GPUs); a paradigm of degree 1 is absent from it.
    """

    pp: int
    order: tuple[str, ...]
    degrees: tuple[int, ...]
    ckpt: bool

    def degree(self, paradigm: str) -> int:
        for p, d in zip(self.order, self.degrees, strict=True):
            if p == paradigm:
                return d
        return 1

    @property
    def tp(self) -> int:
        return self.degree("tp")

    @property
    def dp(self) -> int:
        return self.degree("dp")

    @property
    def sdp(self) -> int:
        return self.degree("sdp")

    @property
    def data_degree(self) -> int:
        """How many ways the micro-batch is split (DP and SDP both split samples)."""
        return self.dp * self.sdp

    @property
    def group_size(self) -> int:
        return self.tp * self.dp * self.sdp

    def stride(self, paradigm: str) -> int:
        """Distance in GPU ids between neighbours of `paradigm`'s groups (1: consecutive)."""
        stride = 1
        for p, d in zip(reversed(self.order), reversed(self.degrees), strict=True):
            if p == paradigm:
                return stride
            stride *= d
        return stride

    def __str__(self) -> str:
        parts = [f"PP{self.pp}"] if self.pp > 1 else []
        parts += [f"{p.upper()}{d}" for p, d in zip(self.order, self.degrees, strict=True)]
        name = "+".join(parts) or "single"
        return name + ("+CKPT" if self.ckpt else "")

    def to_dict(self) -> dict:
        return {
            "pp": self.pp,
            "tp": self.tp,
            "dp": self.dp,
            "sdp": self.sdp,
            "order": list(self.order),
            "ckpt": self.ckpt,
        }


@cache
def _ordered_factorizations(n: int, paradigms: tuple[str, ...]) -> tuple[tuple, ...]:
    """Every ordered way to write n as a product of degrees >= 2, one per distinct paradigm."""
    if n == 1:
        return ((),)
    out = []
    for i, p in enumerate(paradigms):
        rest = paradigms[:i] + paradigms[i + 1 :]
        for d in range(2, n + 1):
            if n % d == 0:
                out.extend(((p, d), *tail) for tail in _ordered_factorizations(n // d, rest))
    return tuple(out)


def decision_trees(group_size: int, pp: int = 1, *, prune: bool = True) -> list[LayerStrategy]:
    """All strategies of one stage's `group_size` GPUs, each with and without CKPT."""
    if group_size < 1:
        raise PlanningError(f"strategy space: group size must be >= 1, got {group_size}")
    trees = []
    for levels in _ordered_factorizations(group_size, PARADIGMS):
        order = tuple(p for p, _ in levels)
        if prune and "dp" in order and "sdp" in order:  # Takeaway #3
            continue
        trees.append((order, tuple(d for _, d in levels)))
    return [LayerStrategy(pp, o, d, ckpt) for ckpt in (False, True) for o, d in trees]


def pipeline_degrees(num_gpus: int, max_pp: int | None = None) -> list[int]:
    """PP degrees that split the GPUs into equal groups (Takeaway #2)."""
    if num_gpus < 1:
        raise PlanningError(f"strategy space: num_gpus must be >= 1, got {num_gpus}")
    limit = num_gpus if max_pp is None else min(num_gpus, max_pp)
    return [p for p in range(1, limit + 1) if num_gpus % p == 0]


def strategy_space(num_gpus: int, *, prune: bool = True) -> dict[int, list[LayerStrategy]]:
    """Per PP degree, the candidate layer strategies of its decision trees."""
    return {
        pp: decision_trees(num_gpus // pp, pp, prune=prune) for pp in pipeline_degrees(num_gpus)
    }


def group_crosses_nodes(
    strategy: LayerStrategy, paradigm: str, stage: int, gpus_per_node: int
) -> bool:
    """Whether any `paradigm` group of `strategy` on pipeline stage `stage` spans two nodes."""
    n = strategy.group_size
    degree, stride = strategy.degree(paradigm), strategy.stride(paradigm)
    if degree == 1:
        return False
    base = stage * n
    for first in range(n):
        # Group members are first + k * stride; `first` is the lowest member of its group
        # when its digit at this level is 0.
        if (first // stride) % degree:
            continue
        nodes = {(base + first + k * stride) // gpus_per_node for k in range(degree)}
        if len(nodes) > 1:
            return True
    return False
