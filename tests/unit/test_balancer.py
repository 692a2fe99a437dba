"""The live balancer's decision: the rebalancing policy on what the stages announce, acted on only by
the peer it names, never before the server has served for two periods."""

import pytest

from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.runtime.server.balancer import Balancer, loads_from_announcements

pytestmark = pytest.mark.unit


class Records:
    """Stage announcements and move leases as the DHT would hold them (shared by every balancer)."""

    def __init__(self, peers, leases=None):
        self.peers, self.leases = peers, dict(leases or {})

    def stage_peers(self, stage):
        return self.peers.get(stage, {})

    def moves(self):
        return self.leases

    def publish_move(self, peer, record, ttl_s):
        self.leases[peer] = record
        return True


def ann(stage, throughput, digest="d", state="online", queue=0):
    return StageAnnouncement(stage, [], throughput, queue, digest, 0, state)


IMBALANCED = {0: {"a": ann(0, 10.0), "b": ann(0, 10.0), "c": ann(0, 10.0)}, 1: {"d": ann(1, 10.0)}}


def balancer(peer, serving_since_s=0.0):
    return Balancer(peer, 2, "d", period_s=2.0, margin=0.1, serving_since_s=serving_since_s, settle_s=0.0)


def test_exactly_one_named_peer_moves_to_the_bottleneck():
    moves = {p: balancer(p).decide(Records(IMBALANCED), now_s=100.0) for p in "abcd"}
    movers = [p for p, m in moves.items() if m is not None]
    assert len(movers) == 1 and moves[movers[0]].to_stage == 1 and moves[movers[0]].from_stage == 0


def test_one_move_at_a_time_through_the_lease():
    """Found live: three servers reading slightly different snapshots all moved and emptied stage 0.
    A server only moves with the lease; while another's lease lives, nobody else moves."""
    records = Records(IMBALANCED)
    first = {p: balancer(p).decide(records, now_s=100.0) for p in "abcd"}
    mover = next(p for p, m in first.items() if m is not None)
    assert list(records.leases) == [mover]
    # the mover has left stage 0 but does not show at stage 1 yet: without the lease the next decision
    # would move another stage-0 server
    left = {0: {p: a for p, a in IMBALANCED[0].items() if p != mover}, 1: IMBALANCED[1]}
    records.peers = left
    assert all(balancer(p).decide(records, now_s=101.0) is None for p in "abcd" if p != mover)
    # two leases taken at the same moment: the lower peer id goes, the other gives way
    tie = Records(IMBALANCED, leases={"0": {"from": 0, "to": 1}})
    assert all(balancer(p).decide(tie, now_s=100.0) is None for p in "abcd")


def test_a_lease_taken_while_ours_settles_wins_if_its_peer_id_is_lower():
    """Found live: two stage-0 servers decided 1 s apart, each re-read the leases before the other's was
    stored, and both moved. A lease is trusted only after a settle time, in which a concurrent one shows."""
    records = Records(IMBALANCED)
    mover = next(p for p in "abcd" if balancer(p).decide(Records(IMBALANCED), now_s=100.0) is not None)
    late = balancer(mover)
    late.settle = lambda: records.publish_move("0", {"from": 0, "to": 1}, 30.0)  # stored meanwhile
    assert late.decide(records, now_s=100.0) is None
    assert set(records.leases) == {mover, "0"}


def test_balanced_stages_and_a_lone_server_stay():
    balanced = {0: {"a": ann(0, 10.0), "b": ann(0, 10.0)}, 1: {"c": ann(1, 10.0), "d": ann(1, 10.0)}}
    assert all(balancer(p).decide(Records(balanced), now_s=100.0) is None for p in "abcd")
    lone = {0: {"a": ann(0, 100.0)}, 1: {"d": ann(1, 1.0)}}  # never empty a stage
    assert balancer("a").decide(Records(lone), now_s=100.0) is None


def test_no_move_before_two_periods_of_serving_or_while_not_serving():
    assert balancer("a", serving_since_s=99.0).decide(Records(IMBALANCED), now_s=100.0) is None
    assert balancer("a", serving_since_s=None).decide(Records(IMBALANCED), now_s=100.0) is None


def test_joining_peers_count_as_pending_and_foreign_or_offline_peers_not_at_all():
    peers = {
        0: {
            "a": ann(0, 10.0),
            "b": ann(0, 10.0),
            "x": ann(0, 99.0, digest="other"),
            "o": ann(0, 5.0, state="offline"),
        },
        1: {"d": ann(1, 10.0), "j": ann(1, 10.0, state="joining")},
    }
    loads = loads_from_announcements(peers, "d")
    assert sorted(load.peer for load in loads) == ["a", "b", "d", "j"]
    assert [load.pending for load in loads if load.peer == "j"] == [True]
    # a joiner already on its way to stage 1 makes it 20 vs 20: nobody moves
    assert all(balancer(p).decide(Records(peers), now_s=100.0) is None for p in "abd")
