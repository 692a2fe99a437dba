"""Events the monitor derives between two snapshots: a pure function on fake snapshot data."""

import copy

import pytest

from swarmtrain.monitor.events import diff_snapshots

pytestmark = pytest.mark.unit


def peer(peer_id, epoch=5, state="online", throughput=10.0):
    return {
        "peer_id": peer_id,
        "throughput_samples_per_s": throughput,
        "queue": 0,
        "epoch": epoch,
        "state": state,
        "same_config": True,
        "addresses": [],
    }


def snap(stages, time_s=100.0, trainers=(), servers=(), moves=(), work=None):
    """`stages`: a list (one entry per stage) of lists of peer entries."""
    return {
        "run_id": "run",
        "time": time_s,
        "stages": [
            {
                "index": i,
                "peers": list(peers),
                "throughput_samples_per_s": sum(p["throughput_samples_per_s"] for p in peers),
            }
            for i, peers in enumerate(stages)
        ],
        "trainers": [{"trainer_id": t, "loss": 2.0, "samples_per_s": 5.0} for t in trainers],
        "servers": list(servers),
        "moves": list(moves),
        "work": work or {},
    }


def kinds(events):
    return [(e["kind"], e["peer_id"], e["stage"]) for e in events]


def test_the_first_snapshot_is_a_start_not_a_crowd_of_joins():
    events = diff_snapshots(None, snap([[peer("A"), peer("B")], [peer("C")]], trainers=["t1"]))
    assert kinds(events) == [("start", None, None)]
    assert "3 peer(s) in 2 stage(s), 1 trainer(s)" in events[0]["text"]
    assert events[0]["time"] == 100.0


def test_join_leave_and_move_by_peer_id():
    before = snap([[peer("A"), peer("B")], [peer("C")]])
    after = snap([[peer("A"), peer("D", state="joining")], [peer("C"), peer("B")]], time_s=102.0)
    events = diff_snapshots(before, after)
    assert kinds(events) == [("move", "B", 1), ("join", "D", 0)]
    assert events[0]["text"] == "B moved from stage 0 to stage 1"
    assert "D joined stage 0 (joining)" in events[1]["text"] and events[1]["time"] == 102.0
    assert kinds(diff_snapshots(after, snap([[peer("A")], [peer("C"), peer("B")]]))) == [("leave", "D", 0)]


def test_a_rebalancing_lease_is_reported_once_and_explains_the_stage_changes():
    lease = {"peer_id": "B", "from": 0, "to": 1, "time": 1.0}
    s0 = snap([[peer("A"), peer("B")], [peer("C")]])
    # the mover takes a lease and announces itself at the target while its old record still stands
    s1 = snap([[peer("A"), peer("B")], [peer("C"), peer("B", state="joining")]], moves=[lease])
    s2 = snap([[peer("A")], [peer("C"), peer("B", state="joining")]], moves=[lease])
    e1, e2 = diff_snapshots(s0, s1), diff_snapshots(s1, s2)
    assert kinds(e1) == [("move", "B", 1)] and "decided to move from stage 0 to stage 1" in e1[0]["text"]
    assert kinds(e2) == [("move", "B", 0)] and e2[0]["text"] == "B left stage 0 to move to stage 1"
    assert diff_snapshots(s2, s2) == []


def test_a_peer_joining_a_second_stage_without_a_lease_is_a_join():
    s0 = snap([[peer("A")], []])
    s1 = snap([[peer("A")], [peer("A")]])
    events = diff_snapshots(s0, s1)
    assert kinds(events) == [("join", "A", 1)] and "still announced at another stage" in events[0]["text"]


def test_restore_and_state_download_from_epochs_and_states():
    s0 = snap([[peer("A", epoch=40), peer("B", epoch=0, state="joining")]])
    s1 = snap([[peer("A", epoch=12), peer("B", epoch=41, state="online")]])
    events = diff_snapshots(s0, s1)
    assert kinds(events) == [("restore", "A", 0), ("state_download", "B", 0)]
    assert "from step 40 to 12" in events[0]["text"] and "from step 41" in events[1]["text"]
    # a fresh swarm's peer going online at step 0 downloaded nothing
    fresh = diff_snapshots(snap([[peer("B", epoch=0, state="joining")]]), snap([[peer("B", epoch=0)]]))
    assert fresh == []


def test_server_counters_resync_and_finished_move():
    server = {"peer_id": "A", "stage": 1, "step": 30, "resyncs": 0, "moved": None}
    s0 = snap([[], [peer("A")]], servers=[server])
    moved = {"from": 0, "to": 1, "seconds": 20.0, "bytes": 1_400_000}
    s1 = snap([[], [peer("A")]], servers=[dict(server, resyncs=1, step=31, moved=moved)])
    events = diff_snapshots(s0, s1)
    assert kinds(events) == [("state_download", "A", 1), ("move", "A", 1)]
    assert "resync" in events[0]["text"] and "now at step 31" in events[0]["text"]
    assert "in 20.0 s (1.4 MB of state downloaded)" in events[1]["text"]
    # a server seen for the first time: its counters are history, not news
    assert diff_snapshots(snap([[], [peer("A")]]), s1) == []


def test_trainers_and_lost_work():
    s0 = snap(
        [[peer("A")]], trainers=["t1"], work={"samples_lost": 0, "microbatches_failed": 1, "retries": 3}
    )
    s1 = snap(
        [[peer("A")]], trainers=["t2"], work={"samples_lost": 16, "microbatches_failed": 3, "retries": 9}
    )
    events = diff_snapshots(s0, s1)
    assert kinds(events) == [
        ("trainer_join", "t2", None),
        ("trainer_leave", "t1", None),
        ("lost_work", None, None),
        ("lost_work", None, None),
    ]
    assert events[2]["text"].startswith("2 micro-batch(es) failed") and events[3]["text"].startswith(
        "16 sample(s)"
    )
    # counters that vanish (no trainer reports) or shrink (a server left) are no events
    assert diff_snapshots(s1, snap([[peer("A")]], trainers=["t2"], work={"samples_lost": None})) == []
    assert diff_snapshots(s1, snap([[peer("A")]], trainers=["t2"], work={"samples_lost": 4})) == []


def test_pure_inputs_untouched():
    s0 = snap([[peer("A"), peer("B")]], moves=[{"peer_id": "B", "from": 0, "to": 1}])
    s1 = snap([[peer("A")], [peer("B")]])
    frozen = copy.deepcopy((s0, s1))
    assert diff_snapshots(s0, s1) == diff_snapshots(s0, s1)
    assert (s0, s1) == frozen
