"""A stage replica's `info` header, DHT announcement and metrics all derive from one snapshot
(runtime/server/stage_status.py), so they never disagree."""

import dataclasses
import json

import pytest

from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.runtime.server.stage_status import (
    CacheUsage,
    StageSnapshot,
    announcement_of,
    info_header,
    metrics_of,
)
from swarmtrain.runtime.server.stage_sync import SyncCounters
from swarmtrain.runtime.server.stage_worker import WorkerCounters
from swarmtrain.runtime.server.step_inbox import StepCounters

pytestmark = pytest.mark.unit

SNAPSHOT = StageSnapshot(
    stage=1,
    digest="d",
    peer_id="P",
    addresses=["/ip4/127.0.0.1/tcp/1"],
    behind_nat=False,
    data_port=4000,
    device="cpu fp32",
    epoch=7,
    samples_seen=448,
    pending_samples=32,
    serving=True,
    draining=False,
    capacity_samples_per_s=512.345,
    queue_len=2,
    busy_s=3.25,
    work_s=2.5,
    compute_requests=10,
    compute_calls=8,
    bundles_sent=1,
    direct_in=5,
    bytes_in=1000,
    bytes_out=2000,
    fp32_bytes_out=8000,
    fingerprint=[7, [1.0, 2.0]],
    worker=WorkerCounters(forward=60, fused=2, samples_forward=480),
    cache=CacheUsage(entries=3, bytes=4096, budget_bytes=1 << 20),
    sync=SyncCounters(resyncs=1, lost_samples=16),
    steps=StepCounters(solo_steps=7, last_group_size=1, last_exchange_s=0.01234),
    data_plane={"held_bytes": 0, "refused": 0, "limited_by": "memory"},
)


def test_the_three_views_agree_on_what_they_share():
    header, ann, metrics = info_header(SNAPSHOT, ["w"]), announcement_of(SNAPSHOT), metrics_of(SNAPSHOT)
    assert header["epoch"] == ann.state_version == metrics.step == 7
    assert ann.throughput_samples_per_s == 512.345 and metrics.samples_per_s == 512.35
    assert header["compute"]["bundles_sent"] == metrics.bundles_sent == 1
    assert header["direct_in"] == metrics.direct_in == 5 and metrics.batched_requests == 2
    assert (metrics.forward, metrics.backward, metrics.resyncs, metrics.lost_samples) == (62, 2, 1, 16)
    assert (metrics.bytes_in, metrics.bytes_out, metrics.fp32_bytes_out) == (1000, 2000, 8000)
    assert ann.data_port == 4000 and header["names"] == ["w"]
    assert metrics_from_log(metrics.log_line()) == [metrics]


# every key the `info` reply's nested records carry, in order: probes, tests, benches and the monitor read
# them by name (tests/integration, bench/device_stage.py, runtime/harness/probe.py)
INFO_KEYS = {
    "counters": [
        "forward", "backward", "fused", "eval", "recomputed", "duplicates", "not_accumulated", "late",
        "rejected_nonfinite", "skipped_steps", "samples_forward", "padded_samples",
    ],
    "cache": ["entries", "bytes", "budget_bytes"],
    "sync": ["resyncs", "lost_samples", "downloaded_bytes", "extra"],
    "steps": [
        "steps", "partial_exchanges", "solo_steps", "timed_out_closes", "unconfirmed_samples",
        "last_group_size", "last_exchange_s", "clipped_contributions", "replayed_steps", "refused_closes",
        "unknown_member_closes", "ignored_grads", "disagreeing_closes", "lenient_steps", "held_steps",
    ],
    "compute": ["requests", "calls", "bundles_sent"],
    "capacity": ["samples_per_s", "limit", "compute", "uplink", "downlink"],
}  # fmt: skip


def test_the_info_header_keeps_its_keys_and_is_json():
    header = info_header(SNAPSHOT, ["w"])
    for name, keys in INFO_KEYS.items():
        assert list(header[name]) == keys, name
    assert header["counters"]["forward"] == 60 and header["steps"]["solo_steps"] == 7
    assert header["data_plane"] == {"held_bytes": 0, "refused": 0, "limited_by": "memory"}
    assert json.loads(json.dumps(header)) == header


@pytest.mark.parametrize(
    ("serving", "draining", "state"),
    [(True, False, "online"), (False, False, "joining"), (True, True, "offline")],
)
def test_the_announced_state_follows_serving_and_draining(serving, draining, state):
    snap = dataclasses.replace(SNAPSHOT, serving=serving, draining=draining)
    assert announcement_of(snap).state == state
    assert announcement_of(snap, state="offline").state == "offline"  # said on purpose (a stop, a move)
