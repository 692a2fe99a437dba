"""What a replica reports about its progress at every log point: one typed object, logged as
`metrics {json}` (runtime/metrics_log.py) beside the human-readable progress line."""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.runtime.metrics_log import MetricsRecord


@dataclass(frozen=True)
class ReplicaMetrics(MetricsRecord):
    shard: str  # "index/count" of the data this replica trains on
    inner_step: int  # local steps taken (the run's position: every replica takes the same steps)
    stop_step: int  # the local step this replica stops at
    samples: int  # the run's samples so far as this replica counts them: inner_step x global batch
    outer_step: int
    loss: float  # the last local training loss (nan before the first)
    samples_per_s: float  # this replica's own samples per second
    rounds_averaged: int
    rounds_alone: int
    rounds_resynced: int
    role: str = "replica"


def replica_metrics_from_log(text: str) -> list[ReplicaMetrics]:
    """Every metrics line of a replica's log, oldest first."""
    return ReplicaMetrics.from_log(text)
