"""The two exact graph problems inside the DT-FM cost model, sized for stage groups.

`bottleneck_matching`: a perfect matching between two equal groups that minimizes the *largest* link
cost it uses (threshold search over the distinct costs, feasibility by augmenting paths on bitmask
adjacency for groups of up to 32 devices, where this beats building sparse matrices for scipy; larger
groups, as in fleets of thousands of devices, use scipy's Hopcroft-Karp).
`shortest_open_path`: the cheapest Hamiltonian path over all groups with free endpoints (Held-Karp,
vectorized over all subsets of one size at a time; 8 groups = 256 subsets).
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

BITMASK_MATCHING_MAX = 32  # above this group size the compiled matching is faster (measured: 2.7x at 64)


def _augment(row: int, adjacency: list[int], col_owner: list[int], seen: list[int]) -> bool:
    """Kuhn's augmenting path from `row`; `seen` is a one-element bitmask of visited columns."""
    free = adjacency[row] & ~seen[0]
    while free:
        low = free & -free
        free ^= low
        seen[0] |= low
        col = low.bit_length() - 1
        if col_owner[col] < 0 or _augment(col_owner[col], adjacency, col_owner, seen):
            col_owner[col] = row
            return True
    return False


def perfect_matching(allowed: np.ndarray) -> list[int] | None:
    """`row_to_col` for a perfect matching using only allowed (row, col) pairs, or None if none exists."""
    size = allowed.shape[0]
    if size > BITMASK_MATCHING_MAX:
        return _compiled_perfect_matching(allowed)
    weights = (
        np.left_shift(1, np.arange(size, dtype=object)) if size > 62 else 1 << np.arange(size, dtype=np.int64)
    )
    adjacency = [int(x) for x in allowed.astype(np.int64 if size <= 62 else object) @ weights]
    col_owner = [-1] * size
    for row in range(size):
        if not _augment(row, adjacency, col_owner, [0]):
            return None
    row_to_col = [0] * size
    for col, row in enumerate(col_owner):
        row_to_col[row] = col
    return row_to_col


def _compiled_perfect_matching(allowed: np.ndarray) -> list[int] | None:
    row_to_col = maximum_bipartite_matching(csr_matrix(allowed.astype(np.int8)), perm_type="column")
    return None if (row_to_col < 0).any() else [int(c) for c in row_to_col]


def bottleneck_matching(cost: np.ndarray) -> tuple[float, list[int]]:
    """(bottleneck value, row_to_col) of the perfect matching minimizing the largest matched cost."""
    # Every row and every column must be matched, so no matching beats the largest row/column minimum.
    lower_bound = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    candidates = np.unique(cost[cost >= lower_bound])
    best = perfect_matching(cost <= candidates[0])
    if best is not None:
        return float(candidates[0]), best
    lo, hi = 0, len(candidates) - 1  # invariant: candidates[lo] infeasible, candidates[hi] feasible
    best = perfect_matching(cost <= candidates[hi])
    assert best is not None  # the full bipartite graph always has a perfect matching
    while hi - lo > 1:
        mid = (lo + hi) // 2
        matching = perfect_matching(cost <= candidates[mid])
        if matching is None:
            lo = mid
        else:
            hi, best = mid, matching
    return float(candidates[hi]), best


@functools.lru_cache(maxsize=8)
def _subset_layers(num_nodes: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per subset size k >= 2: the subsets and, per node j, the subset without j.

    Where j is not in the subset the "subset without j" points at an extra all-infinite table row, so
    the recurrence needs no masking.
    """
    masks = np.arange(1 << num_nodes)
    popcount = np.array([bin(m).count("1") for m in masks])
    bits = 1 << np.arange(num_nodes)
    layers = []
    for k in range(2, num_nodes + 1):
        subset = masks[popcount == k]
        contains = (subset[:, None] & bits[None, :]) != 0
        previous = np.where(contains, subset[:, None] ^ bits[None, :], 1 << num_nodes)
        layers.append((subset, previous))
    return layers


def _held_karp_table(weights: np.ndarray, with_parent: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """best[mask, j]: cheapest path visiting exactly `mask` and ending at j; parent[mask, j]: previous node."""
    n = weights.shape[0]
    best = np.full(((1 << n) + 1, n), np.inf)
    parent = np.full((1 << n, n), -1, dtype=np.int64) if with_parent else None
    best[1 << np.arange(n), np.arange(n)] = 0.0
    incoming = weights.T[None, :, :]  # incoming[0, j, i] = weight of edge i -> j
    for subset, previous in _subset_layers(n):
        # candidate[s, j, i] = best path over subset s minus j ending at i, then edge i -> j.
        candidate = best[previous] + incoming
        if parent is None:
            best[subset] = candidate.min(axis=2)
            continue
        choice = candidate.argmin(axis=2)
        best[subset] = np.take_along_axis(candidate, choice[:, :, None], axis=2)[:, :, 0]
        parent[subset] = choice
    return best[:-1], parent


def shortest_open_path(weights: np.ndarray) -> tuple[float, list[int]]:
    """Exact shortest Hamiltonian path with free endpoints over a symmetric weight matrix."""
    n = weights.shape[0]
    if n == 1:
        return 0.0, [0]
    best, parent = _held_karp_table(np.asarray(weights, dtype=float), with_parent=True)
    assert parent is not None
    full = (1 << n) - 1
    last = int(best[full].argmin())
    cost = float(best[full, last])
    order, mask = [last], full
    while len(order) < n:
        previous = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(previous)
    return cost, order[::-1]


def shortest_open_path_cost(weights: np.ndarray) -> float:
    """The cost only (the search needs nothing more per evaluation)."""
    if weights.shape[0] == 1:
        return 0.0
    best, _ = _held_karp_table(np.asarray(weights, dtype=float), with_parent=False)
    return float(best[-1].min())
