"""Balanced k-way partition of a device graph, multi-level (seed hexiscale.txt §4.2, Fig. 2).

Vertices are devices weighted by peak FLOPS (c_d), edges are bandwidths (beta). Four steps:
(i) coarsen by heavy-edge matching, so devices joined by fast links end up on the same side;
(ii) partition the coarsest graph into k parts (pymetis' multilevel recursive bisection for the
minimum cut; a greedy placement for the maximum cut, which METIS does not offer); (iii) project
the parts back level by level; (iv) refine at every level with Kernighan-Lin style moves and
swaps that improve the two-level Cut of Eq. 2 without breaking the balance factor (max part
weight over mean part weight, §4.2's hyperparameter).

`maximize=True` is §4.4's other option: the cut between parts is maximised, so the fast links
carry data parallelism and pipelines run over the slow ones. Coarsening then matches the
lightest edges instead, so fast pairs stay apart.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanningError


def cut_weight(adjacency: np.ndarray, labels: np.ndarray) -> float:
    """Eq. 2: total edge weight between different parts (each pair counted once)."""
    differ = labels[:, None] != labels[None, :]
    return float(adjacency[differ].sum() / 2)


def _match(adj: np.ndarray, w: np.ndarray, limit: float, maximize: bool, rng) -> np.ndarray:
    """Heavy- (or light-) edge matching: coarse vertex of every vertex."""
    n = len(w)
    coarse = np.full(n, -1)
    free = np.ones(n, dtype=bool)
    nxt = 0
    for v in rng.permutation(n):
        if not free[v]:
            continue
        free[v] = False
        ok = free & (w + w[v] <= limit)
        if ok.any():
            row = np.where(ok, -adj[v] if maximize else adj[v], -np.inf)
            u = int(np.argmax(row))
            if ok[u]:
                free[u] = False
                coarse[u] = nxt
        coarse[v] = nxt
        nxt += 1
    return coarse


def _contract(adj: np.ndarray, w: np.ndarray, coarse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = int(coarse.max()) + 1
    p = np.zeros((len(w), n))
    p[np.arange(len(w)), coarse] = 1.0
    cadj = p.T @ adj @ p
    np.fill_diagonal(cadj, 0.0)
    return cadj, p.T @ w


def _initial(adj: np.ndarray, w: np.ndarray, k: int, maximize: bool, seed: int) -> np.ndarray:
    n = len(w)
    if k >= n:
        return np.arange(n) % k
    if not maximize and k > 1:
        try:
            import pymetis
        except ImportError:  # pragma: no cover - pymetis is a dependency
            pymetis = None
        if pymetis is not None:
            scale = adj.max() if adj.max() > 0 else 1.0
            xadj, adjncy, ew = [0], [], []
            for v in range(n):
                nbrs = np.nonzero(adj[v] > 0)[0]
                adjncy += nbrs.tolist()
                ew += (np.maximum(1, np.round(adj[v, nbrs] / scale * 10000))).astype(int).tolist()
                xadj.append(len(adjncy))
            vw = np.maximum(1, np.round(w / w.max() * 1000)).astype(int).tolist()
            opts = pymetis.Options(seed=seed)
            graph = (
                {"adjacency": pymetis.CSRAdjacency(xadj, adjncy)}
                if hasattr(pymetis, "CSRAdjacency")
                else {"xadj": xadj, "adjncy": adjncy}
            )
            # Recursive bisection, as §4.2 step (ii) describes.
            _, parts = pymetis.part_graph(
                k, **graph, vweights=vw, eweights=ew, options=opts, recursive=True
            )
            labels = np.asarray(parts)
            if len(np.unique(labels)) == k:
                return labels
    # Greedy: heaviest vertex first, into the part it is least (max cut) or most (min cut)
    # connected to among the parts with room; empty parts are filled first.
    labels = np.full(n, -1)
    load = np.zeros(k)
    conn = np.zeros((n, k))
    target = w.sum() / k
    for v in np.argsort(-w, kind="stable"):
        empty = load == 0
        room = load + w[v] <= target * 1.05
        cand = empty if empty.sum() >= (labels < 0).sum() else (room if room.any() else empty)
        if not cand.any():
            cand = np.ones(k, dtype=bool)
        score = conn[v] if maximize else -conn[v]
        score = np.where(cand, score + 1e-9 * load, np.inf)
        p = int(np.argmin(score))
        labels[v] = p
        load[p] += w[v]
        conn[:, p] += adj[:, v]
    return labels


def _refine(
    adj: np.ndarray, w: np.ndarray, labels: np.ndarray, k: int, balance: float, maximize: bool
) -> np.ndarray:
    """Kernighan-Lin style: best single moves, then best swaps, until nothing improves."""
    n = len(w)
    labels = labels.copy()
    onehot = np.zeros((n, k))
    onehot[np.arange(n), labels] = 1.0
    conn = adj @ onehot  # conn[v, p]: weight from v to part p
    load = onehot.T @ w
    cap = balance * w.sum() / k
    sign = -1.0 if maximize else 1.0  # gain = sign * (conn to new part - conn to own part)
    count = onehot.sum(0)
    rows = np.arange(n)

    def move(v: int, q: int) -> None:
        p = labels[v]
        conn[:, p] -= adj[:, v]
        conn[:, q] += adj[:, v]
        load[p] -= w[v]
        load[q] += w[v]
        count[p] -= 1
        count[q] += 1
        labels[v] = q

    for _ in range(4 * n):
        own = conn[rows, labels]
        gain = sign * (conn - own[:, None])
        gain[rows, labels] = -np.inf
        over = load > cap + 1e-9
        # A move must keep the target part under the cap (or reduce an overload) and leave
        # its source part non-empty.
        fits = (load[None, :] + w[:, None] <= cap + 1e-9) | (
            over[labels][:, None] & (load[None, :] + w[:, None] < load[labels][:, None])
        )
        fits &= (count[labels] > 1)[:, None]
        gain = np.where(fits, gain, -np.inf)
        # Overloaded parts must shed weight even at a loss.
        urgent = gain + np.where(over[labels], 1e18, 0.0)[:, None]
        v, q = np.unravel_index(int(np.argmax(urgent)), urgent.shape)
        if gain[v, q] > 1e-9 or (over[labels[v]] and np.isfinite(gain[v, q])):
            move(int(v), int(q))
            continue
        # No improving move: try the best swap between two parts (keeps loads nearly equal).
        best, pair = 1e-9, None
        order = np.argsort(-np.max(np.where(np.isfinite(gain), gain, -1e30), axis=1))[:32]
        for a in order:
            pa = labels[a]
            for b in order:
                pb = labels[b]
                if pa == pb:
                    continue
                g = sign * (conn[a, pb] - conn[a, pa] + conn[b, pa] - conn[b, pb] - 2 * adj[a, b])
                new_a, new_b = load[pa] - w[a] + w[b], load[pb] - w[b] + w[a]
                if g > best and max(new_a, new_b) <= max(cap, load[pa], load[pb]) + 1e-9:
                    best, pair = g, (int(a), int(b))
        if pair is None:
            break
        a, b = pair
        pa, pb = labels[a], labels[b]
        move(a, pb)
        move(b, pa)
    return labels


def partition_graph(
    weights: np.ndarray,
    adjacency: np.ndarray,
    k: int,
    *,
    maximize: bool = False,
    balance: float = 1.1,
    seed: int = 0,
) -> np.ndarray:
    """Labels 0..k-1 for every vertex: k non-empty parts, weights within `balance` of the mean
    where the weights allow it, cut (Eq. 2) minimised or maximised."""
    w = np.asarray(weights, dtype=float)
    n = len(w)
    if not 1 <= k <= n:
        raise PlanningError(f"cannot partition {n} devices into {k} parts")
    if k == 1:
        return np.zeros(n, dtype=int)
    adj = np.where(np.isfinite(adjacency), adjacency, 0.0).astype(float)
    np.fill_diagonal(adj, 0.0)
    rng = np.random.default_rng(seed)
    levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (adj, w, coarse map)
    cur_adj, cur_w = adj, w
    limit = w.sum() / k
    while len(cur_w) > max(4 * k, 16):
        coarse = _match(cur_adj, cur_w, limit, maximize, rng)
        if coarse.max() + 1 > 0.9 * len(cur_w):
            break
        levels.append((cur_adj, cur_w, coarse))
        cur_adj, cur_w = _contract(cur_adj, cur_w, coarse)
    labels = _initial(cur_adj, cur_w, k, maximize, seed)
    labels = _refine(cur_adj, cur_w, labels, k, balance, maximize)
    for fine_adj, fine_w, coarse in reversed(levels):
        labels = _refine(fine_adj, fine_w, labels[coarse], k, balance, maximize)
    return labels
