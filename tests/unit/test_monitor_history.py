"""The monitor's snapshot (fake DHT records) and its bounded history of points and events."""

import json
import math

import pytest

from swarmtrain.config import get_preset
from swarmtrain.monitor.history import SwarmHistory, history_point, json_safe
from swarmtrain.monitor.snapshot import monitor_snapshot, work_totals
from swarmtrain.net.dht_records import StageAnnouncement

pytestmark = pytest.mark.unit


class FakeRecords:
    """RunRecords' read methods, on fixed data."""

    def __init__(self, peers, metrics=None, moves=None):
        self.peers, self._metrics, self._moves = peers, metrics or {}, moves or {}
        self.metrics_reads = 0

    def stage_peers(self, stage):
        return self.peers.get(stage, {})

    def stage_progress(self, stage):
        return {}

    def metrics(self):
        self.metrics_reads += 1
        return self._metrics

    def replicas(self, digest):
        return {}

    def moves(self):
        return self._moves


def announce(stage, throughput, digest, version=3):
    return StageAnnouncement(stage, ["/ip4/127.0.0.1/tcp/1/p2p/X"], throughput, 1, digest, version)


def test_monitor_snapshot_adds_servers_moves_retries_and_work_totals():
    cfg = get_preset("tiny")
    d = cfg.digest()
    records = FakeRecords(
        {0: {"A": announce(0, 50.0, d)}, 1: {"B": announce(1, 30.0, d)}},
        metrics={
            "trainer-t1": {
                "role": "trainer",
                "loss": 2.5,
                "samples_per_s": 30.0,
                "samples": 640,
                "completed": 40,
                "failed": 2,
                "retries": 7,
            },
            "trainer-t2": {
                "role": "trainer",
                "loss": 2.7,
                "samples_per_s": 20.0,
                "samples": 320,
                "completed": 20,
                "failed": 0,
            },
            "A": {"role": "server", "stage": 0, "step": 9, "resyncs": 1, "lost_samples": 16, "duplicates": 3},
            "B": {"role": "server", "stage": 1, "step": 9, "resyncs": 0, "lost_samples": 0, "duplicates": 0},
        },
        moves={
            "A": {"from": 0, "to": 1, "state": "moving", "time": 5.0},
            "B": {"from": 0, "to": 1, "state": "proposed", "time": 6.0},  # may still be withdrawn
            "C": {"from": 0, "to": 1, "state": "done", "time": 7.0},  # serves its new stage
        },
    )
    snap = monitor_snapshot(cfg, records)
    assert records.metrics_reads == 1  # one DHT read of the metrics key per snapshot
    assert snap["bottleneck"] == 1 and [len(s["peers"]) for s in snap["stages"]] == [1, 1]
    t1, t2 = snap["trainers"]
    assert (t1["retries"], t2["retries"]) == (7, None)
    assert snap["servers"][0] == {
        "peer_id": "A",
        "stage": 0,
        "step": 9,
        "resyncs": 1,
        "lost_samples": 16,
        "duplicates": 3,
        "recomputed": None,
        "late": None,
        "moved": None,
    }
    assert snap["moves"] == [{"peer_id": "A", "from": 0, "to": 1, "state": "moving", "time": 5.0}]
    assert snap["work"] == {
        "microbatches_completed": 60,
        "microbatches_failed": 2,
        "retries": 7,
        "samples_lost": 16,
        "state_downloads": 1,
        "duplicates": 3,
    }
    assert snap["source"] == "dht"


def test_work_totals_are_none_when_nobody_reports():
    assert set(work_totals([], []).values()) == {None}
    assert work_totals([{"failed": None}, {"failed": 0}], [])["microbatches_failed"] == 0


def snapshot(time_s, loss, throughputs=(10.0, 5.0), trainers=("t1",), lost=0):
    return {
        "run_id": "run",
        "time": time_s,
        "stages": [
            {
                "index": i,
                "peers": [{"peer_id": f"P{i}", "epoch": 1, "state": "online"}],
                "throughput_samples_per_s": t,
            }
            for i, t in enumerate(throughputs)
        ],
        "bottleneck": 1,
        "trainers": [{"trainer_id": t, "loss": loss, "samples_per_s": 8.0} for t in trainers],
        "work": {"samples_lost": lost, "retries": None},
    }


def test_history_point_drops_non_finite_values():
    point = history_point(snapshot(3.0, float("nan"), throughputs=(10.0, float("inf"))))
    assert point == {
        "time": 3.0,
        "stage_throughput": [10.0, None],
        "stage_peers": [1, 1],
        "trainers": {"t1": {"loss": None, "samples_per_s": 8.0}},
        "work": {"samples_lost": 0, "retries": None},
    }
    assert json_safe({"a": [1.0, float("-inf")], "b": (math.nan,)}) == {"a": [1.0, None], "b": [None]}


def test_history_is_bounded_and_counts_every_event():
    history = SwarmHistory(max_points=3, max_events=2)
    history.add(snapshot(0.0, 3.0))
    for i in range(1, 6):  # a trainer comes and goes every snapshot: two events each time
        history.add(snapshot(float(i), 3.0 - i * 0.1, trainers=("t2",) if i % 2 else ("t1",), lost=i))
    view = history.view()
    assert [p["time"] for p in view["points"]] == [3.0, 4.0, 5.0]
    assert len(view["events"]) == 2 and view["polls"] == 6
    assert view["event_counts"] == {"start": 1, "trainer_join": 5, "trainer_leave": 5, "lost_work": 5}
    assert view["snapshot"]["time"] == 5.0
    json.dumps(view, allow_nan=False)


def test_a_failed_poll_is_shown_until_the_next_snapshot():
    history = SwarmHistory()
    assert history.view()["snapshot"] is None
    history.add(snapshot(0.0, float("nan")))
    history.record_error("TimeoutError()")
    view = history.view()
    assert view["error"] == "TimeoutError()" and view["polls"] == 1
    assert view["snapshot"]["trainers"][0]["loss"] is None  # NaN never reaches JSON
    history.add(snapshot(1.0, 2.0))
    assert history.view()["error"] is None


def test_the_view_is_a_copy():
    history = SwarmHistory()
    history.add(snapshot(0.0, 2.0))
    history.view()["snapshot"]["stages"].clear()
    assert len(history.view()["snapshot"]["stages"]) == 2
