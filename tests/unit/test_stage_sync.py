"""Keeping replicas in line (runtime/stage_sync.py), on fakes of the DHT records and of the averager."""

import pytest
import torch

from swarmtrain.net.protocol import StageRequest
from swarmtrain.runtime.stage_sync import StageSynchronizer, SyncSettings
from swarmtrain.runtime.stage_worker import StageWorker

pytestmark = pytest.mark.unit


class FakeRecords:
    def __init__(self):
        self.progress = {}

    def stage_progress(self, stage):
        return {peer: dict(value) for peer, value in self.progress.items()}

    def publish_progress(self, stage, peer, value, ttl_s):
        self.progress[peer] = dict(value)
        return True


class FakeAverager:
    """Serves a donor's state to `download_state` and records the calls."""

    def __init__(self, donor_state=None):
        self.state_sharing_priority = 0.0
        self.calls, self.donor_state = [], donor_state

    def download_state(self, timeout_s):
        self.calls.append(("download",))
        return self.donor_state


@pytest.fixture
def make_sync(tiny_cfg, start_compute):
    def make(peer="B", averager=None, lag_grace_s=3.0):
        worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
        records, averager = FakeRecords(), averager or FakeAverager()
        settings = SyncSettings(lag_grace_s=lag_grace_s)
        sync = StageSynchronizer(worker, start_compute(), averager, records, peer, "d", settings)
        return sync, worker, records, averager

    return make


def _train(worker, count, step=0):
    for i in range(count):
        x = torch.randn(8, 64, 64)
        y = torch.randint(0, 256, (8, 64))
        request = StageRequest("forward", f"m{step}-{i}", "none", x, labels=y, fused_backward=True, step=step)
        worker.forward(request)


def _apply(worker):
    bucket = worker.seal(worker.epoch)
    worker.apply_step(worker.epoch, [g / bucket.samples for g in bucket.grad_sums], bucket.samples)


def _peer(epoch, grad_fp=None):
    return {"epoch": epoch, "samples": 0, "digest": "d", "grad_fp": grad_fp}


def test_a_replica_far_behind_drops_its_work_and_downloads(make_sync, tiny_cfg):
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    for step in range(6):
        _train(donor, 4, step)
        _apply(donor)
    sync, worker, records, averager = make_sync(averager=FakeAverager(donor_state=donor.export_state()))
    _train(worker, 2)
    records.progress["A"] = _peer(6)
    sync.tick()
    assert ("download",) in averager.calls
    assert worker.epoch == 6 and worker.unapplied_samples == 0 and sync.counters.lost_samples == 16
    assert all(torch.equal(a, b) for a, b in zip(worker.params, donor.params, strict=True))
    assert sync.serving.is_set()


def test_one_step_behind_is_normal_for_a_moment_but_not_for_long(make_sync, tiny_cfg):
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    _train(donor, 4)
    _apply(donor)
    sync, worker, records, averager = make_sync(
        averager=FakeAverager(donor_state=donor.export_state()), lag_grace_s=0.2
    )
    records.progress["A"] = _peer(1)
    sync.tick()  # the peer finished the step's exchange a moment before us: no resync
    assert averager.calls == [] and worker.epoch == 0
    import time

    time.sleep(0.25)
    sync.tick()  # still behind after the grace period: we missed the step
    assert averager.calls == [("download",)] and worker.epoch == 1


def test_diverged_replica_with_larger_id_resyncs(make_sync):
    sync, worker, records, averager = make_sync(peer="B")
    sync._grad_fp = [1.0, 2.0]
    records.progress["A"] = _peer(0, grad_fp=[1.0, 2.5])
    sync.tick()
    assert ("download",) in averager.calls  # A < B: B follows A
    sync2, _, records2, averager2 = make_sync(peer="0")
    sync2._grad_fp = [1.0, 2.0]
    records2.progress["A"] = _peer(0, grad_fp=[1.0, 2.5])
    sync2.tick()
    assert ("download",) not in averager2.calls
