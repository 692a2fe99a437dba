"""Incremental DT-FM cost of a layout in a fixed pipeline order: what the local search prices at scale.

Scoring a layout from scratch matches every pair of groups (S(S-1)/2 bottleneck matchings) and solves
the path problem over them (Held-Karp, 2^S S^2: a third of a second at 16 stages). A swap of two
devices changes only their two groups: the two groups' DP costs and the at most four pipeline edges
touching them. `OrderedLayout` keeps the groups in one pipeline order with every group's DP values and
every path edge, and prices a swap by re-costing only those, through the cost model's caches. The price
is `CostModel.ordered_score` of the swapped layout in the same order: never below the DT-FM cost (which
takes the best order) and equal to it while the order stays the best; the search re-orders by a full
score when a local search ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from swarmtrain.planner.cost import CostModel, Group


@dataclass(frozen=True)
class PricedSwap:
    """A swap's effect: the new contents, DP values and edges of the touched positions, and the score."""

    x: int
    y: int
    groups: dict[int, Group]  # position in the pipeline -> new group
    dp: dict[int, tuple[float, float]]
    edges: dict[int, tuple[float, float]]  # edge k joins positions k and k + 1
    cost_s: float
    tie_break: float


class OrderedLayout:
    """Groups in pipeline order (position k = stage k) with their DP values and path edges."""

    def __init__(self, model: CostModel, ordered: Sequence[Group]) -> None:
        self.model = model
        self.groups = [tuple(sorted(int(d) for d in g)) for g in ordered]
        self.dp = [model.group_values(g) for g in self.groups]
        self.edges = [model.edge_values(a, b) for a, b in zip(self.groups, self.groups[1:], strict=False)]
        self.position = np.empty(model.scenario.num_devices, dtype=np.int64)
        for k, group in enumerate(self.groups):
            self.position[list(group)] = k
        self.cost_s, self.tie_break = self._total(self.dp, self.edges)

    def price_swap(self, x: int, y: int) -> PricedSwap:
        """Score of the layout with devices x and y (in different groups) swapped, order unchanged."""
        a, b = int(self.position[x]), int(self.position[y])
        if a == b:
            raise ValueError(f"devices {x} and {y} are in the same group")
        groups = {a: _replace(self.groups[a], x, y), b: _replace(self.groups[b], y, x)}
        dp_new = {k: self.model.group_values(g) for k, g in groups.items()}
        touched = {k for p in (a, b) for k in (p - 1, p) if 0 <= k < len(self.edges)}
        edges_new = {
            k: self.model.edge_values(groups.get(k, self.groups[k]), groups.get(k + 1, self.groups[k + 1]))
            for k in touched
        }
        dp = [dp_new.get(k, v) for k, v in enumerate(self.dp)]
        edges = [edges_new.get(k, v) for k, v in enumerate(self.edges)]
        cost_s, tie_break = self._total(dp, edges)
        return PricedSwap(x, y, groups, dp_new, edges_new, cost_s, tie_break)

    def apply(self, swap: PricedSwap) -> None:
        for k, group in swap.groups.items():
            self.groups[k] = group
        for k, values in swap.dp.items():
            self.dp[k] = values
        for k, values in swap.edges.items():
            self.edges[k] = values
        self.position[swap.x], self.position[swap.y] = self.position[swap.y], self.position[swap.x]
        self.cost_s, self.tie_break = swap.cost_s, swap.tie_break

    def labels(self) -> np.ndarray:
        """Group label per device, the label being the pipeline position."""
        return self.position.copy()

    def critical(self) -> list[tuple[int, int | None]]:
        """(position, neighbour or None): the worst DP group, and both ends of the costliest path edge."""
        critical: list[tuple[int, int | None]] = [(int(np.argmax([d[0] for d in self.dp])), None)]
        if self.edges:
            k = int(np.argmax([e[0] for e in self.edges]))
            critical += [(k, k + 1), (k + 1, k)]
        return critical

    @staticmethod
    def _total(dp: list[tuple[float, float]], edges: list[tuple[float, float]]) -> tuple[float, float]:
        """The same arithmetic as `CostModel.ordered_score`, so the two agree to the last bit."""
        dp_array = np.array(dp)
        edge_array = np.array(edges).reshape(-1, 2)
        cost = float(dp_array[:, 0].max()) + 2.0 * float(edge_array[:, 0].sum())
        return cost, float(dp_array.sum(axis=1).mean()) + 2.0 * float(edge_array[:, 1].sum())


def _replace(group: Group, out: int, into: int) -> Group:
    return tuple(sorted([d for d in group if d != out] + [into]))
