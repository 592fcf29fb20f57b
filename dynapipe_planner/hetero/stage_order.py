"""Order of a pipeline's GPU groups by top-tau greedy path search (seed hexiscale.txt §4.3
step (iii), Fig. 3 bottom).

Each GPU group's local stages form one vertex; the weight between two vertices is the best
device-pair bandwidth between them (the leaders talk over the best pair, App. A Eq. 5). From
every group as a start, the search follows, at each step, the tau unvisited groups with the
highest bandwidth from the current end of the path, until every group is on it. Stages inside
a group keep their order. Paths are ranked by the slowest hop they take, then by their total
hop time; the caller prices the best few in full (memory and layer balance depend on the
order too, since the first stage keeps the most micro-batches in flight).
"""

from __future__ import annotations

import itertools

import numpy as np


def group_bandwidth(bandwidth: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """Best device-pair bandwidth between every two groups."""
    k = len(groups)
    out = np.zeros((k, k))
    for a in range(k):
        for b in range(a + 1, k):
            out[a, b] = out[b, a] = float(bandwidth[np.ix_(groups[a], groups[b])].max())
    return out


def top_tau_orders(
    weights: np.ndarray, tau: int = 2, keep: int = 6, max_paths: int = 128
) -> list[list[int]]:
    """Up to `keep` group orders, best first. The branching is `tau` until `max_paths` paths
    would be exceeded, then greedy (tau = 1), so large pipelines stay cheap."""
    k = len(weights)
    if k == 1:
        return [[0]]
    paths: list[list[int]] = []
    budget = max(1, max_paths // k)
    # Neighbours of every group, highest bandwidth first (stable: ties keep group order).
    ranked = [[int(v) for v in np.argsort(-weights[a], kind="stable") if v != a] for a in range(k)]

    def extend(path: list[int], visited: set[int], width: int) -> None:
        if len(paths) >= max_paths:
            return
        if len(path) == k:
            paths.append(path)
            return
        branches = []
        for v in ranked[path[-1]]:
            if v not in visited:
                branches.append(v)
                if len(branches) == max(1, width):
                    break
        for v in branches:
            nxt_width = width if width ** (k - len(path)) <= budget else 1
            extend([*path, v], visited | {v}, nxt_width)

    for start in range(k):
        extend([start], {start}, tau)

    def score(path: list[int]) -> tuple[float, float]:
        hops = [1.0 / weights[a, b] for a, b in itertools.pairwise(path)]
        return (max(hops), sum(hops))

    unique = {tuple(p): p for p in paths}
    ranked = sorted(unique.values(), key=score)
    # Ties are common (machines joined by one network): prefer paths with a new first or last
    # group, which is where memory differs (embedding, most in-flight micro-batches, output).
    chosen, ends = [], set()
    for p in ranked:
        if (p[0], p[-1]) not in ends:
            chosen.append(p)
            ends.add((p[0], p[-1]))
        if len(chosen) == keep:
            return chosen
    rest = [p for p in ranked if p not in chosen]
    return (chosen + rest)[:keep]
