"""The server's metrics object: one JSON line in the log that benches read back, the DHT record's keys
that the monitor reads, and the fault hooks the command line builds from a test's environment."""

import math

import pytest
import torch

from swarmtrain.monitor.snapshot import SERVER_KEYS
from swarmtrain.runtime.faults import NO_FAULTS, FaultHooks
from swarmtrain.runtime.server.server_metrics import ServerMetrics, metrics_from_log

pytestmark = pytest.mark.unit


def _metrics(**overrides) -> ServerMetrics:
    fields = dict(
        stage=1,
        step=7,
        samples_seen=448,
        samples_per_s=512.5,
        queue_len=0,
        pending_samples=32,
        forward=60,
        backward=58,
        recomputed=1,
        duplicates=0,
        late=0,
        partial_exchanges=0,
        solo_steps=7,
        resyncs=0,
        lost_samples=0,
        group_size=1,
        exchange_s=0.0123,
        bytes_in=123456,
        samples_forward=480,
        busy_s=3.25,
        work_s=2.5,
    )
    return ServerMetrics(**{**fields, **overrides})


def test_a_log_of_metrics_lines_reads_back_as_the_objects_logged():
    first, second = _metrics(), _metrics(step=8, moved={"from": 0, "to": 1, "seconds": 4.2, "bytes": 10})
    log = "\n".join(
        [
            "2026-11-23 12:00:00 INFO stage 1 replica Qm... ready",
            "2026-11-23 12:00:05 INFO " + first.log_line(),
            "2026-11-23 12:00:07 INFO metrics {cut off by a kill",
            "2026-11-23 12:00:10 INFO " + second.log_line(),
        ]
    )
    assert metrics_from_log(log) == [first, second]


def test_the_dht_record_carries_every_key_the_monitor_reads():
    record = _metrics().to_dict()
    assert record["role"] == "server"
    assert set(SERVER_KEYS) <= set(record)


def test_a_record_from_a_newer_server_with_extra_keys_still_reads():
    record = {**_metrics().to_dict(), "a_field_added_later": 3}
    assert ServerMetrics.from_dict(record) == _metrics()


def test_fault_hooks_reach_a_peer_only_through_the_test_entry_point(monkeypatch):
    """`swarmtrain server`/`replica` always run with NO_FAULTS whatever the environment holds (the old
    fault variables included); `swarmtrain.cli.faulty` hands the hooks it is given to the command."""
    from swarmtrain.cli import faulty, main, replica, server

    for name in ("SWARMTRAIN_FAULT_GRAD_SCALE", "SWARMTRAIN_FAULT_NAN_GRADS_EVERY"):
        monkeypatch.setenv(name, "3")
    seen = []
    for module in (server, replica):
        monkeypatch.setattr(module, "run", lambda args, faults=None: seen.append(faults) or 0)
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer"]
    assert main.main(["server", "--stage", "0", *peers]) == 0
    assert main.main(["replica", "--shard", "0/2", *peers]) == 0
    assert seen == [None, None]  # run() then uses NO_FAULTS
    hooks = FaultHooks(grad_scale=1e6, nan_every=3, drop_results_in=2)
    assert faulty.main([*hooks.as_args(), "--", "replica", "--shard", "1/2", *peers]) == 0
    assert seen[-1] == hooks
    with pytest.raises(SystemExit):  # only the two peers that take hooks
        faulty.main(["--nan-every", "2", "--", "trainer"])
    tensors = [torch.ones(2)]
    assert NO_FAULTS.corrupted(tensors, 3) is tensors
    assert all(math.isnan(v) for v in hooks.corrupted(tensors, 3)[0].tolist())
    assert hooks.corrupted(tensors, 4)[0].tolist() == [1e6, 1e6]
