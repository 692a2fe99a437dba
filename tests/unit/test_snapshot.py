"""The swarm snapshot behind `swarmtrain status`, on fake DHT records."""

from dataclasses import replace

import pytest

from swarmtrain.config import get_preset
from swarmtrain.monitor.snapshot import format_plan, format_snapshot, swarm_snapshot
from swarmtrain.net.dht_records import StageAnnouncement

pytestmark = pytest.mark.unit


class FakeRecords:
    def __init__(self, cfg, peers, progress=None, metrics=None, replicas=None):
        self.cfg, self.peers = cfg, peers
        self.progress, self._metrics, self._replicas = progress or {}, metrics or {}, replicas or {}

    def stage_peers(self, stage):
        return self.peers.get(stage, {})

    def stage_progress(self, stage):
        return self.progress.get(stage, {})

    def metrics(self):
        return self._metrics

    def replicas(self, digest):
        return self._replicas

    def moves(self):
        return self.leases

    leases: dict = {}


def announcement(stage, throughput, digest, state="online", version=3):
    return StageAnnouncement(stage, ["/ip4/127.0.0.1/tcp/1/p2p/X"], throughput, 2, digest, version, state)


def test_snapshot_shape_bottleneck_and_foreign_peers():
    cfg = get_preset("tiny")
    d = cfg.digest()
    records = FakeRecords(
        cfg,
        {
            0: {"A": announcement(0, 50.0, d), "B": announcement(0, 40.0, d)},
            1: {"C": announcement(1, 60.0, d), "D": announcement(1, 500.0, "other-run")},
        },
        progress={0: {"A": {"epoch": 7, "samples": 0}}},
        metrics={
            "trainer-t1": {"role": "trainer", "loss": 2.5, "samples_per_s": 30.0, "samples": 640},
            "C": {"role": "server"},
        },
        replicas={"R": {"outer_step": 2, "inner_step": 45, "samples_per_s": 80.0}},
    )
    snap = swarm_snapshot(cfg, records)
    assert [s["index"] for s in snap["stages"]] == [0, 1]
    peer = snap["stages"][0]["peers"][0]
    assert {"peer_id", "throughput_samples_per_s", "queue", "epoch"} <= set(peer)
    assert (
        peer["epoch"] == 7 and snap["stages"][0]["peers"][1]["epoch"] == 3
    )  # progress, else the state version
    assert snap["stages"][0]["throughput_samples_per_s"] == 90.0
    assert snap["stages"][1]["throughput_samples_per_s"] == 60.0  # the other run's peer does not count
    assert snap["bottleneck"] == 1
    assert snap["trainers"] == [
        {
            "trainer_id": "t1",
            "loss": 2.5,
            "samples_per_s": 30.0,
            "samples": 640,
            "completed": None,
            "failed": None,
        }
    ]
    assert snap["replicas"][0]["outer_step"] == 2
    text = format_snapshot(snap)
    assert "stage 1: 2 peer(s), 60.0 samples/s  <- bottleneck" in text and "other config" in text


def test_an_empty_stage_is_the_bottleneck_and_an_empty_swarm_says_so():
    cfg = get_preset("tiny")
    snap = swarm_snapshot(cfg, FakeRecords(cfg, {0: {"A": announcement(0, 50.0, cfg.digest())}}))
    assert snap["bottleneck"] == 1 and snap["stages"][1]["peers"] == []
    empty = swarm_snapshot(cfg, FakeRecords(cfg, {}))
    assert "no peer of this run" in format_snapshot(empty)


def test_the_snapshot_shows_each_servers_limit_and_the_balancers_plan():
    """3+1 servers, stage 1 costing 3.3x as much per sample: `status` shows the plan every server
    computes (two stage-0 servers move, the lowest peer ids among equals: 1+3), and with the first
    move's lease stored, what is left of it (the lease counts as the move made)."""
    cfg = get_preset("tiny")
    d = cfg.digest()
    peers = {
        0: {name: announcement(0, 100.0, d) for name in ("A", "B", "C")},
        1: {"D": announcement(1, 30.0, d)},
    }
    snap = swarm_snapshot(cfg, FakeRecords(cfg, peers))
    assert snap["stages"][0]["peers"][0]["limit"] == "compute"
    rebalance = snap["rebalance"]
    assert rebalance["period_s"] == cfg.swarm.rebalance_period_s == 60.0
    assert [(m["peer_id"], m["from"], m["to"]) for m in rebalance["plan"]] == [("A", 0, 1), ("B", 0, 1)]
    assert rebalance["plan"][0]["expected_samples_per_s"] == 30.0  # 100 at stage 0's relative cost
    assert "rebalancing every 60 s: the plan is A 0->1, B 0->1" in format_snapshot(snap)
    leased = FakeRecords(cfg, peers)
    leased.leases = {"A": {"from": 0, "to": 1, "rate": 30.0, "state": "moving"}}
    assert [m["peer_id"] for m in swarm_snapshot(cfg, leased)["rebalance"]["plan"]] == ["B"]
    off = swarm_snapshot(
        cfg.replace(swarm=replace(cfg.swarm, rebalance_period_s=0.0)), FakeRecords(cfg, peers)
    )
    assert "rebalancing: off" in format_snapshot(off)
    assert rebalance["observed_samples_per_s"] is None  # no replica announced the swarm's rate
    for a in [*peers[0].values(), *peers[1].values()]:
        # stage 1 (the bottleneck) busy 5% of the time: the swarm waits on something no stage's figure
        # shows (one slow trainer, say), and lifting stage 1 from 30 to 90 would gain it 3%
        a.swarm_samples_per_s, a.utilization = 2.0, 0.05
    running = swarm_snapshot(cfg, FakeRecords(cfg, peers))["rebalance"]
    assert running["observed_samples_per_s"] == 2.0 and running["plan"] == []
    assert "rebalancing every 60 s (the swarm runs at 2 samples/s): the plan is no move" in format_plan(
        running
    )
