"""Sample order before the micro-batching DP (DynaPipe seed dynapipe.txt §4 "Determine the
order of samples").

Decoder-only models: sort by length, which makes contiguous ranges optimal (a group's padded
length can only shrink when it takes the shortest samples available). Encoder-decoder models:
sort by (input, target), or visit the distinct (input, target) points along a short
travelling-salesman path (OR-Tools routing, optional extra `tsp`) so neighbours are similar in
both lengths.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanningError

ORDER_METHODS = ("sort", "tsp")
# Up to this many distinct points the distances go to OR-Tools as one matrix (read in C++, the
# same search as the Python callback, about 15x faster); beyond it the matrix's Python lists
# would take too much memory, so a callback computes each distance.
MATRIX_MAX_POINTS = 1024


def order_samples(
    lengths: np.ndarray, method: str = "sort", solution_limit: int = 1000
) -> np.ndarray:
    """Permutation of sample indices in the order the DP partitions them. `tsp` stops its local
    search after `solution_limit` improving paths (a count, not a clock: the same order on a
    busy machine)."""
    if method not in ORDER_METHODS:
        raise PlanningError(f"unknown sample order {method!r}; use one of {ORDER_METHODS}")
    if lengths.ndim == 1:
        return np.argsort(lengths, kind="stable")
    by_pair = np.lexsort((lengths[:, 1], lengths[:, 0]))
    if method == "sort":
        return by_pair
    return _tsp_order(lengths, solution_limit)


def _tsp_order(lengths: np.ndarray, solution_limit: int) -> np.ndarray:
    try:
        from ortools.constraint_solver import pywrapcp, routing_enums_pb2
    except ImportError as e:
        raise PlanningError(
            "sample order 'tsp' needs OR-Tools: pip install 'megatron-dynapipe[tsp]'"
        ) from e
    points, inverse = np.unique(lengths, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    n = len(points)
    if n <= 2:
        return np.lexsort((lengths[:, 1], lengths[:, 0]))
    # Node n is a dummy depot at distance 0 from everything, turning the tour into an open path.
    manager = pywrapcp.RoutingIndexManager(n + 1, 1, n)
    routing = pywrapcp.RoutingModel(manager)
    pts = points.astype(np.int64)
    if n <= MATRIX_MAX_POINTS:
        matrix = np.zeros((n + 1, n + 1), dtype=np.int64)
        matrix[:n, :n] = np.abs(pts[:, None, :] - pts[None, :, :]).max(axis=2)
        callback = routing.RegisterTransitMatrix(matrix.tolist())
    else:

        def distance(i: int, j: int) -> int:
            a, b = manager.IndexToNode(i), manager.IndexToNode(j)
            if a == n or b == n:
                return 0
            return int(np.abs(pts[a] - pts[b]).max())

        callback = routing.RegisterTransitCallback(distance)
    routing.SetArcCostEvaluatorOfAllVehicles(callback)
    params = pywrapcp.DefaultRoutingSearchParameters()
    params.first_solution_strategy = routing_enums_pb2.FirstSolutionStrategy.PATH_CHEAPEST_ARC
    params.solution_limit = solution_limit
    solution = routing.SolveWithParameters(params)
    if solution is None:
        raise PlanningError("OR-Tools found no path through the sample lengths")
    path, index = [], routing.Start(0)
    while not routing.IsEnd(index):
        node = manager.IndexToNode(index)
        if node != n:
            path.append(node)
        index = solution.Value(routing.NextVar(index))
    rank = np.empty(n, dtype=np.int64)
    rank[np.array(path)] = np.arange(n)
    return np.lexsort((np.arange(len(lengths)), rank[inverse]))
