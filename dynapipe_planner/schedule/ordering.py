"""Micro-batch ordering: DynaPipe (seed dynapipe.txt) §5, "Micro-batch ordering".

The injection order changes the adaptive schedule's throughput, but modelling that effect is
hard, so the paper clusters micro-batches by predicted execution time (similar ones should run
close together) and tries every permutation of the cluster order; 3-4 clusters suffice.

Clustering is the optimal 1-D k-means split (least within-cluster sum of squared deviations),
found exactly by dynamic programming over the sorted times, because optimal 1-D clusters are
contiguous runs of the sorted values. Cutting at the largest gaps instead would give single
outliers (one long micro-batch) clusters of their own and leave the bulk of the distribution,
where the timing differences are, in one cluster; Lloyd's k-means could stop at a local optimum
and depends on its seeds. The DP is O(k M^2) in vectorised numpy, microseconds at M = 64.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..errors import PlanningError


def cluster_labels(times: np.ndarray, num_clusters: int) -> np.ndarray:
    """Cluster index per micro-batch, 0 for the fastest cluster; at most num_clusters.

    Equal times always share a cluster, so there are never more clusters than distinct times.
    """
    order = np.argsort(times, kind="stable")
    values = times[order] - times.mean()  # centring keeps the sum-of-squares formula accurate
    n = len(values)
    # Cluster boundaries may only fall between distinct values (and at both ends).
    cuts = np.flatnonzero(np.r_[True, values[1:] > values[:-1], True])
    k = min(num_clusters, len(cuts) - 1)
    s1 = np.r_[0.0, np.cumsum(values)][cuts]
    s2 = np.r_[0.0, np.cumsum(values * values)][cuts]
    size = (cuts[None, :] - cuts[:, None]).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        # sse[a, b]: squared deviations of the run between cuts a and b (a < b), else inf.
        sse = (s2[None, :] - s2[:, None]) - (s1[None, :] - s1[:, None]) ** 2 / size
    sse = np.where(size > 0, np.maximum(sse, 0.0), np.inf)
    best = sse[0]  # best[b]: least SSE of the values before cut b in the clusters so far
    choice = []
    for _ in range(1, k):
        total = best[:, None] + sse
        choice.append(np.argmin(total, axis=0))
        best = total.min(axis=0)
    bounds = [len(cuts) - 1]
    for back in reversed(choice):
        bounds.append(int(back[bounds[-1]]))
    bounds.append(0)
    labels_sorted = np.empty(n, dtype=np.int64)
    for label, (lo, hi) in enumerate(itertools.pairwise(reversed(bounds))):
        labels_sorted[cuts[lo] : cuts[hi]] = label
    labels = np.empty(n, dtype=np.int64)
    labels[order] = labels_sorted
    return labels


def cluster_permutations(times: np.ndarray, num_clusters: int = 4) -> list[list[int]]:
    """Candidate injection orders: the identity first, then every permutation of the clusters.

    Inside a cluster micro-batches keep their original relative order. `times` (M,) are the
    predicted execution times; returns distinct permutations of range(M).
    """
    t = np.asarray(times, dtype=np.float64)
    if t.ndim != 1 or not np.all(np.isfinite(t)):
        raise PlanningError(f"times: expected a finite 1-D array, got shape {t.shape}")
    if num_clusters < 1:
        raise PlanningError(f"num_clusters must be at least 1, got {num_clusters}")
    identity = list(range(len(t)))
    if not identity:
        return [identity]
    labels = cluster_labels(t, num_clusters)
    members = [np.flatnonzero(labels == c).tolist() for c in range(int(labels.max()) + 1)]
    orders = [identity]
    seen = {tuple(identity)}
    for perm in itertools.permutations(range(len(members))):
        order = [m for c in perm for m in members[c]]
        if tuple(order) not in seen:
            seen.add(tuple(order))
            orders.append(order)
    return orders
