"""The live balancer's decision: the rebalancing policy on what the stages announce, each part of its plan
acted on only by the peer it names, through leases in the DHT, never before the server has served for
two periods."""

import pytest

from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.planner.lease_plan import (
    loads_from_announcements,
    observed_samples_per_s,
    swarm_plan,
    valid_lease,
)
from swarmtrain.runtime.server.balancer import Balancer

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


def lease(to, rate, state, frm=0):
    return {"from": frm, "to": to, "rate": rate, "state": state}


def test_a_lease_counts_its_mover_at_the_target_wherever_its_records_say_it_is():
    """Found live: three servers reading slightly different snapshots all moved and emptied stage 0.
    A mover that has left stage 0 but does not show at stage 1 yet counts there through its lease."""
    records = Records(IMBALANCED)
    first = {p: balancer(p).decide(records, now_s=100.0) for p in "abcd"}
    mover = next(p for p, m in first.items() if m is not None)
    assert records.leases == {mover: lease(1, 10.0, "moving")}
    records.peers = {0: {p: a for p, a in IMBALANCED[0].items() if p != mover}, 1: IMBALANCED[1]}
    assert all(balancer(p).decide(records, now_s=101.0) is None for p in "abcd" if p != mover)
    # released once it serves: its own record counts, 20 vs 20, nobody moves
    records.leases[mover] = lease(1, 10.0, "done")
    records.peers[1] = dict(IMBALANCED[1], **{mover: ann(1, 10.0)})
    assert all(balancer(p).decide(records, now_s=102.0) is None for p in "abcd")


def test_a_plan_of_several_moves_is_carried_out_by_the_peers_it_names():
    """4+1 servers, stage 1 four times as costly per sample (each stage-0 server reads 40 samples/s,
    the stage-1 one 10): the plan moves three stage-0 servers, each at 10 samples/s there, to 1+4 (what
    `--stage auto` builds), one decision each, and the fourth stays. One lease at a time took three
    lease periods for this (67 s at a 4 s period, bench/rebalance_live.py)."""
    peers = {0: {p: ann(0, 40.0) for p in "abce"}, 1: {"d": ann(1, 10.0)}}
    records = Records(peers)
    moves = {p: balancer(p).decide(records, now_s=100.0) for p in "abcde"}
    movers = sorted(p for p, m in moves.items() if m is not None)
    assert len(movers) == 3 and "d" not in movers
    assert all(moves[p].to_stage == 1 and moves[p].rate_samples_per_s == 10.0 for p in movers)
    assert {p: records.leases[p]["state"] for p in movers} == dict.fromkeys(movers, "moving")
    # asked again, in any order, nobody else moves: the plan is carried out
    assert all(balancer(p).decide(records, now_s=101.0) is None for p in "edcba" if p not in movers)


def test_concurrent_proposals_for_one_gap_the_lower_peer_id_moves_the_other_withdraws():
    """Two servers whose snapshots named different movers for the same gap both proposed; each checks
    after the settle: the lower peer id counts only committed leases and goes, the higher one counts the
    lower one's proposal, is no longer needed and withdraws (its lease released, so nobody counts it)."""
    records = Records(IMBALANCED)
    mover = next(p for p in "abc" if balancer(p).decide(Records(IMBALANCED), now_s=100.0) is not None)
    rival = "0" if mover != "0" else "z"  # "0" sorts before every letter
    late = balancer(mover)
    late.settle = lambda: records.publish_move(rival, lease(1, 10.0, "proposed"), 30.0)
    assert late.decide(records, now_s=100.0) is None
    assert records.leases[mover]["state"] == "done"
    # a higher peer id's concurrent proposal gives way to ours
    records = Records(IMBALANCED)
    late = balancer(mover)
    late.settle = lambda: records.publish_move("zz", lease(1, 10.0, "proposed"), 30.0)
    assert late.decide(records, now_s=100.0) is not None and records.leases[mover]["state"] == "moving"


def test_leases_keep_movers_that_left_their_stage_counted_at_the_target():
    """5+1, stage 1 four times as costly: three moves. Once the three have left stage 0 (offline there,
    not yet at stage 1), the two left would plan a fourth move without the leases (80 vs 10) and
    overshoot; counting the movers at stage 1 (80 vs 40) they stay."""
    peers = {0: {p: ann(0, 40.0) for p in "abcef"}, 1: {"d": ann(1, 10.0)}}
    records = Records(peers)
    movers = sorted(p for p in "abcdef" if balancer(p).decide(records, now_s=100.0) is not None)
    assert len(movers) == 3
    records.peers = {0: {p: a for p, a in peers[0].items() if p not in movers}, 1: peers[1]}
    stayed = [p for p in "abcef" if p not in movers]
    assert all(balancer(p).decide(records, now_s=101.0) is None for p in stayed)
    records.leases = {}  # what the old single lease did once it expired mid-move
    assert sum(balancer(p).decide(records, now_s=102.0) is not None for p in stayed) == 1


