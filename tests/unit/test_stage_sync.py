"""The intra-stage synchronizer's decisions, on fakes of the DHT records and of the averager."""

import pytest
import torch

from swarmtrain.net.averaging import RoundResult
from swarmtrain.net.protocol import StageRequest
from swarmtrain.runtime.compute import ComputeWorker
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
    """Plays the other replica: returns `result` (or None = no group) and records the calls."""

    def __init__(self, donor_state=None):
        self.state_sharing_priority = 0.0
        self.result, self.calls, self.donor_state = None, [], donor_state

    def configure_round(self, epoch, group_size):
        self.calls.append(("configure", epoch, group_size))

    def average(self, tensors, weight, gather, find_group_timeout_s, allreduce_timeout_s):
        self.calls.append(("average", weight, gather))
        return self.result(tensors, weight, gather) if self.result else None

    def download_state(self, timeout_s):
        self.calls.append(("download",))
        return self.donor_state


@pytest.fixture
def make_sync(tiny_cfg):
    computes = []

    def make(peer="B", averager=None):
        worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
        compute = ComputeWorker()
        compute.start()
        computes.append(compute)
        records, averager = FakeRecords(), averager or FakeAverager()
        settings = SyncSettings(global_batch_size=tiny_cfg.training.global_batch_size)
        sync = StageSynchronizer(worker, compute, averager, records, peer, "d", settings)
        return sync, worker, records, averager

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make
    for compute in computes:
        compute.stop()
    torch.set_num_threads(threads)


def _train(worker, count, start=0):
    for i in range(start, start + count):
        x = torch.randn(8, 64, 64)
        y = torch.randint(0, 256, (8, 64))
        worker.forward(StageRequest("forward", f"m{i}", "none", x, labels=y, fused_backward=True))


def _peer(epoch, samples=0, ready=False, grad_fp=None):
    return {"epoch": epoch, "samples": samples, "ready": ready, "digest": "d", "grad_fp": grad_fp}


def test_a_lone_replica_steps_at_the_global_batch(make_sync):
    sync, worker, records, averager = make_sync()
    _train(worker, 3)
    sync.tick()
    assert worker.epoch == 0 and not any(c[0] == "average" for c in averager.calls)
    _train(worker, 2, start=3)  # 5 x 8 samples: the cut is at 32
    sync.tick()
    assert worker.epoch == 1 and worker.samples_seen == 32 and worker.pending_samples == 8
    assert sync.counters.solo_steps == 1 and not averager.calls


def test_replicas_average_weighted_and_step_together(make_sync):
    sync, worker, records, averager = make_sync()
    records.progress["A"] = _peer(0, samples=24)

    def other_replica(tensors, weight, gather):
        return RoundResult([t * 0 for t in tensors], {"A": {"epoch": 0, "samples": 24}, "B": gather})

    averager.result = other_replica
    sync.tick()  # learn that A holds 24 samples
    _train(worker, 1)  # 8 + 24 = 32: cut and round
    sync.tick()
    assert ("configure", 0, 2) in averager.calls
    ((_, weight, gather),) = [c for c in averager.calls if c[0] == "average"]
    assert weight == 8 and gather == {"epoch": 0, "samples": 8}
    assert worker.epoch == 1 and worker.samples_seen == 32 and sync.counters.rounds == 1


def test_a_failed_round_keeps_the_gradients(make_sync):
    sync, worker, records, averager = make_sync()
    records.progress["A"] = _peer(0, samples=0, ready=True)
    _train(worker, 2)
    sync.tick()
    assert worker.epoch == 0 and worker.pending_samples == 16 and sync.counters.failed_rounds == 1


def test_a_replica_behind_its_peers_drops_its_work_and_downloads(make_sync, tiny_cfg):
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    _train(donor, 4)
    snap = donor.take_round_snapshot()
    donor.apply_update([g / snap.samples for g in snap.grad_sums], snap.samples)
    sync, worker, records, averager = make_sync(averager=FakeAverager(donor_state=donor.export_state()))
    _train(worker, 2)
    records.progress["A"] = _peer(1)
    sync.tick()
    assert ("download",) in averager.calls
    assert worker.epoch == 1 and worker.unapplied_samples == 0 and sync.counters.lost_samples == 16
    assert all(torch.equal(a, b) for a, b in zip(worker.params, donor.params, strict=True))
    assert sync.serving.is_set()


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
