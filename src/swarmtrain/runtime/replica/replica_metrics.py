"""What a replica reports about its progress at every log point: one typed object, logged as
`metrics {json}` (runtime/metrics_log.py) beside the human-readable progress line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmtrain.runtime.metrics_log import MetricsRecord
from swarmtrain.utils.logging import get_logger

if TYPE_CHECKING:
    from swarmtrain.runtime.replica.replica_peer import ReplicaSummary

logger = get_logger(__name__)


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


def log_progress(
    summary: ReplicaSummary, inner_step: int, stop_step: int, outer_step: int, global_batch: int
) -> None:
    """The progress line a replica logs at each log point, and its metrics line."""
    s = summary
    m = ReplicaMetrics(
        shard=s.shard,
        inner_step=inner_step,
        stop_step=stop_step,
        samples=inner_step * global_batch,
        outer_step=outer_step,
        loss=s.final_loss if s.final_loss is not None else float("nan"),
        samples_per_s=s.samples_per_s,
        rounds_averaged=s.rounds_averaged,
        rounds_alone=s.rounds_alone,
        rounds_resynced=s.rounds_resynced,
    )
    logger.info(
        "replica %s: inner step %d/%d (run at ~%d samples), outer step %d, loss %.4f, %.1f samples/s, "
        "rounds averaged %d alone %d resynced %d",
        m.shard,
        m.inner_step,
        m.stop_step,
        m.samples,
        m.outer_step,
        m.loss,
        m.samples_per_s,
        m.rounds_averaged,
        m.rounds_alone,
        m.rounds_resynced,
    )
    logger.info("%s", m.log_line())
