"""What a stage replica says about itself, from one typed snapshot (`StageSnapshot`): the `info` reply's
header (probes, tests, the monitor), the DHT announcement trainers route by, and `ServerMetrics` (its
metrics record and log line) are each a pure function of it, so the three never disagree.
`StageService.snapshot()` takes it on the compute thread's side of the service; nothing here reads
live state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.runtime.server.server_metrics import ServerMetrics
from swarmtrain.runtime.server.stage_sync import SyncCounters
from swarmtrain.runtime.server.stage_worker import WorkerCounters
from swarmtrain.runtime.server.step_inbox import StepCounters


@dataclass(frozen=True)
class CacheUsage:
    """The activation cache: forward graphs kept for their backwards, against its byte budget."""

    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0


@dataclass(frozen=True)
class StageSnapshot:
    stage: int
    digest: str
    peer_id: str
    addresses: list[str]
    behind_nat: bool
    data_port: int  # our data plane's, announced; 0: none
    device: str
    epoch: int  # steps applied: the step whose micro-batches come next
    samples_seen: int
    pending_samples: int  # accumulated, not yet applied
    serving: bool  # False while the stage state downloads
    draining: bool  # leaving the stage
    capacity_samples_per_s: float  # samples per second it could serve (runtime/server/capacity.py)
    queue_len: int  # jobs waiting for the compute thread
    busy_s: float  # compute thread busy time (wall)
    work_s: float  # micro-batch work (CPU seconds) the capacity is measured from
    compute_requests: int
    compute_calls: int
    bundles_sent: int
    direct_in: int  # requests that came over the data plane
    bytes_in: int  # transport bytes received, sent, and what was sent would be with fp32 floats
    bytes_out: int
    fp32_bytes_out: int
    fingerprint: object  # [step, [sum |p|, sum p]] as compared between replicas (None before one)
    # copies taken with the snapshot: the live counters go on counting
    worker: WorkerCounters = field(default_factory=WorkerCounters)
    cache: CacheUsage = field(default_factory=CacheUsage)
    sync: SyncCounters = field(default_factory=SyncCounters)
    steps: StepCounters = field(default_factory=StepCounters)
    # what callers hold against the request bounds, and the bounds (net/data_plane.py's `status`, or
    # net/server_bounds.py's without a data plane; empty: no transport yet): the net layer's flat record
    data_plane: Mapping[str, int | str | None] = field(default_factory=dict)
    # what the capacity is the least of (runtime/server/capacity.py): compute, and each direction of
    # the data plane's links where measured (None: not), and which of them limits it
    limit: str = "compute"
    compute_samples_per_s: float | None = None
    uplink_samples_per_s: float | None = None
    downlink_samples_per_s: float | None = None
    swarm_samples_per_s: float = 0.0  # the swarm's rate as the steps applied here show it (0: not known)
    utilization: float = 0.0  # busy fraction of the resource named by `limit` (0: not known)


def info_header(snap: StageSnapshot, names: list[str]) -> dict:
    """The `info` reply's header (tensors, on request, are the service's)."""
    return {
        "stage": snap.stage,
        "digest": snap.digest,
        "peer": snap.peer_id,
        "epoch": snap.epoch,
        "samples_seen": snap.samples_seen,
        "pending_samples": snap.pending_samples,
        "serving": snap.serving,
        "fingerprint": snap.fingerprint,
        "counters": dataclasses.asdict(snap.worker),
        "cache": dataclasses.asdict(snap.cache),
        "compute": {
            "requests": snap.compute_requests,
            "calls": snap.compute_calls,
            "bundles_sent": snap.bundles_sent,
        },
        "direct_in": snap.direct_in,
        "data_plane": dict(snap.data_plane),
        "capacity": capacity_of(snap),
        "device": snap.device,
        "sync": dataclasses.asdict(snap.sync),
        "steps": dataclasses.asdict(snap.steps),
        "names": names,
    }


def announcement_of(snap: StageSnapshot, state: str | None = None) -> StageAnnouncement:
    """The DHT record trainers route by; `state` (default: from the snapshot) online, joining or offline.
    What the digest is made of goes in its own record (`RunRecords.publish_settings`), not in this one."""
    state = state or ("offline" if snap.draining else "online" if snap.serving else "joining")
    return StageAnnouncement(
        stage=snap.stage,
        addresses=snap.addresses,
        throughput_samples_per_s=snap.capacity_samples_per_s,
        queue_len=snap.queue_len,
        config_digest=snap.digest,
        state_version=snap.epoch,
        state=state,
        behind_nat=snap.behind_nat,
        data_port=snap.data_port,
        limit=snap.limit,
        swarm_samples_per_s=snap.swarm_samples_per_s,
        utilization=snap.utilization,
    )


def capacity_of(snap: StageSnapshot) -> dict:
    """The capacity and what it is the least of, samples/s rounded (None: a link not measured)."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    return {
        "samples_per_s": rounded(snap.capacity_samples_per_s),
        "limit": snap.limit,
        "compute": rounded(snap.compute_samples_per_s),
        "uplink": rounded(snap.uplink_samples_per_s),
        "downlink": rounded(snap.downlink_samples_per_s),
    }


def metrics_of(snap: StageSnapshot, moved: dict | None = None) -> ServerMetrics:
    """The server's metrics record; `moved`: the cost of the move that brought it here, if any."""
    c, s, st = snap.worker, snap.sync, snap.steps
    return ServerMetrics(
        stage=snap.stage,
        step=snap.epoch,
        samples_seen=snap.samples_seen,
        samples_per_s=round(snap.capacity_samples_per_s, 2),
        queue_len=snap.queue_len,
        pending_samples=snap.pending_samples,
        forward=c.forward + c.fused,
        backward=c.backward + c.fused,
        recomputed=c.recomputed,
        duplicates=c.duplicates,
        late=c.late,
        partial_exchanges=st.partial_exchanges,
        solo_steps=st.solo_steps,
        resyncs=s.resyncs,
        lost_samples=s.lost_samples,
        group_size=st.last_group_size,
        exchange_s=round(st.last_exchange_s, 4),
        bytes_in=snap.bytes_in,
        samples_forward=c.samples_forward,
        busy_s=round(snap.busy_s, 3),
        work_s=round(snap.work_s, 3),
        batched_requests=snap.compute_requests - snap.compute_calls,
        bundles_sent=snap.bundles_sent,
        direct_in=snap.direct_in,
        bytes_out=snap.bytes_out,
        fp32_bytes_out=snap.fp32_bytes_out,
        padded_samples=c.padded_samples,
        moved=moved,
    )
