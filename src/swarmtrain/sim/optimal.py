"""The fleet's optimal throughput: the best static allocation of the live peers to stages.

A SWARM pipeline runs at `min_s C_s`, where `C_s` is the sum of the rates of the peers serving stage s.
The best allocation maximizes that minimum (a max-min assignment, NP-hard in general). We use the
greedy that is near-optimal for many peers: peers sorted by their best rate, fastest first, each joins
the stage with the lowest capacity among those it can serve (ties: lower index). On small fleets
(<= `POLISH_MAX_PEERS`) the result is polished by the rebalancing rule with zero margin until no move
helps. With hundreds of peers the greedy is within one peer's rate of the fractional upper bound
`fractional_upper_bound`, which we also report.

Averaging traffic depends on the throughput itself (faster pipelines step more often), so the optimum
is the largest T such that the allocation computed with link capacities left after averaging at T
still reaches T (bisection; one greedy when averaging does not bind). Latency is ignored: with enough
micro-batches in flight it is hidden, so it is not a limit on a *static* allocation's throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swarmtrain.planner.rebalance import PeerLoad, RebalanceConfig, plan_moves
from swarmtrain.sim.costs import RateTable, StageCosts

POLISH_MAX_PEERS = 200
MAX_CODED_STAGES = 62  # stages whose feasibility fits a row's bit code in an int64
MAX_TABLED_STAGES = 16  # up to here the codes index a table of 2^S entries
BISECTION_STEPS = 14


@dataclass(frozen=True)
class Allocation:
    stage_of: np.ndarray  # stage per peer (rows of the rate matrix), -1 when it serves none
    capacities: tuple[float, ...]  # samples/s per stage, at the link capacity left after averaging
    limit_samples_per_s: float | None = None  # set when averaging traffic, not capacity, is the limit

    @property
    def throughput_samples_per_s(self) -> float:
        floor = min(self.capacities) if self.capacities else 0.0
        return floor if self.limit_samples_per_s is None else min(floor, self.limit_samples_per_s)


def greedy_allocation(rates: np.ndarray) -> Allocation:
    """Fastest peer first onto the lowest-capacity stage it can serve (ties: the lower index).

    A peer's choice is `min` over the stages it can serve, a tuple shared by every peer with the same
    feasible stages, keyed by the running capacities: the first minimum in index order, as a scan of the
    stages picks, and capacities add up in the same order, so the allocation is bitwise a scan's. At
    10,000 peers and 8 stages a scan in Python takes 30 ms per call, and the optimum's bisection calls
    this thousands of times in a simulated hour (docs/LOG.md)."""
    num_peers, num_stages = rates.shape
    stage_of = np.full(num_peers, -1, dtype=np.int64)
    caps = [0.0] * num_stages
    if num_peers == 0:
        return Allocation(stage_of, tuple(caps))
    order = np.argsort(-rates.max(axis=1), kind="stable")
    feasible = _feasible_stages(rates > 0)
    by_cap = caps.__getitem__
    for p in order.tolist():
        stages = feasible[p]
        if stages:
            best = min(stages, key=by_cap)
            caps[best] += rates.item(p, best)
            stage_of[p] = best
    if num_peers <= POLISH_MAX_PEERS:
        return _polish(rates, stage_of)
    return Allocation(stage_of, tuple(caps))


def _feasible_stages(positive: np.ndarray) -> list[tuple[int, ...]]:
    """Per peer, the stages it can serve in index order; peers with the same ones share a tuple (found
    by a bit code per row: `np.unique` over rows took 14 ms at 10,000 peers, the codes 1 ms)."""
    num_stages = positive.shape[1]
    if num_stages > MAX_CODED_STAGES:
        return [tuple(np.flatnonzero(row).tolist()) for row in positive]
    codes = positive.astype(np.int64) @ (np.int64(1) << np.arange(num_stages, dtype=np.int64))
    if num_stages <= MAX_TABLED_STAGES:  # a table by code: no sort (np.unique's was 1 ms a call)
        table: list[tuple[int, ...]] = [()] * (1 << num_stages)
        for code in np.flatnonzero(np.bincount(codes, minlength=1)).tolist():
            table[code] = _stages_of(code, num_stages)
        return [table[code] for code in codes.tolist()]
    unique, inverse = np.unique(codes, return_inverse=True)
    shared = [_stages_of(code, num_stages) for code in unique.tolist()]
    return [shared[i] for i in inverse.reshape(-1).tolist()]


def _stages_of(code: int, num_stages: int) -> tuple[int, ...]:
    return tuple(s for s in range(num_stages) if code >> s & 1)


def _polish(rates: np.ndarray, stage_of: np.ndarray) -> Allocation:
    num_stages = rates.shape[1]
    loads = [
        PeerLoad(p, int(s), float(rates[p, s]), throughput_by_stage=tuple(rates[p].tolist()))
        for p, s in enumerate(stage_of.tolist())
        if s >= 0
    ]
    for move in plan_moves(loads, num_stages, RebalanceConfig(margin=0.0), max_moves=len(loads)):
        stage_of[move.peer] = move.to_stage
    caps = [0.0] * num_stages
    for p, s in enumerate(stage_of.tolist()):
        if s >= 0:
            caps[s] += float(rates[p, s])
    return Allocation(stage_of, tuple(caps))


def fractional_upper_bound(rates: np.ndarray) -> float:
    """Max-min with peers splittable across stages, when a peer's rates are proportional across stages.

    Then each stage needs `T / r_ps` of peer p's time, so T <= sum_p 1 / sum_s (1 / r_ps) (harmonic
    combination per peer). For non-proportional rates this is a heuristic bound, reported for context.
    """
    if rates.size == 0:
        return 0.0
    with np.errstate(divide="ignore"):
        inv = np.where(rates > 0, 1.0 / np.where(rates > 0, rates, 1.0), np.inf)
    per_peer = 1.0 / inv.sum(axis=1)
    return float(np.nansum(np.where(np.isfinite(per_peer), per_peer, 0.0)))


def _allocation_at(table: RateTable, costs: StageCosts, throughput_samples_per_s: float) -> Allocation:
    """Allocation with averaging at throughput T. The all-reduce share (n-1)/n of a stage depends on the
    allocation itself: allocate with the sizes of a first pass, then score the result with its own sizes."""
    first = greedy_allocation(table.rates(costs, throughput_samples_per_s))
    stage_of = greedy_allocation(
        table.rates(costs, throughput_samples_per_s, _sizes(first, costs.num_stages))
    ).stage_of
    for _ in range(3):  # a peer whose link cannot carry its stage's averaging at these sizes serves nothing
        rates = table.rates(
            costs, throughput_samples_per_s, _sizes(Allocation(stage_of, ()), costs.num_stages)
        )
        useless = (stage_of >= 0) & (_served(rates, stage_of) <= 0)
        if not useless.any():
            break
        stage_of[useless] = -1
    serving = stage_of >= 0
    # bincount adds in peer order, as a loop over the peers would: the same sums, bit for bit
    caps = np.bincount(
        stage_of[serving], weights=_served(rates, stage_of)[serving], minlength=costs.num_stages
    )
    return Allocation(stage_of, tuple(caps.tolist()))


def _served(rates: np.ndarray, stage_of: np.ndarray) -> np.ndarray:
    """Each peer's rate at its stage (at stage 0 for a peer serving none: mask those out)."""
    return rates[np.arange(len(stage_of)), np.maximum(stage_of, 0)]


