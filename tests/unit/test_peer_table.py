"""A trainer's peer table: digest filtering, bans until re-announcement, departure of expired peers,
and a stage of foreign digests only: an error naming the settings after a grace."""

import dataclasses
import time

import pytest

from swarmtrain.net.dht_records import LAPSE_GRACE_S, StageAnnouncement
from swarmtrain.runtime.trainer.peer_table import PeerTable, RunMismatch

MISMATCH_GRACE_S = 20.0  # PeerTable's default

pytestmark = pytest.mark.unit


def _ann(stage, digest="d", tput=10.0, at=None, state="online"):
    return StageAnnouncement(
        stage,
        ["/ip4/127.0.0.1/tcp/1/p2p/X"],
        tput,
        0,
        digest,
        0,
        state,
        at if at is not None else time.time(),
    )


def test_foreign_digests_and_joining_peers_are_not_routed_to():
    table = PeerTable(records=None, num_stages=2, digest="d")
    new = table.apply(
        [{"a": _ann(0), "b": _ann(0, digest="other"), "c": _ann(0, state="joining")}, {"z": _ann(1)}]
    )
    assert sorted(new) == ["a", "z"] and table.peers_per_stage() == [1, 1]


def test_ban_lasts_until_the_peer_reannounces_or_expires():
    table = PeerTable(records=None, num_stages=1, digest="d")
    first = _ann(0, at=time.time() - 1)
    table.apply([{"a": first, "b": _ann(0)}])
    table.ban(0, "a")
    assert table.available(0) == ["b"]
    table.apply([{"a": first, "b": _ann(0)}])  # same old record: still banned
    assert table.available(0) == ["b"]
    table.apply([{"a": _ann(0, at=time.time() + 1), "b": _ann(0)}])  # re-announced after the ban
    assert sorted(table.available(0)) == ["a", "b"]
    table.apply([{"b": _ann(0)}], now_s=time.monotonic() + LAPSE_GRACE_S)  # a's record expired long ago
    assert table.routers[0].peers == ["b"]


def test_a_close_goes_to_banned_replicas_too_but_only_to_the_stage_it_closes():
    """netbed chaos, seed 0: a stage-1 replica banned while frozen woke up without the closes sent
    meanwhile, waited 10 s for each, and every micro-batch of the next step waited on it."""
    table = PeerTable(records=None, num_stages=2, digest="d")
    table.apply([{"a": _ann(0), "b": _ann(0)}, {"x": _ann(1), "y": _ann(1)}])
    table.ban(1, "y")
    assert table.available(1) == ["x"]
    assert table.close_recipients(1, {}) == {"x", "y"}
    assert table.close_recipients(1, {"x": 8, "new": 8}) == {"x", "y", "new"}  # a member we never saw
    assert table.close_recipients(0, {}) == {"a", "b"}


def test_a_peer_whose_record_lapsed_is_routed_to_for_the_grace_and_a_leaving_one_is_not():
    """chaos --netbed, seed 0: the servers' DHT stores timed out while they served, their records lapsed
    and the trainers saw no peer of either stage for 30 s (peers/stage [0, 0])."""
    table = PeerTable(records=None, num_stages=1, digest="d")
    table.apply([{"a": _ann(0), "b": _ann(0), "c": _ann(0)}], now_s=100.0)
    table.ban(0, "c")
    table.apply([{"b": _ann(0, state="offline")}], now_s=110.0)  # a and c lapsed, b leaves
    assert table.routers[0].peers == ["a", "c"] and table.available(0) == ["a"]  # c stays banned
    table.apply([{}], now_s=100.0 + LAPSE_GRACE_S)
    assert table.routers[0].peers == []


def test_faster_announced_peer_gets_more_work():
    table = PeerTable(records=None, num_stages=1, digest="d")
    table.apply([{"fast": _ann(0, tput=20.0), "slow": _ann(0, tput=10.0)}])
    picks = [table.choose(0, 8, 1.0) for _ in range(300)]
    assert picks.count("fast") == pytest.approx(200, abs=5)


class FlakyClient:
    """Answers `unavailable` (the only replica is downloading the stage state) `failures` times, then
    accumulates the micro-batch if the request asks it to."""

    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    async def call(self, peer_id, message, timeout_s):
        from swarmtrain.net.protocol import Message
        from swarmtrain.net.transport import RemoteError

        self.calls += 1
        if self.calls <= self.failures:
            raise RemoteError("unavailable", "downloading the stage state")
        return Message("result", {"acc": 8 if message.header.get("accumulate", True) else 0})


