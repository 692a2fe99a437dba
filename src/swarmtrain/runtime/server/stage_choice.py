"""`swarmtrain server --stage auto`: the stage a joining server should serve, decided from what the
stages' peers announce in the DHT by the same pure policy the simulator uses
(`planner.rebalance.stage_for_new_peer`: the bottleneck, i.e. the stage with the least capacity;
empty stages first, then the lower index).

Only peers announcing this run's config digest count, "joining" ones included (they are on their way
into a stage, with a measured throughput), so servers started one after another spread over the
stages. A random wait of up to `jitter_s` first makes two servers started at the same moment unlikely
to read the same state and pick the same stage.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from swarmtrain.config import RunConfig
from swarmtrain.net.dht_records import RunRecords
from swarmtrain.net.engine import shutdown_quietly, start_dht
from swarmtrain.planner.rebalance import stage_for_new_peer
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class StageChoice:
    stage: int
    capacities_samples_per_s: list[float]
    peers_per_stage: list[int]


def read_stage_loads(cfg: RunConfig, records) -> tuple[list[float], list[float], list[int]]:
    """(capacity, queue, peer count) per stage over the peers announcing this run's config."""
    n, digest = cfg.swarm.num_stages, cfg.digest()
    capacities, queues, counts = [0.0] * n, [0.0] * n, [0] * n
    for stage in range(n):
        for announcement in records.stage_peers(stage).values():
            if announcement.config_digest == digest:
                capacities[stage] += announcement.throughput_samples_per_s
                queues[stage] += announcement.queue_len
                counts[stage] += 1
    return capacities, queues, counts


def choose_stage(cfg: RunConfig, records) -> StageChoice:
    capacities, queues, counts = read_stage_loads(cfg, records)
    # an empty stage has no capacity at all: it is the bottleneck before any measured one
    stage = stage_for_new_peer(capacities, queues=queues)
    assert stage is not None  # every stage is feasible without per-stage rates
    return StageChoice(stage, capacities, counts)


def choose_stage_live(
    cfg: RunConfig, initial_peers: list[str], network, jitter_s: float = 1.0
) -> StageChoice:
    """Join the swarm briefly (a client DHT) to read the stages' loads; the stage to serve, with the
    loads it was chosen from (the server's ledger records them: `stage_choice`)."""
    dht = start_dht(initial_peers, network, client_mode=True)
    try:
        time.sleep(random.uniform(0.0, jitter_s))
        choice = choose_stage(cfg, RunRecords(dht, cfg.swarm.run_id))
    finally:
        shutdown_quietly(dht)
    logger.info(
        "--stage auto: stages have %s peer(s), %s samples/s: serving stage %d (the bottleneck)",
        choice.peers_per_stage,
        [round(c, 1) for c in choice.capacities_samples_per_s],
        choice.stage,
    )
    return choice