def _sizes(alloc: Allocation, num_stages: int) -> list[int]:
    return np.bincount(alloc.stage_of[alloc.stage_of >= 0], minlength=num_stages).tolist()


def optimal_allocation(table: RateTable, costs: StageCosts, live: np.ndarray | None = None) -> Allocation:
    """Best static allocation of the live peers (rows `live` of the table), averaging included."""
    idx = np.arange(table.compute_rate.shape[0]) if live is None else np.asarray(live, dtype=np.int64)
    sub = RateTable(table.compute_rate[idx], table.uplink_bytes_per_s[idx], table.downlink_bytes_per_s[idx])
    upper = greedy_allocation(sub.rates(costs, 0.0))
    ceiling = upper.throughput_samples_per_s
    if ceiling <= 0:
        return upper
    at_ceiling = _allocation_at(sub, costs, ceiling)
    if at_ceiling.throughput_samples_per_s >= ceiling * (1 - 1e-3):
        return at_ceiling
    lo, hi, best = 0.0, ceiling, None
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        alloc = _allocation_at(sub, costs, mid)
        if alloc.throughput_samples_per_s >= mid:
            lo, best = mid, alloc
        else:
            hi = mid
    if best is None:
        best = _allocation_at(sub, costs, lo)
    # The allocation's own minimum may exceed `lo`, but averaging at that higher rate was not checked.
    return Allocation(best.stage_of, best.capacities, limit_samples_per_s=lo)
