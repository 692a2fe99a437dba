"""Placement search: a memetic evolutionary algorithm over balanced partitions, plus the baselines.

Individuals are balanced partitions of the devices into S stage groups (labels per device). Each
generation picks two parents by tournament, aligns the second parent's group labels to the first
(maximum overlap, Hungarian), keeps every device on which they agree, gives each disputed device the
group of a random parent, and repairs group sizes by moving the devices that fit an over-full group
worst into the under-full group they fit best. The child then gets a local search: swaps of two
devices between groups, proposed where the cost comes from (the member of the worst DP group with the
costliest gradient links, or the member of an endpoint of the costliest pipeline edge with the
slowest links across that edge, swapped with the outside device that links best) mixed with random
swaps; a swap is kept if it lowers the cost. The child replaces the worst individual if it is better
and not already present.

Structured layouts (`planner.structured`: stage groups cut from the fleet's clusters, location-pure
where the places divide into whole groups) are scored first, so the search never returns a plan worse
than the best of them. On a small fleet they are offered to the seeded population; at scale (more than
`SCALE_DEVICES` devices or `SCALE_STAGES` stages, or `SearchConfig.at_scale`) they *are* the population,
with jittered copies, because the other seeds cost seconds each there (packed and striped grow groups
with a quadratic scan per group, random ones match every pair of groups afresh) and start at twice the
structured cost. At scale the local search prices swaps incrementally in a fixed pipeline order
(`planner.incremental`: two groups and up to four edges re-costed, no path search) and re-scores its
result in full, which also re-orders the pipeline.

Every priced partition counts as one evaluation; the search stops at `budget_evals` evaluations or
`budget_s` seconds, whichever comes first, and records the best cost after every evaluation. Only full
scores (exact DT-FM costs) become the best; a local search cut short by the budget has its result scored
in full once more, so the returned cost is always `CostModel.cost` of the returned groups.
`objective` lets the compute-aware planner reuse the same search with another cost function (its local
search then scores in full).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from swarmtrain.planner.cost import CostModel, Group, interchangeable_classes, labels_to_groups
from swarmtrain.planner.graph import shortest_open_path
from swarmtrain.planner.incremental import OrderedLayout
from swarmtrain.planner.seeds import packed_labels, random_labels, striped_labels
from swarmtrain.planner.structured import structured_layouts
from swarmtrain.utils.rng import make_rng

# (cost, tie-break) or (cost, tie-break, pipeline order)
Objective = Callable[[Sequence[Group]], tuple[float, float] | tuple[float, float, list[int]]]
SCALE_DEVICES = 128  # above this many devices (or SCALE_STAGES stages) the search works at scale
SCALE_STAGES = 8
JITTER_FRACTION = 0.25  # a jittered seed swaps this share of a group's size of random device pairs


@dataclass(frozen=True)
class SearchConfig:
    budget_evals: int = 20_000
    budget_s: float = 10.0
    population_size: int = 12
    tournament_size: int = 2
    local_search_patience: int = 60  # consecutive rejected swaps before a local search gives up
    guided_fraction: float = 0.7  # share of swap proposals aimed at the costliest group or edge
    constructive_seeds: bool = True  # first population: packed and striped starts besides random ones
    structured_seeds: bool = True  # score the structured layouts first (at scale always: its population)
    at_scale: bool | None = None  # None: at scale above SCALE_DEVICES devices or SCALE_STAGES stages

    def __post_init__(self) -> None:
        if self.budget_evals < 1 or not self.budget_s > 0:
            raise ValueError("the search needs a positive evaluation and time budget")
        if not 2 <= self.tournament_size <= self.population_size:
            raise ValueError("need 2 <= tournament_size <= population_size")


@dataclass
class SearchResult:
    groups: list[Group]
    cost_s: float
    evaluations: int
    evaluations_to_best: int
    wall_s: float
    time_to_best_s: float
    best_cost_history_s: list[float] = field(repr=False)


class _BudgetSpent(Exception):
    pass


class _Tracker:
    """Counts evaluations, keeps the best partition and the best-so-far curve, enforces budgets."""

    def __init__(self, objective: Objective, config: SearchConfig) -> None:
        self.objective = objective
        self.config = config
        self.start_s = time.perf_counter()
        self.evaluations = 0
        self.best_cost = np.inf
        self.best_groups: list[Group] = []
        self.evaluations_to_best = 0
        self.time_to_best_s = 0.0
        self.history: list[float] = []

    def score(self, groups: list[Group]) -> tuple:
        self._check_budget()
        return self.score_anyway(groups)

    def score_anyway(self, groups: list[Group]) -> tuple:
        """Score in full even with the budget spent (the last result of a local search cut short)."""
        values = self.objective(groups)
        self.evaluations += 1
        if values[0] < self.best_cost:
            self.best_cost, self.best_groups = values[0], list(groups)
            self.evaluations_to_best, self.time_to_best_s = self.evaluations, self.elapsed_s()
        self.history.append(self.best_cost)
        return values

    def count_priced(self) -> None:
        """One incremental pricing: an evaluation, but an upper bound, so never a new best."""
        self._check_budget()
        self.evaluations += 1
        self.history.append(self.best_cost)

    def _check_budget(self) -> None:
        # The first evaluation always runs, so every search returns a placement.
        spent = self.evaluations >= self.config.budget_evals or self.elapsed_s() >= self.config.budget_s
        if spent and self.evaluations > 0:
            raise _BudgetSpent

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s


@dataclass
class _Individual:
    labels: np.ndarray
    groups: list[Group]
    cost: float
    tie_break: float
    order: list[int] | None = None  # best pipeline order of `groups`, when the objective gives it

    def better_than(self, other: _Individual) -> bool:
        return _better((self.cost, self.tie_break), (other.cost, other.tie_break))


def _better(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """(cost, tie-break) pairs: a lower cost wins, a tie (to rounding) goes to the lower tie-break."""
    if first[0] < second[0] * (1 - 1e-12):
        return True
    return first[0] <= second[0] * (1 + 1e-12) and first[1] < second[1]


class PlacementSearch:
    """One seeded run of the memetic search on one cost model (optionally another objective)."""

    def __init__(
        self, model: CostModel, config: SearchConfig, seed: int, objective: Objective | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.rng = make_rng(seed, "placement-search")
        self.num_groups = model.scenario.num_stages
        self.num_devices = model.scenario.num_devices
        # Affinity used to propose moves: how badly two devices would share a group or a stage boundary.
        self.affinity_s = model.dp_link_s + model.pp_link_s
        self.device_class = _swap_classes(model, objective)
        large = self.num_devices > SCALE_DEVICES or self.num_groups > SCALE_STAGES
        self.at_scale = large if config.at_scale is None else config.at_scale
        # Incremental pricing is the DT-FM cost's; another objective is scored in full.
        self.incremental = self.at_scale and objective is None
        if objective is None:
            objective = model.score_and_order if self.incremental else model.score
        self.tracker = _Tracker(objective, config)
        self._unscored: list[Group] | None = None  # a local search's result the budget cut off

    def run(self) -> SearchResult:
        try:
            population = self._first_population()
            while True:
                child = self._crossover(self._select(population), self._select(population))
                child = self._local_search(child)
                self._replace_worst(population, child)
        except _BudgetSpent:
            if self._unscored is not None:
                self.tracker.score_anyway(self._unscored)
        t = self.tracker
        return SearchResult(
            t.best_groups,
            float(t.best_cost),
            t.evaluations,
            t.evaluations_to_best,
            t.elapsed_s(),
            t.time_to_best_s,
            t.history,
        )

    def _make(self, labels: np.ndarray) -> _Individual:
        groups = labels_to_groups(labels, self.num_groups)
        return _Individual(labels, groups, *self.tracker.score(groups))

    def _first_population(self) -> list[_Individual]:
        """Structured layouts first; then the seeds of `_seed` (small fleets, the structured ones
        replacing worse seeds) or jittered copies of the best structured layouts (at scale)."""
        structured = []
        if self.config.structured_seeds or self.at_scale:
            layouts = structured_layouts(
                self.model.pp_link_s, self.model.device_class, self.num_groups, self.model.scenario.sites
            )
            structured = [self._make(labels) for labels in layouts]
        if not self.at_scale:
            population = [self._local_search(self._seed(k)) for k in range(self.config.population_size)]
            for individual in structured:
                self._replace_worst(population, individual)
            return population
        structured.sort(key=lambda ind: (ind.cost, ind.tie_break))
        population = [self._local_search(ind) for ind in structured[: self.config.population_size]]
        while len(population) < self.config.population_size:
            parent = structured[len(population) % len(structured)]
            population.append(self._local_search(self._make(self._jittered(parent.labels))))
        return population

    def _jittered(self, labels: np.ndarray) -> np.ndarray:
        """A copy with random devices of different groups swapped, for a diverse population at scale."""
        labels = labels.copy()
        swaps = max(1, int(JITTER_FRACTION * self.num_devices / self.num_groups))
        for _ in range(swaps):
            x = int(self.rng.integers(self.num_devices))
            y = int(self.rng.choice(np.flatnonzero(labels != labels[x])))
            labels[x], labels[y] = labels[y], labels[x]
        return labels

    def _seed(self, index: int) -> _Individual:
        """The first population cycles through constructive starts, then a random one: striped (by
        activation links) for every band size that divides S, largest first, and packed (by gradient
        links) after the first. Without constructive seeds every start is random."""
        band_sizes = [c for c in range(self.num_groups, 1, -1) if self.num_groups % c == 0]
        kinds = [("striped", band_sizes[0]), ("packed", 0)] + [("striped", c) for c in band_sizes[1:]]
        kinds.append(("random", 0))
        kind, band = kinds[index % len(kinds)] if self.config.constructive_seeds else ("random", 0)
        if kind == "random":
            labels = random_labels(self.rng, self.num_devices, self.num_groups)
        elif kind == "packed":
            labels = packed_labels(self.rng, self.model.dp_link_s, self.num_groups)
        else:
            labels = striped_labels(self.rng, self.model.pp_link_s, self.num_groups, band)
        return self._make(labels)

    def _select(self, population: list[_Individual]) -> _Individual:
        picks = self.rng.choice(len(population), size=self.config.tournament_size, replace=False)
        return min((population[i] for i in picks), key=lambda ind: (ind.cost, ind.tie_break))

    def _replace_worst(self, population: list[_Individual], child: _Individual) -> None:
        worst = max(range(len(population)), key=lambda i: (population[i].cost, population[i].tie_break))
        if child.better_than(population[worst]) and all(
            set(child.groups) != set(p.groups) for p in population
        ):
            population[worst] = child

    def _crossover(self, first: _Individual, second: _Individual) -> _Individual:
        """Inherit whole groups (a coin flip per group) from the parents after aligning their labels;
        devices that no inherited group claims are placed by `_repair`."""
        overlap = np.zeros((self.num_groups, self.num_groups), dtype=np.int64)
        np.add.at(overlap, (second.labels, first.labels), 1)
        rows, cols = linear_sum_assignment(-overlap)
        aligned = np.empty(self.num_groups, dtype=np.int64)
        aligned[rows] = cols
        second_labels = aligned[second.labels]
        from_first = self.rng.random(self.num_groups) < 0.5
        labels = np.where(
            from_first[first.labels], first.labels, np.where(from_first[second_labels], -1, second_labels)
        )
        return self._make(self._repair(labels))

    def _repair(self, labels: np.ndarray) -> np.ndarray:
        """Rebalance: unassigned devices (label -1) and the worst-fitting members of over-full groups go,
        one at a time, to the under-full group whose members they link to best."""
        labels = labels.copy()
        size = self.num_devices // self.num_groups
        counts = np.bincount(labels[labels >= 0], minlength=self.num_groups)
        pending = [int(d) for d in self.rng.permutation(np.flatnonzero(labels < 0))]
        while pending or counts.max() > size:
            if pending:
                mover = pending.pop()
            else:
                source = int(counts.argmax())
                members = np.flatnonzero(labels == source)
                mover = int(members[self.affinity_s[np.ix_(members, members)].sum(axis=1).argmax()])
                counts[source] -= 1
            open_groups = np.flatnonzero(counts < size)
            target = int(open_groups[int(np.argmin(self._fit(mover, labels, counts, open_groups)))])
            labels[mover] = target
            counts[target] += 1
        return labels

    def _fit(self, mover: int, labels: np.ndarray, counts: np.ndarray, open_groups: np.ndarray) -> np.ndarray:
        """Mean affinity of `mover` to each open group's members (0 for an empty group)."""
        if not self.at_scale:  # the original per-group means, kept bit for bit on small fleets
            return np.array(
                [self.affinity_s[mover, labels == g].mean() if counts[g] else 0.0 for g in open_groups]
            )
        # One pass over the mover's row instead of one per group: thousands of movers at scale.
        assigned = labels >= 0
        sums = np.bincount(
            labels[assigned], weights=self.affinity_s[mover, assigned], minlength=self.num_groups
        )
        members = np.bincount(labels[assigned], minlength=self.num_groups)
        means = sums / np.maximum(members, 1)
        return np.where(counts[open_groups] > 0, means[open_groups], 0.0)

    def _local_search(self, individual: _Individual) -> _Individual:
        if self.num_groups < 2:
            return individual  # one group: nothing to swap
        if self.incremental:
            return self._ordered_local_search(individual)
        rejected = 0
        critical = self._critical_groups(individual)
        while rejected < self.config.local_search_patience:
            x, y = self._propose_swap(individual.labels, critical)
            if self.device_class[x] == self.device_class[y]:
                rejected += 1  # interchangeable devices: the swap changes nothing, spend no evaluation
                continue
            labels = individual.labels.copy()
            labels[x], labels[y] = labels[y], labels[x]
            candidate = self._swapped(individual, labels, x, y)
            if candidate.better_than(individual):
                individual, rejected = candidate, 0
                critical = self._critical_groups(individual)
            else:
                rejected += 1
        return individual

    def _ordered_local_search(self, individual: _Individual) -> _Individual:
        """The same swap local search, priced incrementally in the individual's pipeline order; the
        result is scored in full (exact cost, best order) if any swap was kept."""
        assert individual.order is not None
        layout = OrderedLayout(self.model, [individual.groups[k] for k in individual.order])
        rejected, improved = 0, False
        critical = layout.critical()
        try:
            while rejected < self.config.local_search_patience:
                x, y = self._propose_swap(layout.position, critical)
                if self.device_class[x] == self.device_class[y]:
                    rejected += 1
                    continue
                self.tracker.count_priced()
                priced = layout.price_swap(x, y)
                if _better((priced.cost_s, priced.tie_break), (layout.cost_s, layout.tie_break)):
                    layout.apply(priced)
                    rejected, improved = 0, True
                    critical = layout.critical()
                else:
                    rejected += 1
        except _BudgetSpent:
            if improved and layout.cost_s < self.tracker.best_cost:
                self._unscored = labels_to_groups(layout.labels(), self.num_groups)
            raise
        return self._make(layout.labels()) if improved else individual

    def _swapped(self, individual: _Individual, labels: np.ndarray, x: int, y: int) -> _Individual:
        groups = list(individual.groups)
        for device in (x, y):
            k = int(labels[device])
            groups[k] = tuple(sorted(int(d) for d in np.flatnonzero(labels == k)))
        return _Individual(labels, groups, *self.tracker.score(groups))

    def _critical_groups(self, individual: _Individual) -> list[tuple[int, int | None]]:
        """(group, neighbour or None): the worst DP group, and both ends of the costliest path edge."""
        dp_costs = [self.model.group_dp_cost(g) for g in individual.groups]
        weights = self.model.edge_matrix(individual.groups)
        _, order = shortest_open_path(weights)
        edges = [weights[order[k], order[k + 1]] for k in range(len(order) - 1)]
        critical: list[tuple[int, int | None]] = [(int(np.argmax(dp_costs)), None)]
        if edges:
            k = int(np.argmax(edges))
            critical += [(order[k], order[k + 1]), (order[k + 1], order[k])]
        return critical

    def _propose_swap(self, labels: np.ndarray, critical: list[tuple[int, int | None]]) -> tuple[int, int]:
        """A random swap, or one aimed at a critical group: move out its member with the costliest links
        (gradient links inside the group, or its best activation link across the critical edge) for the
        sampled outside device that links best (to the group's other members, or across that edge)."""
        group, neighbour = critical[int(self.rng.integers(len(critical)))]
        members = np.flatnonzero(labels == group)
        if neighbour is None:
            outside = np.flatnonzero(labels != group)
            badness = self.model.dp_link_s[np.ix_(members, members)].sum(axis=1)
        else:
            across = np.flatnonzero(labels == neighbour)
            outside = np.flatnonzero((labels != group) & (labels != neighbour))
            badness = self.model.pp_link_s[np.ix_(members, across)].min(axis=1)
        if self.rng.random() >= self.config.guided_fraction or len(outside) == 0:
            x = int(self.rng.integers(self.num_devices))
            return x, int(self.rng.choice(np.flatnonzero(labels != labels[x])))
        x = int(members[_pick_top(self.rng, badness)])
        sample = self.rng.choice(outside, size=min(8, len(outside)), replace=False)
        rest = members[members != x]
        fit = self.affinity_s[np.ix_(sample, rest)].mean(axis=1) if len(rest) else np.zeros(len(sample))
        if neighbour is not None:
            fit = self.model.pp_link_s[np.ix_(sample, across)].min(axis=1) + 1e-3 * fit
        return x, int(sample[int(np.argmin(fit))])