@pytest.mark.parametrize("persistent", [False, True])
def test_a_backward_a_later_stage_holds_is_retried_until_it_lands(monkeypatch, persistent):
    """Giving up on stage 0's backward after stage 1 accumulated the micro-batch left the stages
    disagreeing on the step's batch; such a backward (`persistent`) keeps trying past max_retries."""
    import asyncio

    from swarmtrain.config import SwarmConfig
    from swarmtrain.runtime.trainer import call_policy, stage_calls

    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 0.001)
    table = PeerTable(records=None, num_stages=1, digest="d")
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    table.apply([{peer: _ann(0)}])
    client = FlakyClient(failures=8)
    caller = stage_calls.StageCaller(client, table, SwarmConfig(max_retries=2), "d", "none", asyncio.Event())
    call = caller.call_peer(0, "backward", "m", 8, {}, 1.0, persistent=persistent, step=0)
    if persistent:
        reply, answered_by = asyncio.run(call)
        assert reply.header["acc"] == 8 and answered_by == peer and client.calls == 9
    else:
        with pytest.raises(call_policy.MicroBatchFailed):
            asyncio.run(call)
        assert client.calls == 3


def test_behind_nat_travels_in_the_announcement_and_an_older_record_means_public():
    ann = StageAnnouncement(1, ["/ip4/203.0.113.7/tcp/1"], 10.0, 0, "d", 0, behind_nat=True)
    assert StageAnnouncement.from_value(ann.to_value()).behind_nat is True
    older = {k: v for k, v in ann.to_value().items() if k != "behind_nat"}
    assert StageAnnouncement.from_value(older).behind_nat is False
    assert StageAnnouncement.from_value({**ann.to_value(), "behind_nat": "yes"}).behind_nat is False
    home_a, home_b = ["/ip4/192.168.1.2/tcp/1"], ["/ip4/192.168.9.2/tcp/1"]
    table = PeerTable(records=None, num_stages=2, digest="d")
    natted = lambda stage, addrs: StageAnnouncement(stage, addrs, 10.0, 0, "d", 0, behind_nat=True)  # noqa: E731
    public = StageAnnouncement(1, ["/ip4/203.0.113.8/tcp/1"], 10.0, 0, "d", 0)
    table.apply([{"P": natted(0, home_a)}, {"Q": natted(1, home_b), "R": ann, "S": public}])
    assert not table.can_hand_off(0, "P", "Q")  # two NATs, two LANs
    assert not table.can_hand_off(0, "P", "R")  # R is behind a NAT too and announces no LAN
    assert table.can_hand_off(0, "P", "S") and table.can_hand_off(0, "P", "unknown")


def test_the_swarms_rate_travels_in_the_announcement_and_a_bad_or_older_value_reads_as_unknown():
    ann = StageAnnouncement(1, ["/ip4/203.0.113.7/tcp/1"], 10.0, 0, "d", 0, swarm_samples_per_s=98.5)
    assert StageAnnouncement.from_value(ann.to_value()).swarm_samples_per_s == 98.5
    older = {k: v for k, v in ann.to_value().items() if k != "swarm_samples_per_s"}
    assert StageAnnouncement.from_value(older).swarm_samples_per_s == 0.0
    for bad in (float("nan"), float("inf"), -1.0, 1e12, True, "2", None):
        value = {**ann.to_value(), "swarm_samples_per_s": bad}
        assert StageAnnouncement.from_value(value).swarm_samples_per_s == 0.0, bad


def test_the_busy_fraction_travels_in_the_announcement_and_a_bad_or_older_value_reads_as_unknown():
    ann = StageAnnouncement(1, ["/ip4/203.0.113.7/tcp/1"], 10.0, 0, "d", 0, utilization=0.42)
    assert StageAnnouncement.from_value(ann.to_value()).utilization == 0.42
    older = {k: v for k, v in ann.to_value().items() if k != "utilization"}
    assert StageAnnouncement.from_value(older).utilization == 0.0
    for bad in (float("nan"), float("inf"), -0.1, 1.5, True, "0.5", None):
        value = {**ann.to_value(), "utilization": bad}
        assert StageAnnouncement.from_value(value).utilization == 0.0, bad


def _settings(compression="8bit"):
    from swarmtrain.config import get_preset

    cfg = get_preset("tiny")
    return cfg.replace(swarm=dataclasses.replace(cfg.swarm, compression=compression)).settings_summary()


def _foreign(stage, state="online", settings=None):
    return dataclasses.replace(_ann(stage, digest="theirs", state=state), settings=settings or {})


def test_a_stage_of_foreign_peers_only_is_a_mismatch_after_the_grace_naming_the_settings():
    table = PeerTable(records=None, num_stages=2, digest="ours", settings=_settings("4bit"))
    t0 = time.monotonic()
    eight = _settings("8bit")
    table.apply(
        [{"a": _foreign(0, settings=eight), "b": _foreign(0, settings=eight)}, {"z": _ann(1, "ours")}], t0
    )
    assert table.mismatch(t0 + MISMATCH_GRACE_S - 1) is None  # not yet: a swarm may be restarting
    table.apply(
        [{"a": _foreign(0, settings=eight), "b": _foreign(0, settings=eight)}, {"z": _ann(1, "ours")}], t0 + 5
    )
    error = table.mismatch(t0 + MISMATCH_GRACE_S)
    assert error is not None and "\n" not in error and error.startswith("stage 0 has had only servers")
    assert "(2 with config digest theirs, this run ours)" in error
    assert "swarm.compression: this run 4bit, the servers 8bit" in error and "--compression" in error
    with pytest.raises(RunMismatch):  # a user's error: one line and exit 2 at the CLI
        raise RunMismatch(error)