def test_a_withdrawn_proposer_at_its_stage_counts_there_not_at_the_target():
    records = Records(IMBALANCED, leases={"a": lease(1, 10.0, "done")})
    assert sum(balancer(p).decide(records, now_s=100.0) is not None for p in "abcd") == 1


def test_a_rival_commit_seen_at_the_check_or_after_ours_makes_us_withdraw():
    """One gap, and a higher peer id commits its move for it while we settle: committed moves count
    whoever made them. Seen only after our own commit (a slow check), we withdraw then."""
    for late_settle in (1, 2):
        records = Records(IMBALANCED)
        mover = next(p for p in "abc" if balancer(p).decide(Records(IMBALANCED), now_s=100.0) is not None)
        ours, calls = balancer(mover), []

        def settle(records=records, calls=calls, late_settle=late_settle):
            calls.append(1)
            if len(calls) == late_settle:
                records.publish_move("zz", lease(1, 10.0, "moving"), 30.0)

        ours.settle = settle
        assert ours.decide(records, now_s=100.0) is None and records.leases[mover]["state"] == "done"


def test_a_proposal_the_dht_did_not_store_is_no_move():
    class Failing(Records):
        def publish_move(self, peer, record, ttl_s):
            return False

    assert all(balancer(p).decide(Failing(IMBALANCED), now_s=100.0) is None for p in "abcd")


def test_a_non_finite_announcement_is_left_out_and_does_not_stop_rebalancing():
    peers = {0: dict(IMBALANCED[0], x=ann(0, float("nan"))), 1: dict(IMBALANCED[1], y=ann(1, float("inf")))}
    assert sorted(load.peer for load in loads_from_announcements(peers, "d")) == ["a", "b", "c", "d"]
    assert sum(balancer(p).decide(Records(peers), now_s=100.0) is not None for p in "abcd") == 1


def test_a_changed_lease_makes_a_server_decide_now_and_malformed_leases_are_ignored():
    records = Records(IMBALANCED)
    b = balancer("a")
    assert not b.leases_changed(records)
    records.publish_move("a", lease(1, 10.0, "moving"), 30.0)
    assert not b.leases_changed(records)  # our own
    records.publish_move("b", lease(1, 10.0, "proposed"), 30.0)
    assert b.leases_changed(records) and not b.leases_changed(records)
    records.publish_move("b", lease(1, 10.0, "moving"), 30.0)
    assert b.leases_changed(records)
    bad = [
        None,
        "x",
        {"to": 1},
        lease(5, 10.0, "moving"),
        lease(1, float("nan"), "moving"),
        lease(1, 10.0, "?"),
    ]
    for i, value in enumerate(bad):
        assert not valid_lease(value, 2), value
        records = Records(IMBALANCED, leases={f"0{i}": value})
        assert sum(balancer(p).decide(records, now_s=100.0) is not None for p in "abcd") == 1


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


def test_the_swarms_observed_rate_is_the_median_of_its_online_replicas_figures():
    def at(rate, digest="d", state="online"):
        a = ann(0, 10.0, digest, state)
        a.swarm_samples_per_s = rate
        return a

    announced = {0: {"a": at(90.0), "b": at(100.0), "c": at(0.0)}, 1: {"d": at(400.0), "e": at(1.0, "x")}}
    assert observed_samples_per_s(announced, "d") == 100.0  # c knows nothing; e runs another config
    announced[1]["f"] = at(5.0, state="joining")
    assert observed_samples_per_s(announced, "d") == 100.0
    assert observed_samples_per_s({0: {"c": at(0.0)}}, "d") is None


def test_an_idling_bottleneck_makes_no_move_that_barely_lifts_it():
    """The fp32 link fleet after its first move (planner test of the same loads): with the busy fractions
    every replica announces, nobody is named and the log says what was held back; without them (older
    records), y is."""

    def at(stage, capacity, busy):
        a = ann(stage, capacity)
        a.utilization = busy
        return a

    fleet = {
        0: {"a": at(0, 646.0, 0.3)},
        1: {"b": at(1, 700.0, 0.3), "y": at(1, 20.0, 0.9), "z": at(1, 73.0, 0.9)},
    }
    assert swarm_plan(fleet, {}, 2, "d", 0.1) == []
    y = balancer("y")
    assert y.decide(Records(fleet), now_s=100.0) is None
    assert y.last_plan == ["(held back, the bottleneck busy 30% of the time: y:1->0)"]
    for peers in fleet.values():
        for a in peers.values():
            a.utilization = 0.0
    assert [m.peer for m in swarm_plan(fleet, {}, 2, "d", 0.1)] == ["y"]
