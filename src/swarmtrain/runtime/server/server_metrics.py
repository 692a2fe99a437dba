"""What a stage server publishes about itself: one typed object, sent as JSON.

Every `metrics_period_s` a server puts `ServerMetrics.to_dict()` in its DHT metrics record (read by
`swarmtrain status` and `monitor`, monitor/snapshot.py) and logs it as one line, `metrics {json}`
(runtime/metrics_log.py). Benchmarks and tests read the log with `metrics_from_log`.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.runtime.metrics_log import MetricsRecord


@dataclass(frozen=True)
class ServerMetrics(MetricsRecord):
    stage: int
    step: int  # optimizer steps applied (the global step whose micro-batches come next)
    samples_seen: int
    samples_per_s: float  # announced capacity: samples per second of their work on the compute device
    queue_len: int  # jobs waiting for the compute thread
    pending_samples: int  # accumulated, not yet applied
    forward: int  # forward jobs (incl. fused forward-backward)
    backward: int  # backward jobs (incl. fused)
    recomputed: int  # backwards whose graph had been dropped and was recomputed
    duplicates: int  # micro-batches refused because they were already accumulated
    late: int  # micro-batches that came after their step was closed
    partial_exchanges: int  # steps applied without some member's gradients
    solo_steps: int  # steps applied alone (no other replica)
    resyncs: int  # state downloads after the joining one
    lost_samples: int  # accumulated samples dropped by resyncs
    group_size: int  # replicas in the last step's exchange
    exchange_s: float  # duration of the last step's exchange
    bytes_in: int  # wire bytes received by the transport (libp2p and the data plane): requests, replies
    samples_forward: int  # samples whose forward ran here
    busy_s: float  # compute thread busy time (wall)
    work_s: float  # the device's seconds of micro-batch work (what capacity is measured from)
    batched_requests: int = 0  # requests that shared a compute call with another (--max-batch-tokens)
    bundles_sent: int = 0  # hand-offs to the next stage that carried several micro-batches (net/bundle.py)
    direct_in: int = 0  # requests that came over the direct data plane (net/data_plane.py), not libp2p
    bytes_out: int = 0  # wire bytes sent by the transport (libp2p and the data plane): requests, replies
    fp32_bytes_out: int = 0  # what bytes_out would have been with every float tensor in fp32
    # zero-gradient samples of batched graphs' backwards (runtime/server/stage_batches.py)
    padded_samples: int = 0
    moved: dict | None = None  # the cost of the move that brought this server here, if any
    role: str = "server"


def metrics_from_log(text: str) -> list[ServerMetrics]:
    """Every metrics line of a server's log, oldest first (lines of other kinds are skipped)."""
    return ServerMetrics.from_log(text)
