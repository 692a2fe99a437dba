"""What a trainer reports about itself: every `--log-period-s` one typed object, put in its DHT metrics
record (read by `swarmtrain status` and `monitor`) and logged as `metrics {json}` (runtime/metrics_log.py)
beside the human-readable progress line; at the end its result and transport counts, in its summary."""

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


@dataclass
class TrainerResult:
    losses: list[tuple[int, float]] = field(default_factory=list)  # (samples completed, loss)
    started: int = 0
    completed: int = 0
    failed: int = 0
    samples: int = 0
    elapsed_s: float = 0.0
    val_loss: float | None = None
    completed_ids: list[str] = field(default_factory=list)
    start_step: int = 0
    data_start_sample: int = 0  # of this trainer's shard: where its data stream resumed
    steps_closed: int = 0
    # time spent getting micro-batches from the data stream (memory-mapped shards or packed text): the
    # data path must never be what limits a trainer
    data_wait_s: float = 0.0

    def summary(self, window: int = 8) -> dict:
        first = [loss for _, loss in self.losses[:window]]
        last = [loss for _, loss in self.losses[-window:]]
        return {
            "initial_loss": sum(first) / len(first) if first else None,
            "final_loss": sum(last) / len(last) if last else None,
            "samples": self.samples,
            "samples_per_s": self.samples / self.elapsed_s if self.elapsed_s else 0.0,
            "microbatches_started": self.started,
            "microbatches_completed": self.completed,
            "microbatches_failed": self.failed,
            "start_step": self.start_step,
            "data_start_sample": self.data_start_sample,
            "steps": self.steps_closed,
            "val_loss": self.val_loss,
            "data_wait_s": self.data_wait_s,
            "data_wait_ms_per_step": 1e3 * self.data_wait_s / self.steps_closed
            if self.steps_closed
            else None,
            "data_wait_share": self.data_wait_s / self.elapsed_s if self.elapsed_s else 0.0,
        }


def transport_summary(stats) -> dict:
    """Bytes on the wire vs. the same messages with fp32 floats, per stage and direction."""
    per_stage: dict[str, dict] = {}
    for (stage, kind, direction), count in sorted(stats.snapshot().items()):
        entry = per_stage.setdefault(str(stage), {})
        entry[f"{kind}_{direction}_wire_bytes"] = count.wire_bytes
        entry[f"{kind}_{direction}_fp32_bytes"] = count.fp32_bytes
    totals = stats.totals()
    return {
        "wire_bytes": totals.wire_bytes,
        "fp32_bytes": totals.fp32_bytes,
        "messages": totals.messages,
        "per_stage": per_stage,
    }
