"""The DT-FM communication cost of a placement (Yuan et al. 2022), in seconds per iteration.

A placement cuts the devices into S stage groups of D_DP devices each. With latency in seconds and
sizes in Gbit (GB x 8) over bandwidth in Gbit/s:

    DP link(i, j)   = 2 * (latency_s(i, j) + gradient_Gbit / (D_DP * bandwidth(i, j)))
    DP cost(group)  = max over members i of sum over the other members j of DP link(i, j)
    DP cost         = the worst group's DP cost
    PP link(i, j)   = latency_s(i, j) + activation_Gbit / bandwidth(i, j)
    edge(A, B)      = min over perfect matchings of A onto B of the largest matched PP link
    PP cost         = the shortest open Hamiltonian path over the groups under `edge`
    cost            = DP cost + 2 * PP cost       (forward activations + backward gradients)

`gradient_gb` is one stage's gradient (what each group all-reduces); `activation_gb` is the hidden
state of one pipeline's macro-batch crossing one stage boundary. The path order is the pipeline order
and the matchings along it wire the D_DP pipelines.

`CostModel` caches each group's DP cost and each pair's edge keyed by the groups' contents (as classes
of interchangeable devices, so two location-pure groups of one place share every entry), so a search
step that swaps two devices recomputes only the edges touching the two changed groups. `ordered_score`
prices a layout in a given pipeline order (`planner.incremental` keeps that price up to date swap by
swap); `cost` and `score` take the best order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from swarmtrain.config.errors import UserError
from swarmtrain.config.model import ModelConfig, partition_layers
from swarmtrain.config.sizes import FP32_BYTES, activation_bytes_per_sample, params_per_layer
from swarmtrain.planner.graph import bottleneck_matching, shortest_open_path, shortest_open_path_cost
from swarmtrain.planner.scenarios import Scenario

GBIT_PER_GB = 8.0
MAX_CACHE_ENTRIES = 400_000

Group = tuple[int, ...]


class LayoutError(UserError, ValueError):
    """A layout (groups of devices) that is not a balanced partition of the scenario's devices."""


@dataclass(frozen=True)
class Workload:
    """What crosses the network each iteration: a stage's gradient and one stage boundary's activations."""

    activation_gb: float
    gradient_gb: float

    def __post_init__(self) -> None:
        if not (self.activation_gb >= 0 and self.gradient_gb >= 0):
            raise UserError(
                f"activation and gradient sizes must be >= 0 GB, got {self.activation_gb}, {self.gradient_gb}"
            )


