"""An idle server's DHT slack (planner/idle_pace.py): the policy, how `RunRecords` applies it, and the
activity clock that measures idleness (runtime/server/activity_clock.py)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from swarmtrain.net.dht_records import RunRecords, StageAnnouncement
from swarmtrain.planner.idle_pace import (
    IDLE_GRACE_S,
    MAX_SLACK_S,
    idle_slack_s,
    may_reuse_read,
    may_skip_store,
)
from swarmtrain.runtime.server.activity_clock import ActivityClock

pytestmark = pytest.mark.unit


def test_no_slack_within_the_grace_then_it_grows_to_its_cap():
    assert idle_slack_s(0.0) == 0.0
    assert idle_slack_s(IDLE_GRACE_S) == 0.0
    assert idle_slack_s(IDLE_GRACE_S + 3.0) == pytest.approx(3.0)
    assert idle_slack_s(IDLE_GRACE_S + 1000.0) == MAX_SLACK_S
    assert idle_slack_s(5.0, grace_s=2.0, max_slack_s=1.5) == 1.5


def test_a_read_is_reused_only_within_the_slack():
    assert not may_reuse_read(0.0, 0.0)  # no slack: every read goes to the DHT
    assert may_reuse_read(4.0, 10.0)
    assert not may_reuse_read(10.0, 10.0)
    assert not may_reuse_read(-1.0, 10.0)  # a clock that went back: read again


def test_a_store_is_skipped_only_when_unchanged_young_and_with_half_its_life_ahead():
    assert may_skip_store(True, 2.0, ttl_s=6.0, slack_s=10.0)
    assert not may_skip_store(False, 2.0, ttl_s=6.0, slack_s=10.0)  # a new value is stored at once
    assert not may_skip_store(True, 3.0, ttl_s=6.0, slack_s=10.0)  # half its life gone: re-stored
    assert not may_skip_store(True, 2.0, ttl_s=6.0, slack_s=0.0)  # active: every store goes out
    assert not may_skip_store(True, 2.0, ttl_s=6.0, slack_s=1.5)


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class FakeDHT:
    """hivemind's store and get, in memory, counting the calls."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, object]] = {}
        self.gets = self.stores = 0

    def store(self, key, value, expiration_time, subkey, return_future):
        self.stores += 1
        self.records.setdefault(key, {})[subkey] = value
        return _done(True)

    def get(self, key, latest, return_future):
        self.gets += 1
        items = {k: SimpleNamespace(value=v) for k, v in self.records.get(key, {}).items()}
        return _done(SimpleNamespace(value=items) if items else None)


def _announcement(throughput: float = 5.0) -> StageAnnouncement:
    return StageAnnouncement(0, ["/ip4/1.2.3.4/tcp/1"], throughput, 0, "d", 0)


def test_records_read_and_store_every_time_without_slack():
    dht = FakeDHT()
    records = RunRecords(dht, "run")
    for _ in range(3):
        records.announce("p", _announcement(), ttl_s=6.0)
        records.stage_peers(0)
    assert (dht.stores, dht.gets) == (3, 3)


def test_records_within_the_slack_reuse_reads_and_skip_unchanged_stores():
    dht, slack = FakeDHT(), [10.0]
    records = RunRecords(dht, "run", slack_s=lambda: slack[0])
    records.announce("p", _announcement(), ttl_s=60.0)
    records.announce("p", _announcement(), ttl_s=60.0)  # only its time stamp differs
    assert dht.stores == 1 and records.stores_skipped == 1
    assert list(records.stage_peers(0)) == ["p"]
    dht.records["run.stage0"]["q"] = _announcement().to_value()  # another peer's, not yet seen
    assert list(records.stage_peers(0)) == ["p"] and dht.gets == 1  # reused
    records.announce("p", _announcement(throughput=7.0), ttl_s=60.0)  # changed: stored, reads renewed
    assert dht.stores == 2
    assert sorted(records.stage_peers(0)) == ["p", "q"] and dht.gets == 2
    slack[0] = 0.0  # active again: to the DHT every time
    records.announce("p", _announcement(throughput=7.0), ttl_s=60.0)
    records.stage_peers(0)
    assert (dht.stores, dht.gets) == (3, 3)


def test_a_failed_store_is_not_remembered():
    dht = FakeDHT()
    records = RunRecords(dht, "run", slack_s=lambda: 10.0)
    dht.store = lambda *args, **kwargs: _done(False)
    assert not records.announce("p", _announcement(), ttl_s=60.0)
    dht.store = FakeDHT.store.__get__(dht)
    assert records.announce("p", _announcement(), ttl_s=60.0) and dht.stores == 1


def test_the_view_without_slack_reads_the_dht():
    dht = FakeDHT()
    records = RunRecords(dht, "run", slack_s=lambda: 10.0)
    records.moves()
    records.moves()
    records.without_slack().moves()
    assert dht.gets == 2


def test_the_activity_clock_counts_idleness_from_the_last_change():
    now, counters = [100.0], {"epoch": 0}
    clock = ActivityClock(clock=lambda: now[0])
    now[0] += 500.0
    assert clock.idle_s() == 0.0  # nothing watched: the usual pace
    clock.watch(lambda: counters["epoch"])
    now[0] += 40.0
    assert clock.idle_s() == pytest.approx(40.0)
    assert clock.slack_s() == pytest.approx(idle_slack_s(40.0))
    counters["epoch"] = 1  # a step: active at once
    assert clock.idle_s() == 0.0
    now[0] += 5.0
    assert clock.idle_s() == pytest.approx(5.0)
    clock.watch(None)
    assert clock.slack_s() == 0.0
