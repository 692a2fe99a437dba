"""What a trainer reports about itself every `--log-period-s`: one typed object, put in its DHT
metrics record (read by `swarmtrain status` and `monitor`) and logged as `metrics {json}`
(runtime/metrics_log.py) beside the human-readable progress line."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmtrain.runtime.metrics_log import MetricsRecord


@dataclass(frozen=True)
class TrainerMetrics(MetricsRecord):
    samples: int  # samples of completed micro-batches since this trainer started
    loss: float  # mean training loss of the last 16 completed micro-batches (nan before the first)
    samples_per_s: float  # samples / seconds since the training loop started
    completed: int  # micro-batches
    failed: int  # micro-batches given up on
    in_flight: int  # micro-batches started, neither completed nor failed
    retries: int  # calls sent again (to the same or another peer)
    timeouts: int  # calls that waited out their deadline
    peers_per_stage: list[int] = field(default_factory=list)  # usable peers the trainer sees
    role: str = "trainer"


def trainer_metrics_from_log(text: str) -> list[TrainerMetrics]:
    """Every metrics line of a trainer's log, oldest first."""
    return TrainerMetrics.from_log(text)