def workload_from_model(model: ModelConfig, num_stages: int, macro_batch_samples: int) -> Workload:
    """Sizes in GB (1e9 bytes) for evenly cut stages: the gradient is the fp32 parameters of a middle
    stage's layers; the activation is seq_len x d_model fp16 values per sample of a macro-batch."""
    middle = partition_layers(model.num_layers, num_stages)[num_stages // 2]
    gradient_gb = params_per_layer(model) * middle.num_layers * FP32_BYTES / 1e9
    activation_gb = macro_batch_samples * activation_bytes_per_sample(model) / 1e9
    return Workload(activation_gb=activation_gb, gradient_gb=gradient_gb)


@dataclass(frozen=True)
class PlanCost:
    """A scored placement. `groups` and `pipelines` are in pipeline order (stage 0 first)."""

    cost_s: float
    dp_cost_s: float
    pp_cost_s: float
    groups: list[list[int]]
    pipelines: list[list[int]]
    group_dp_costs_s: list[float]
    path_edge_costs_s: list[float]


def link_matrices(scenario: Scenario, workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(DP link, PP link) in seconds for every device pair; the diagonal is zero (no self traffic)."""
    latency_s = scenario.latency_ms / 1000.0
    bandwidth = scenario.bandwidth_gbps
    with np.errstate(divide="ignore"):
        dp_link_s = 2.0 * (latency_s + workload.gradient_gb * GBIT_PER_GB / (scenario.group_size * bandwidth))
        pp_link_s = latency_s + workload.activation_gb * GBIT_PER_GB / bandwidth
    np.fill_diagonal(dp_link_s, 0.0)
    np.fill_diagonal(pp_link_s, 0.0)
    return dp_link_s, pp_link_s


class CostModel:
    """Scores partitions of one scenario under one workload; memoizes per group and per group pair."""

    def __init__(self, scenario: Scenario, workload: Workload) -> None:
        self.scenario = scenario
        self.workload = workload
        self.dp_link_s, self.pp_link_s = link_matrices(scenario, workload)
        # Caches are keyed by the multiset of device classes (interchangeable devices share a class), so
        # a group and its look-alike on an identical machine hit the same entry.
        self.device_class = interchangeable_classes(scenario.latency_ms, scenario.bandwidth_gbps)
        self._dp_cache: dict[Group, tuple[float, float]] = {}  # keyed by _canonical(group)
        self._edge_cache: dict[tuple[Group, Group], tuple[float, float]] = {}

    def group_values(self, group: Group) -> tuple[float, float]:
        """(DP cost, mean over members of their DP link sums) of one group, memoized."""
        key = self._canonical(group)
        value = self._dp_cache.get(key)
        if value is None:
            members = np.asarray(group)
            sums = self.dp_link_s[np.ix_(members, members)].sum(axis=1)
            value = (float(sums.max()), float(sums.mean()))
            if len(self._dp_cache) >= MAX_CACHE_ENTRIES:
                self._dp_cache.clear()
            self._dp_cache[key] = value
        return value

    def edge_values(self, a: Group, b: Group) -> tuple[float, float]:
        """(bottleneck matching value, mean link of the min-sum matching) between two groups, memoized."""
        key_a, key_b = self._canonical(a), self._canonical(b)
        key = (key_a, key_b) if key_a < key_b else (key_b, key_a)
        value = self._edge_cache.get(key)
        if value is None:
            links = self.pp_link_s[np.ix_(a, b)]
            bottleneck, _ = bottleneck_matching(links)
            rows, cols = linear_sum_assignment(links)
            value = (bottleneck, float(links[rows, cols].mean()))
            if len(self._edge_cache) >= MAX_CACHE_ENTRIES:
                self._edge_cache.clear()
            self._edge_cache[key] = value
        return value

    def _canonical(self, group: Group) -> Group:
        return tuple(sorted(self.device_class[d] for d in group))

    def group_dp_cost(self, group: Group) -> float:
        return self.group_values(group)[0]

    def edge_matrices(self, groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray]:
        """Group x group (bottleneck edge, mean min-sum matched link) matrices."""
        count = len(groups)
        weights = np.zeros((2, count, count))
        for i in range(count):
            for j in range(i + 1, count):
                weights[:, i, j] = weights[:, j, i] = self.edge_values(groups[i], groups[j])
        return weights[0], weights[1]

    def edge_matrix(self, groups: Sequence[Group]) -> np.ndarray:
        return self.edge_matrices(groups)[0]

    def cost(self, groups: Sequence[Group]) -> float:
        """Total cost in seconds of a partition given as sorted tuples."""
        dp_cost = max(self.group_dp_cost(g) for g in groups)
        return dp_cost + 2.0 * shortest_open_path_cost(self.edge_matrix(groups))

    def score(self, groups: Sequence[Group]) -> tuple[float, float]:
        """(cost, tie-break) for the search. The cost is a max of maxima, flat under most single swaps;
        the tie-break (mean group DP, mean member link sums, and the path over mean matched links) moves
        with every swap and so shows the search which way the cost will eventually drop."""
        dp = [self.group_values(g) for g in groups]
        bottleneck, soft = self.edge_matrices(groups)
        cost = max(d[0] for d in dp) + 2.0 * shortest_open_path_cost(bottleneck)
        tie_break = float(np.mean(dp, axis=0).sum()) + 2.0 * shortest_open_path_cost(soft)
        return cost, tie_break

    def score_and_order(self, groups: Sequence[Group]) -> tuple[float, float, list[int]]:
        """(cost, tie-break, pipeline order) with one path search instead of `score`'s two: the
        tie-break takes the mean matched links along the cost's own order (what `ordered_score` prices),
        so a search at scale compares full and incremental scores on one footing."""
        bottleneck, _ = self.edge_matrices(groups)
        _, order = shortest_open_path(bottleneck)
        cost, tie_break = self.ordered_score([groups[k] for k in order])
        return cost, tie_break, order

    def ordered_score(self, ordered: Sequence[Group]) -> tuple[float, float]:
        """(cost, tie-break) of the groups in this pipeline order: at least `cost`, equal to it in the
        best order. The tie-break is the mean over groups of (DP cost + mean member link sum) plus twice
        the mean matched links along the path."""
        dp = np.array([self.group_values(g) for g in ordered])
        edges = np.array([self.edge_values(a, b) for a, b in zip(ordered, ordered[1:], strict=False)])
        edges = edges.reshape(-1, 2)
        cost = float(dp[:, 0].max()) + 2.0 * float(edges[:, 0].sum())
        return cost, float(dp.sum(axis=1).mean()) + 2.0 * float(edges[:, 1].sum())

    def describe(self, groups: Sequence[Sequence[int]]) -> PlanCost:
        """Full breakdown: pipeline order, per-group DP costs, path edges and the wired pipelines."""
        keyed = [tuple(sorted(int(d) for d in g)) for g in groups]
        weights = self.edge_matrix(keyed)
        pp_cost, order = shortest_open_path(weights)
        ordered = [keyed[i] for i in order]
        dp_costs = [self.group_dp_cost(g) for g in ordered]
        edges = [float(weights[order[k], order[k + 1]]) for k in range(len(order) - 1)]
        return PlanCost(
            cost_s=max(dp_costs) + 2.0 * pp_cost,
            dp_cost_s=max(dp_costs),
            pp_cost_s=pp_cost,
            groups=[list(g) for g in ordered],
            pipelines=self.wire_pipelines(ordered),
            group_dp_costs_s=dp_costs,
            path_edge_costs_s=edges,
        )

    def wire_pipelines(self, ordered: Sequence[Group]) -> list[list[int]]:
        """Follow the bottleneck matchings along the path: pipeline p starts at the p-th device of stage 0."""
        pipelines = [[device] for device in ordered[0]]
        for here, there in zip(ordered, ordered[1:], strict=False):
            _, row_to_col = bottleneck_matching(self.pp_link_s[np.ix_(here, there)])
            position = {device: k for k, device in enumerate(here)}
            for pipeline in pipelines:
                pipeline.append(there[row_to_col[position[pipeline[-1]]]])
        return pipelines


def validate_layout(groups: object, scenario: Scenario) -> list[list[int]]:
    """A user's layout as lists of ints, or a LayoutError naming what is wrong with it."""
    stages, size, count = scenario.num_stages, scenario.group_size, scenario.num_devices
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise LayoutError(f"a layout must be a JSON list of {stages} lists of device indices")
    if len(groups) != stages:
        raise LayoutError(f"layout has {len(groups)} groups, expected {stages} (one per stage)")
    seen: set[int] = set()
    for k, group in enumerate(groups):
        if len(group) != size:
            raise LayoutError(f"layout group {k} has {len(group)} devices, expected {size}")
        for device in group:
            if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
                raise LayoutError(f"layout group {k} has {device!r}, not a device index in 0..{count - 1}")
            if device in seen:
                raise LayoutError(f"device {device} appears twice in the layout")
            seen.add(device)
    return [list(g) for g in groups]


def interchangeable_classes(*matrices: np.ndarray, attributes: Sequence[np.ndarray] = ()) -> list[int]:
    """Class id per device; two devices share a class when swapping them changes no link (e.g. two GPUs
    of one machine) and no attribute (e.g. speed and memory, if given). Ids count up in order of each
    class's first device.

    Vectorised for any fleet size: swappable devices have rows holding the same values (only the
    entries for each other and themselves trade places), so their rows have the same sum, sum of
    squares, minimum and maximum; only devices with equal such keys (rounded to float32, as summing in
    another order may change the last bits) are compared exactly, each class's first device with all
    its candidates at once. Swappability is transitive for symmetric matrices, so comparing with the
    first member suffices."""
    count = matrices[0].shape[0]
    stacked = np.concatenate([np.asarray(m, dtype=float) for m in matrices], axis=1)
    keys = [np.asarray(a, dtype=float).reshape(count) for a in attributes]
    for matrix in matrices:
        rows = np.asarray(matrix, dtype=float)
        with np.errstate(over="ignore", invalid="ignore"):
            keys += [rows.sum(axis=1), (rows * rows).sum(axis=1), rows.min(axis=1), rows.max(axis=1)]
    _, bucket = np.unique(np.stack(keys, axis=1).astype(np.float32), axis=0, return_inverse=True)
    bucket = bucket.reshape(-1)
    class_of = np.full(count, -1, dtype=np.int64)
    next_class = 0
    for device in range(count):
        if class_of[device] >= 0:
            continue
        class_of[device] = next_class
        candidates = np.flatnonzero((bucket == bucket[device]) & (class_of < 0))
        if len(candidates):
            class_of[candidates[_swappable(stacked, device, candidates, count)]] = next_class
        next_class += 1
    return [int(c) for c in class_of]


def _swappable(stacked: np.ndarray, x: int, ys: np.ndarray, count: int) -> np.ndarray:
    """Per y in ys: rows x and y agree on every device other than x and y (in each stacked matrix)."""
    differ = stacked[ys] != stacked[x]
    blocks = np.arange(0, stacked.shape[1], count)
    differ[:, x + blocks] = False
    differ[np.arange(len(ys))[:, None], ys[:, None] + blocks[None, :]] = False
    return ~differ.any(axis=1)


def labels_to_groups(labels: np.ndarray, num_groups: int) -> list[Group]:
    """Group k = the sorted devices whose label is k."""
    return [tuple(int(d) for d in np.flatnonzero(labels == k)) for k in range(num_groups)]
