"""A stage replica's `info` header, DHT announcement and metrics all derive from one snapshot
(runtime/server/stage_status.py), so they never disagree."""

import dataclasses

import pytest

from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.runtime.server.stage_status import StageSnapshot, announcement_of, info_header, metrics_of

pytestmark = pytest.mark.unit

WORKER = dict.fromkeys(
    ["forward", "backward", "fused", "eval", "recomputed", "duplicates", "late", "samples_forward"], 0
)
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
    worker={**WORKER, "forward": 60, "fused": 2, "samples_forward": 480},
    cache={"entries": 3, "bytes": 4096},
    sync={"resyncs": 1, "lost_samples": 16, "downloaded_bytes": 0},
    steps={"partial_exchanges": 0, "solo_steps": 7, "last_group_size": 1, "last_exchange_s": 0.01234},
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


@pytest.mark.parametrize(
    ("serving", "draining", "state"),
    [(True, False, "online"), (False, False, "joining"), (True, True, "offline")],
)
def test_the_announced_state_follows_serving_and_draining(serving, draining, state):
    snap = dataclasses.replace(SNAPSHOT, serving=serving, draining=draining)
    assert announcement_of(snap).state == state
    assert announcement_of(snap, state="offline").state == "offline"  # said on purpose (a stop, a move)
