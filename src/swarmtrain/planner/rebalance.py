"""Adaptive rebalancing: which peer (if any) should move to which stage, and where a new peer should go.

Pure functions on plain data, called the same way by the live balancer loop and by the simulator
(docs/DESIGN.md section 5). A stage's *capacity* is the sum of its peers' throughput (samples/s measured at
that stage); a SWARM pipeline runs at the capacity of its weakest stage, the *bottleneck*.

The rule for one move (`choose_move`):
- the target is the bottleneck stage b (lowest capacity; ties: the larger expected drain time
  `sum(queue) / capacity`, then the lower index);
- a candidate is a peer p of another stage a that keeps at least `min_peers_per_stage` serving peers
  after the move and can serve b (positive throughput there);
- hysteresis: after the move the donor must stay *above* the old bottleneck by the margin,
  `C_a - thr_p > C_b * (1 + margin)`. So a move always raises the pair's minimum strictly above the old
  minimum; capacities sorted ascending increase lexicographically with every move, hence no sequence
  of moves on unchanged data can cycle (in particular no ping-pong between two equal stages, which the
  naive "move from most loaded to least loaded" rule does);
- among candidates, pick one whose resulting `min(C_a', C_b')` is within `mover_tolerance` (20%) of the
  largest, by the lower source stage, then the peer id as a string, so every peer that evaluates the
  rule on the same data picks the same mover. The band is what makes peers that read slightly different
  data agree too: live figures of identical servers differ by 10-20% from one read to the next, and
  picking strictly by the largest minimum named a different mover in every server's plan (proposals
  withdrawn and made again for 13 s before a plan of 3 moves was committed, bench/rebalance_live.py).
  Every candidate in the band still raises the pair's minimum above the old bottleneck.

How busy the bottleneck is (`plan_moves(weigh=True)`, the live balancer): the capacities say what
each stage could serve, but a swarm of synchronous steps also waits at every step for work no stage's
figure carries (the pipeline's drain, a stage's gradient exchange). On the test bed's link fleet with
fp32 sums the swarm runs at ~100 samples/s while its stages' sums are 646 and ~790, because stage 1's
exchange over 4 Mbit/s links takes ~2 of every ~5 s step; a plan by capacities alone takes stage 0 for
the bottleneck by 8%, moves a slow-linked server there, and the swarm falls to 40 (docs/LOG.md). So each
server announces
the busy fraction of the resource that limits it (`PeerLoad.utilization`), and the bottleneck stage's
(weighted by figures) says how much of the swarm's time its work is: with u of it, a move that lifts
the lowest capacity from C to C' makes the swarm's seconds per sample u C / C' + (1 - u) of today's
(the rest taken as unchanged by a move). A plan's moves are kept only in groups that each raise that
predicted rate by `min_gain` (10%) over the group before (`worthwhile_moves`); groups, not single moves,
because with two stages tied for the bottleneck the first move alone lifts nothing. Dropping moves
from a plan's end cannot create a cycle, so the argument above holds.

Why busy fractions and not the swarm's observed rate against the capacities: servers held to a CPU
quota read capacities per CPU second, 4x what a quarter of a CPU serves, so 1 / observed - 1 / capacity
takes the quota for step overhead and holds back the second move of 3+1 -> 1+3 (bench/rebalance_live.py
--plain, docs/LOG.md); a busy fraction is a wall-clock reading whatever the figure's calibration.
Why not price each member's exchange into its stage's capacity (an announced `exchange_s`): on `tiny`
with a batch of 32 the seconds from sealing a step to applying it are mostly noisy optimizer work, and
the pricing moves a server back (docs/LOG.md). The simulator does not
weigh: its rates already take the exchange off the links.

A peer's throughput at another stage comes from `throughput_by_stage` when the caller knows it (the
simulator does), otherwise it is scaled by relative stage cost (compute per sample), defaulting to equal
costs; `relative_stage_costs` estimates those costs from what the peers announce (the live balancer). `pending` peers are on their way into a stage (downloading its state): they count toward its
capacity but not toward "never empty a stage", and they never move.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

_REL_TOL = 1e-9


@dataclass(frozen=True)
class PeerLoad:
    """What one peer announces: its stage, measured throughput there, and its request queue length."""

    peer: Hashable
    stage: int
    throughput_samples_per_s: float
    queue_len: float = 0.0
    throughput_by_stage: tuple[float, ...] | None = None  # samples/s it would reach at each stage
    pending: bool = False
    utilization: float | None = None  # busy fraction of the resource that limits it (None: not known)


@dataclass(frozen=True)
class RebalanceConfig:
    margin: float = 0.1  # hysteresis: the donor must stay above the old bottleneck by this fraction
    min_peers_per_stage: int = 1
    mover_tolerance: float = 0.2  # candidates within this fraction of the best move are equal (by peer id)
    # weighed by the bottleneck's busy fraction: each group of moves must raise the swarm's predicted
    # samples/s this much
    min_gain: float = 0.1

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError("margin must be >= 0")
        if self.min_peers_per_stage < 1:
            raise ValueError("min_peers_per_stage must be >= 1 (a stage must never be emptied)")
        if not 0 <= self.mover_tolerance < 1:
            raise ValueError("mover_tolerance must be in [0, 1)")
        if self.min_gain < 0:
            raise ValueError("min_gain must be >= 0")


@dataclass(frozen=True)
class Move:
    peer: Hashable
    from_stage: int
    to_stage: int
    bottleneck_before_samples_per_s: float
    pair_min_after_samples_per_s: float
    rate_samples_per_s: float = 0.0  # the mover's expected throughput at the target stage


def stage_capacities(loads: Sequence[PeerLoad], num_stages: int) -> list[float]:
    capacities = [0.0] * num_stages
    for load in loads:
        capacities[load.stage] += load.throughput_samples_per_s
    return capacities


def stage_queues(loads: Sequence[PeerLoad], num_stages: int) -> list[float]:
    queues = [0.0] * num_stages
    for load in loads:
        queues[load.stage] += load.queue_len
    return queues


def rate_at(load: PeerLoad, stage: int, stage_cost: Sequence[float] | None = None) -> float:
    """Samples/s this peer would reach serving `stage`."""
    if load.throughput_by_stage is not None:
        return load.throughput_by_stage[stage]
    if stage_cost is None or stage == load.stage:
        return load.throughput_samples_per_s
    return load.throughput_samples_per_s * stage_cost[load.stage] / stage_cost[stage]


def bottleneck_stage(
    capacities: Sequence[float],
    queues: Sequence[float] | None = None,
    candidates: Sequence[int] | None = None,
) -> int:
    """Lowest capacity; ties (relative 1e-9) go to the larger drain time, then the lower index."""
    stages = list(range(len(capacities))) if candidates is None else list(candidates)
    if not stages:
        raise ValueError("no candidate stage")
    low = min(capacities[s] for s in stages)
    tied = [s for s in stages if capacities[s] <= low + _REL_TOL * max(abs(low), 1.0)]
    if queues is None or len(tied) == 1:
        return tied[0]

    def drain_s(s: int) -> float:
        return queues[s] / capacities[s] if capacities[s] > 0 else float("inf") if queues[s] > 0 else 0.0

    return min(tied, key=lambda s: (-drain_s(s), s))


def choose_move(
    loads: Sequence[PeerLoad],
    num_stages: int,
    config: RebalanceConfig = RebalanceConfig(),
    stage_cost: Sequence[float] | None = None,
) -> Move | None:
    """At most one move toward the bottleneck stage, or None (see the module docstring for the rule)."""
    if num_stages < 2 or not loads:
        return None
    capacities = stage_capacities(loads, num_stages)
    queues = stage_queues(loads, num_stages)
    target = bottleneck_stage(capacities, queues)
    serving = [0] * num_stages
    for load in loads:
        if not load.pending:
            serving[load.stage] += 1
    floor = capacities[target] * (1 + config.margin)
    candidates = []
    for load in loads:
        source = load.stage
        if load.pending or source == target or serving[source] - 1 < config.min_peers_per_stage:
            continue
        gain = rate_at(load, target, stage_cost)
        donor_after = capacities[source] - load.throughput_samples_per_s
        if gain <= 0 or donor_after <= floor:
            continue
        pair_min = min(donor_after, capacities[target] + gain)
        candidates.append(Move(load.peer, source, target, capacities[target], pair_min, gain))
    if not candidates:
        return None
    best_min = max(move.pair_min_after_samples_per_s for move in candidates)
    band = [
        m for m in candidates if m.pair_min_after_samples_per_s >= best_min * (1 - config.mover_tolerance)
    ]
    return min(band, key=lambda move: (move.from_stage, str(move.peer)))


def plan_moves(
    loads: Sequence[PeerLoad],
    num_stages: int,
    config: RebalanceConfig = RebalanceConfig(),
    stage_cost: Sequence[float] | None = None,
    max_moves: int = 1,
    weigh: bool = False,
) -> list[Move]:
    """Apply `choose_move` up to `max_moves` times, each time on the loads as the previous moves leave them.

    A moved peer becomes pending in its target stage (counted there, never moved again in this plan),
    so a batch of moves cannot overshoot. With `weigh`, only the moves worth their cost at the
    bottleneck's busy fraction are kept (`worthwhile_moves`). With `max_moves=1` and no weighing this
    is exactly `choose_move`.
    """
    current = list(loads)
    moves: list[Move] = []
    capacities = [stage_capacities(current, num_stages)]
    for _ in range(max_moves):
        move = choose_move(current, num_stages, config, stage_cost)
        if move is None:
            break
        moves.append(move)
        for i, load in enumerate(current):
            if load.peer == move.peer and not load.pending:
                current[i] = replace(
                    load,
                    stage=move.to_stage,
                    throughput_samples_per_s=move.rate_samples_per_s,
                    queue_len=0.0,
                    pending=True,
                )
                break
        capacities.append(stage_capacities(current, num_stages))
    utilization = bottleneck_utilization(loads, num_stages) if weigh else None
    if utilization is None:
        return moves
    return moves[: worthwhile_moves(capacities, utilization, config.min_gain)]


def bottleneck_utilization(loads: Sequence[PeerLoad], num_stages: int) -> float | None:
    """The busy fraction of the bottleneck stage's serving peers, weighted by their figures; None when
    none of them reported one."""
    target = bottleneck_stage(stage_capacities(loads, num_stages), stage_queues(loads, num_stages))
    weighted, weight = 0.0, 0.0
    for load in loads:
        if load.stage == target and not load.pending and load.utilization is not None:
            weighted += load.throughput_samples_per_s * load.utilization
            weight += load.throughput_samples_per_s
    return weighted / weight if weight > 0 else None


def worthwhile_moves(capacities: Sequence[Sequence[float]], utilization: float, min_gain: float) -> int:
    """How many of a plan's moves to make: `capacities[k]` are the stages' capacities after its first k
    moves, `utilization` the bottleneck's busy fraction now. Moves are taken in groups, each raising the
    predicted samples/s by `min_gain` over the last group's (module docstring); all of them when no
    stage has capacity now."""
    low = min(capacities[0], default=0.0)
    if low <= 0:
        return len(capacities) - 1
    u = min(max(utilization, 0.0), 1.0)
    kept, kept_rate = 0, 1.0  # rates relative to today's
    for k in range(1, len(capacities)):
        after = min(capacities[k])
        rate = 1 / (u * low / after + (1 - u)) if after > 0 else 0.0
        if rate >= kept_rate * (1 + min_gain):
            kept, kept_rate = k, rate
    return kept


def relative_stage_costs(loads: Sequence[PeerLoad], num_stages: int) -> list[float] | None:
    """Each stage's cost per sample relative to the others: 1 / the mean throughput of its serving peers.

    This assumes a peer's speed differs from another's by one factor on every stage (true of equal
    machines, or CPU-normalized figures; roughly true of GPUs of one family), which is what lets a peer's
    figure at its own stage predict its figure elsewhere. Without it a stage-0 peer moving to a stage 4x
    as costly counted 4x its real contribution there, so a plan of several moves stopped after one.
    A stage nobody serves gets the mean cost of the others; None when no stage has a serving peer.
    """
    sums, counts = [0.0] * num_stages, [0] * num_stages
    for load in loads:
        if not load.pending and load.throughput_samples_per_s > 0:
            sums[load.stage] += load.throughput_samples_per_s
            counts[load.stage] += 1
    known = [counts[s] / sums[s] for s in range(num_stages) if counts[s]]
    if not known:
        return None
    fallback = sum(known) / len(known)
    return [counts[s] / sums[s] if counts[s] else fallback for s in range(num_stages)]


def stage_for_new_peer(
    capacities: Sequence[float],
    peer_rates: Sequence[float] | None = None,
    queues: Sequence[float] | None = None,
) -> int | None:
    """The stage a joining peer should serve: the bottleneck among stages it can serve (rate > 0).

    Joining the lowest-capacity stage maximizes the pipeline's new minimum. Returns None when the peer
    can serve no stage (for example, it fits none in memory).
    """
    stages = range(len(capacities))
    feasible = [s for s in stages if peer_rates is None or peer_rates[s] > 0]
    if not feasible:
        return None
    return bottleneck_stage(capacities, queues, feasible)
