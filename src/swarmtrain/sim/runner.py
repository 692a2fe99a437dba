"""One call runs one simulation: derive costs and rates, pick the granularity, build the mode, run it.

Granularity: simulating every sample of a thousand-GPU fleet is millions of events per simulated
minute, so micro-batches are *aggregated*: one simulated chunk carries `chunk_samples` samples (a
multiple of nothing in particular, at least the configured micro-batch size). Derived from the event
budget: a chunk costs about 4 events per stage visited, so
`chunk_samples = max(micro_batch_size, ceil(4 * S * T0 * duration / event_budget))` with T0 the optimum
at the start, but never so coarse that a slow peer (10th percentile of mean rate) needs more than 1% of
the run for one chunk (large fleets then run more events than the budget: 10,000 peers take minutes). Compute and bytes per sample are unchanged by aggregation; latency is paid once per chunk
(it is hidden by micro-batches in flight anyway) and a failure loses a whole chunk's progress.

Micro-batches in flight (SWARM): `in_flight_per_peer` per live peer plus enough to cover the network
round trip at the optimum by Little's law: `1.5 * (T0 / chunk) * 2S * hop_s`, where `hop_s` is the mean
latency plus the chunk's transfer time over typical links (`_hop_s`).
"""

from __future__ import annotations

import math

import numpy as np

from swarmtrain.config import RunConfig
from swarmtrain.sim.base import Observer, SimConfig, Simulation
from swarmtrain.sim.churn import ChurnSchedule
from swarmtrain.sim.costs import StageCosts, compute_s_per_sample, rate_table, stage_costs
from swarmtrain.sim.entities import Fleet
from swarmtrain.sim.fleet import FleetError
from swarmtrain.sim.metrics import SimResult
from swarmtrain.sim.optimal import optimal_allocation

EVENTS_PER_CHUNK_PER_STAGE = 4
MAX_CHUNK_FRACTION_OF_RUN = 0.01  # a slow (10th percentile) peer computes a chunk in <= 1% of the run
MAX_TRAINERS = 8
PEERS_PER_TRAINER = 500  # each trainer has its own, staler view of peers: fewer trainers route better


def costs_for(
    run: RunConfig, global_batch_size: int | None = None, exchange: str = "butterfly"
) -> StageCosts:
    return stage_costs(
        run.model,
        run.stages(),
        run.swarm.compression,
        run.training.micro_batch_size,
        global_batch_size or run.training.global_batch_size,
        exchange=exchange,
        exchange_compression=run.swarm.exchange_compression,
    )


def _hop_s(fleet: Fleet, costs: StageCosts, live: list[int], chunk: int) -> float:
    """Mean time of one stage-to-stage hop between random live peers: latency plus the chunk's transfer
    time at the receiver's and sender's access links and the path cap (no queueing)."""
    if not live:
        return 0.0
    counts = np.bincount([fleet.peers[i].location for i in live], minlength=len(fleet.locations.names))
    weights = np.outer(counts, counts) / counts.sum() ** 2
    latency = float((np.array(fleet.locations.latency_s) * weights).sum())
    inv_path = float((weights / np.array(fleet.locations.bandwidth_bytes_per_s)).sum())
    inv_link = np.mean(
        [1 / min(fleet.peers[i].uplink_bytes_per_s, fleet.peers[i].downlink_bytes_per_s) for i in live]
    )
    return latency + chunk * costs.activation_bytes_per_sample * (inv_link + inv_path)


def _chunk_samples(costs: StageCosts, config: SimConfig, table, live: list[int], start_optimum: float) -> int:
    by_budget = (
        EVENTS_PER_CHUNK_PER_STAGE
        * costs.num_stages
        * start_optimum
        * config.duration_s
        / config.event_budget
    )
    rates = table.rates(costs, 0.0)[live].mean(axis=1) if live else np.zeros(1)
    slow_rate = float(np.percentile(rates[rates > 0], 10)) if (rates > 0).any() else 0.0
    by_quality = MAX_CHUNK_FRACTION_OF_RUN * config.duration_s * slow_rate
    return max(costs.micro_batch_size, math.ceil(min(by_budget, max(by_quality, 1.0))))


def run_simulation(
    fleet: Fleet,
    run: RunConfig,
    config: SimConfig,
    schedule: ChurnSchedule | None = None,
    global_batch_size: int | None = None,
    observer: Observer | None = None,
) -> SimResult:
    """`observer(sim, now_s)`: called at each recorded sample point (`sim/timeline.py` makes frames)."""
    costs = costs_for(run, global_batch_size, config.stage_exchange)
    schedule = schedule or ChurnSchedule(())
    for peer in fleet.peers:
        for stage in (peer.stage, peer.home_stage):
            if stage is not None and stage >= costs.num_stages:
                raise FleetError(
                    f"peer {peer.peer_id} is placed at stage {stage}; the model has {costs.num_stages}"
                )
        if peer.compute_s_per_sample is not None and len(peer.compute_s_per_sample) != costs.num_stages:
            raise FleetError(
                f"peer {peer.peer_id} has {len(peer.compute_s_per_sample)} measured compute times, "
                f"the model has {costs.num_stages} stages"
            )
    compute = [compute_s_per_sample(p, costs) for p in fleet.peers]
    table = rate_table(list(fleet.peers), compute)
    live = [i for i in range(fleet.num_peers) if i not in schedule.initially_offline]
    start_optimum = optimal_allocation(table, costs, live).throughput_samples_per_s
    sim = build(fleet, costs, config, schedule, compute, table, live, start_optimum, run)
    result = sim.run(observer)
    result.summary["start_optimal_samples_per_s"] = start_optimum
    result.summary["audit"] = sim.audit()
    return result


def build(
    fleet: Fleet,
    costs: StageCosts,
    config: SimConfig,
    schedule: ChurnSchedule,
    compute,
    table,
    live: list[int],
    start_optimum: float,
    run: RunConfig,
) -> Simulation:
    from swarmtrain.sim.gpipe import GPipeSimulation
    from swarmtrain.sim.replicas import ReplicaSimulation
    from swarmtrain.sim.swarm import SwarmSimulation

    S = costs.num_stages
    mbs = costs.micro_batch_size
    if config.mode == "async-replicas":
        local = config.local_batch_samples or max(mbs, costs.global_batch_size // 16)
        return ReplicaSimulation(
            fleet, costs, config, schedule, compute, table, local, local_batch_samples=local
        )
    chunk = config.chunk_samples or _chunk_samples(costs, config, table, live, start_optimum)
    if config.mode == "gpipe":
        return GPipeSimulation(fleet, costs, config, schedule, compute, table, chunk)
    trainers = config.num_trainers or min(MAX_TRAINERS, max(1, math.ceil(len(live) / PEERS_PER_TRAINER)))
    in_flight = config.in_flight or math.ceil(
        config.in_flight_per_peer * max(len(live), 1)
        + 1.5 * (start_optimum / chunk) * 2 * S * _hop_s(fleet, costs, live, chunk)
    )
    return SwarmSimulation(
        fleet, costs, config, schedule, compute, table, chunk, num_trainers=trainers, in_flight=in_flight
    )
