"""The rebalancing plan on what a swarm announces: every stage server's plan (runtime/server/balancer.py
acts on its own part of it) and the one `swarmtrain status` and `swarmtrain monitor` show
(monitor/snapshot.py). Pure functions on plain data, here so that the monitor and the runtime share
them without the monitor importing runtime code.

`announced` maps stage -> peer id -> a stage announcement (`net.dht_records.StageAnnouncement`, or
anything with its fields: config_digest, state, throughput_samples_per_s, queue_len, utilization,
swarm_samples_per_s); a lease is a `{run}.moves` record, {"from", "to", "rate", "state"}, whose state
is PROPOSED, MOVING or DONE (the lease protocol is in balancer.py's docstring).
"""

from __future__ import annotations

import math
import statistics

from swarmtrain.planner.rebalance import Move, PeerLoad, RebalanceConfig, plan_moves, relative_stage_costs

PROPOSED, MOVING, DONE = "proposed", "moving", "done"


def loads_from_announcements(announced: dict[int, dict], digest: str) -> list[PeerLoad]:
    """PeerLoads of the peers announcing this run's config (joining ones as pending)."""
    loads = []
    for stage, peers in announced.items():
        for peer, a in peers.items():
            if (
                a.config_digest == digest
                and a.state in ("online", "joining")
                and _finite_nonnegative(a.throughput_samples_per_s, a.queue_len)
            ):
                loads.append(
                    PeerLoad(
                        peer,
                        stage,
                        a.throughput_samples_per_s,
                        a.queue_len,
                        pending=a.state == "joining",
                        utilization=a.utilization if 0 < a.utilization <= 1 else None,
                    )
                )
    return loads


def _finite_nonnegative(*values) -> bool:
    """A NaN throughput made every server's plan fail (min() of NaN) and stopped rebalancing swarm-wide."""
    return all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values)


def valid_lease(lease: object, num_stages: int) -> bool:
    if not isinstance(lease, dict) or lease.get("state") not in (PROPOSED, MOVING, DONE):
        return False
    to = lease.get("to")
    return isinstance(to, int) and 0 <= to < num_stages and _finite_nonnegative(lease.get("rate"))


def with_leases(loads: list[PeerLoad], leases: dict[str, dict]) -> list[PeerLoad]:
    """The loads with every leased mover serving its target already (pending: it never moves again in
    this plan), at the rate its plan expected: mid-move its records say offline, joining or nothing."""
    kept = [load for load in loads if load.peer not in leases]
    return kept + [
        PeerLoad(peer, lease["to"], float(lease["rate"]), pending=True) for peer, lease in leases.items()
    ]


def swarm_plan(
    announced: dict[int, dict],
    leases: dict[str, dict],
    num_stages: int,
    digest: str,
    margin: float,
    weigh: bool = True,
) -> list[Move]:
    """The moves the balancer plans, every server's and `swarmtrain status`'s alike: on the stages'
    announcements (stage -> peer -> StageAnnouncement), with every valid lease in `leases` counted as a
    move already made, and (`weigh`) only moves worth their cost at the bottleneck's busy fraction."""
    loads = loads_from_announcements(announced, digest)
    costs = relative_stage_costs(loads, num_stages)
    leases = {peer: lease for peer, lease in leases.items() if valid_lease(lease, num_stages)}
    loads = with_leases(loads, leases)
    return plan_moves(loads, num_stages, RebalanceConfig(margin), costs, len(loads), weigh)


def observed_samples_per_s(announced: dict[int, dict], digest: str) -> float | None:
    """What the swarm runs at: the median of its serving replicas' figures (each from the steps it
    applied; a median, so one replica's odd figure does not move it); None when nobody knows."""
    figures = [
        a.swarm_samples_per_s
        for peers in announced.values()
        for a in peers.values()
        if a.config_digest == digest and a.state == "online" and a.swarm_samples_per_s > 0
    ]
    return statistics.median(figures) if figures else None


def live_leases(moves: dict[str, dict]) -> dict[str, dict]:
    """The leases of moves under way (proposed or committed): a released one's mover serves already."""
    return {
        peer: lease for peer, lease in moves.items() if isinstance(lease, dict) and lease.get("state") != DONE
    }