def _swap_classes(model: CostModel, objective: Objective | None) -> list[int]:
    """Devices whose swap changes nothing the objective sees: the cost model's link classes, split by
    speed and memory when another objective (the compute-aware one) may look at them."""
    scenario = model.scenario
    if objective is None or not scenario.has_compute:
        return model.device_class
    attributes = (np.asarray(scenario.tflops), np.asarray(scenario.memory_gb))
    return interchangeable_classes(scenario.latency_ms, scenario.bandwidth_gbps, attributes=attributes)


def _pick_top(rng: np.random.Generator, scores: np.ndarray) -> int:
    """One of the two highest scores (ties broken at random), so proposals do not retry one swap forever."""
    top = np.lexsort((rng.random(len(scores)), -scores))[:2]
    return int(top[int(rng.integers(len(top)))])


def random_placement_costs(model: CostModel, seed: int, count: int) -> np.ndarray:
    """Costs of `count` uniformly random balanced placements (the 'no planner' baseline)."""
    rng = make_rng(seed, "random-placement")
    n, s = model.scenario.num_devices, model.scenario.num_stages
    return np.array([model.cost(labels_to_groups(random_labels(rng, n, s), s)) for _ in range(count)])


def search_placement(
    model: CostModel, config: SearchConfig | None = None, seed: int = 0, objective: Objective | None = None
) -> SearchResult:
    return PlacementSearch(model, config or SearchConfig(), seed, objective).run()