def test_no_mismatch_while_a_peer_of_ours_serves_joins_or_no_peer_is_there():
    table = PeerTable(records=None, num_stages=1, digest="ours", settings=_settings())
    t0 = time.monotonic()
    table.apply([{}], t0)  # nobody yet: servers may still be starting
    table.apply([{"f": _foreign(0, state="offline")}], t0 + 1)  # a foreign one leaving does not count
    assert table.mismatch(t0 + 10 * MISMATCH_GRACE_S) is None
    table.apply([{"f": _foreign(0), "j": _ann(0, "ours", state="joining")}], t0 + 2)  # ours is coming
    assert table.mismatch(t0 + 10 * MISMATCH_GRACE_S) is None
    table.apply([{"f": _foreign(0)}], t0 + 3)  # the clock starts now
    assert table.mismatch(t0 + 3 + MISMATCH_GRACE_S - 0.1) is None
    table.apply([{"f": _foreign(0), "o": _ann(0, "ours")}], t0 + 4)  # one of ours serves: reset
    table.apply([{"f": _foreign(0)}], t0 + 4 + LAPSE_GRACE_S + 1)  # its record lapsed: the clock again
    assert table.mismatch(t0 + 4 + LAPSE_GRACE_S + 1 + MISMATCH_GRACE_S - 0.1) is None
    error = table.mismatch(t0 + 4 + LAPSE_GRACE_S + 1 + MISMATCH_GRACE_S)
    assert error is not None and "announce their settings" in error  # an older server: no settings


def test_an_announcement_carries_its_settings_and_malformed_ones_read_as_none():
    ann = dataclasses.replace(_ann(0), settings=_settings())
    assert StageAnnouncement.from_value(ann.to_value()).settings == ann.settings
    older = {k: v for k, v in ann.to_value().items() if k != "settings"}
    assert StageAnnouncement.from_value(older).settings == {}
    for bad in ("x", ["a"], {"a": 1}, {1: "a"}, {"a": "x" * 1000}, {f"k{i}": "v" for i in range(1000)}):
        assert StageAnnouncement.from_value({**ann.to_value(), "settings": bad}).settings == {}


class _Records:
    """The two reads `PeerTable.fetch` makes, from fixed records; counts the settings reads."""

    def __init__(self, announcements, settings):
        self.announcements, self.settings, self.settings_reads = announcements, settings, []

    def stage_peers(self, stage, with_offline=False):
        return self.announcements[stage]

    def published_settings(self):
        self.settings_reads.append(sorted(self.settings))
        return dict(self.settings)


def test_a_mismatch_names_the_settings_the_foreign_servers_publish_read_while_a_digest_is_new():
    # today's servers announce no settings (they were 60% of each announcement's bytes): the trainer
    # reads the run's settings record for a digest it does not know, once
    records = _Records([{"a": _foreign(0)}, {"z": _ann(1, "ours")}], {})
    table = PeerTable(records=records, num_stages=2, digest="ours", settings=_settings("4bit"))
    t0 = time.monotonic()
    table.apply(table.fetch(), t0)  # the record is not there yet: asked again next time
    records.settings = {"theirs": _settings("8bit")}
    table.apply(table.fetch(), t0 + 1)
    table.apply(table.fetch(), t0 + 2)
    assert records.settings_reads == [[], ["theirs"]]  # not read again once known, nor for our digest
    error = table.mismatch(t0 + MISMATCH_GRACE_S)
    assert "swarm.compression: this run 4bit, the servers 8bit" in error


def test_the_settings_record_reads_back_the_settings_of_a_digest_and_drops_malformed_ones():
    from swarmtrain.net.dht_records import RunRecords, settings_key

    stored = {}

    class Dht:
        def store(self, key, value, expiration, subkey, return_future):
            stored.setdefault(key, {})[subkey] = value
            return _Done(True)

        def get(self, key, latest, return_future):
            entries = {k: type("Item", (), {"value": v}) for k, v in stored.get(key, {}).items()}
            return _Done(type("Found", (), {"value": entries}) if entries else None)

    records = RunRecords(Dht(), "run")
    assert records.publish_settings("peer-a", "d1", _settings("8bit"))
    assert records.published_settings() == {"d1": _settings("8bit")}
    stored[settings_key("run")]["stranger"] = {"digest": "d2", "settings": {"a": 1}, "time": 0.0}
    stored[settings_key("run")]["other"] = {"digest": 5, "settings": _settings(), "time": 0.0}
    assert records.published_settings() == {"d1": _settings("8bit")}  # malformed records: none


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value
