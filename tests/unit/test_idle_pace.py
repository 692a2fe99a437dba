"""An idle server's DHT slack (planner/idle_pace.py): the policy, how `RunRecords` applies it, and the
activity clock that measures idleness (runtime/server/activity_clock.py)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from swarmtrain.net.dht_records import RunRecords, StageAnnouncement
from swarmtrain.planner.idle_pace import (
    IDLE_GRACE_S,
    IDLE_TTL_PER_SLACK,
    MAX_SLACK_S,
    idle_slack_s,
    may_reuse_read,
    may_skip_store,
    outlasting_expiration,
    store_expiration,
    stored_ttl_s,
)
from swarmtrain.runtime.server.activity_clock import WAKE_GAP_S, ActivityClock, stage_markers

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


def test_an_idle_store_lives_longer_so_an_unchanged_record_is_restored_once_per_slack():
    assert stored_ttl_s(4.0, 0.0) == 4.0  # active: its own time-to-live
    ttl_s = stored_ttl_s(4.0, MAX_SLACK_S)
    assert ttl_s == 4.0 + IDLE_TTL_PER_SLACK * MAX_SLACK_S
    restored_after_s = min(MAX_SLACK_S, ttl_s / 2)
    assert restored_after_s >= 4 * (4.0 / 2)  # at least 4x less often than every half time-to-live
    assert may_skip_store(True, restored_after_s - 0.1, ttl_s=ttl_s, slack_s=MAX_SLACK_S)
    assert not may_skip_store(True, restored_after_s, ttl_s=ttl_s, slack_s=MAX_SLACK_S)


def test_a_store_never_expires_before_the_last_one_of_its_subkey():
    assert store_expiration(100.0, 4.0, None) == 104.0
    assert store_expiration(100.0, 4.0, 90.0) == 104.0
    assert store_expiration(100.0, 4.0, 124.0) > 124.0  # after an idle store: later still, not refused
    assert store_expiration(100.0, 4.0, 104.0) > 104.0  # a tie keeps the old value
    assert outlasting_expiration(100.0, 4.0) > 100.0 + stored_ttl_s(4.0, MAX_SLACK_S)


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


class StrictDHT(FakeDHT):
    """Stores through hivemind's own local storage, which refuses a subkey's value that expires no later
    than the one it holds; reads return what it keeps."""

    def __init__(self) -> None:
        super().__init__()
        from hivemind.dht.storage import DHTLocalStorage

        self.storage = DHTLocalStorage()

    def store(self, key, value, expiration_time, subkey, return_future):
        from hivemind.dht.routing import DHTID
        from hivemind.utils.serializer import MSGPackSerializer

        self.stores += 1
        packed = MSGPackSerializer.dumps(value)
        return _done(self.storage.store(DHTID.generate(source=key), packed, expiration_time, subkey=subkey))

    def get(self, key, latest, return_future):
        from hivemind.dht.routing import DHTID
        from hivemind.utils.serializer import MSGPackSerializer

        self.gets += 1
        found = self.storage.get(DHTID.generate(source=key))
        if found is None:
            return _done(None)
        items = {k: SimpleNamespace(value=MSGPackSerializer.loads(v.value)) for k, v in found.value.items()}
        return _done(SimpleNamespace(value=items))


def test_a_step_after_an_idle_store_replaces_it():
    """An idle store lives longer; the store of the next step, made with the usual short time-to-live,
    must still replace it (hivemind keeps the value that expires last)."""
    dht, slack = StrictDHT(), [MAX_SLACK_S]
    records = RunRecords(dht, "run", slack_s=lambda: slack[0])
    assert records.publish_progress(0, "p", {"epoch": 3, "samples": 0}, ttl_s=4.0)
    slack[0] = 0.0  # a micro-batch: active
    assert records.publish_progress(0, "p", {"epoch": 4, "samples": 0}, ttl_s=4.0)
    assert records.stage_progress(0)["p"]["epoch"] == 4


def test_the_view_without_slack_stores_after_an_idle_store_of_the_same_record():
    """The balancer's view of the records (`without_slack`) stores its move lease with no slack, after
    the peer's own records may have stored the same subkey idle: it must land all the same."""
    dht = StrictDHT()
    records = RunRecords(dht, "run", slack_s=lambda: MAX_SLACK_S)
    assert records.publish_move("p", {"state": "proposed"}, ttl_s=6.0)
    view = records.without_slack()
    assert view.publish_move("p", {"state": "moving"}, ttl_s=6.0)
    assert view.moves()["p"]["state"] == "moving"


def test_a_restarted_peer_replaces_its_previous_lifes_idle_record():
    """A peer restarted with the same identity knows nothing of its last life's idle store: its first
    store, refused, goes once more outlasting it."""
    dht = StrictDHT()
    RunRecords(dht, "run", slack_s=lambda: MAX_SLACK_S).announce("p", _announcement(5.0), ttl_s=6.0)
    restarted = RunRecords(dht, "run")
    assert restarted.announce("p", _announcement(9.0), ttl_s=6.0)
    assert restarted.stage_peers(0)["p"].throughput_samples_per_s == 9.0
    assert restarted.announce("p", _announcement(11.0), ttl_s=6.0)  # and from then on in order
    assert restarted.stage_peers(0)["p"].throughput_samples_per_s == 11.0
    assert dht.stores == 4


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


def _advance(clock: ActivityClock, now: list[float], seconds: float, every_s: float = 0.5) -> float:
    """Move the fake time on by `seconds`, looking at the clock every `every_s` as the sync thread does;
    returns the last idleness seen."""
    idle_s = clock.idle_s()
    for _ in range(round(seconds / every_s)):
        now[0] += every_s
        idle_s = clock.idle_s()
    return idle_s


def test_the_activity_clock_counts_idleness_from_the_last_change():
    now, counters = [100.0], {"epoch": 0}
    clock = ActivityClock(clock=lambda: now[0])
    assert _advance(clock, now, 500.0) == 0.0  # nothing watched: the usual pace
    clock.watch(lambda: counters["epoch"])
    assert _advance(clock, now, 40.0) == pytest.approx(40.0)
    assert clock.slack_s() == pytest.approx(idle_slack_s(40.0))
    counters["epoch"] = 1  # a step: active at once
    assert clock.idle_s() == 0.0
    assert _advance(clock, now, 5.0) == pytest.approx(5.0)
    clock.watch(None)
    assert clock.slack_s() == 0.0


def test_waking_from_a_stop_is_activity():
    """A process stopped (SIGSTOP) for a while reads afresh when it wakes: what it read
    before is old news, however idle its stage was."""
    now = [100.0]
    clock = ActivityClock(clock=lambda: now[0])
    clock.watch(lambda: 0)
    assert _advance(clock, now, 60.0) == pytest.approx(60.0)
    now[0] += WAKE_GAP_S  # no look for that long
    assert clock.idle_s() == 0.0 and clock.slack_s() == 0.0
    assert _advance(clock, now, 3.0) == pytest.approx(3.0)


def test_a_refused_request_is_activity():
    """A replica that trails its stage refuses trainers' micro-batches: it is not idle, and reads its
    stage's progress afresh."""
    import asyncio

    from swarmtrain.runtime.server.stage_desk import Admission, MicroBatchDesk

    admission = Admission(serving=lambda: False)  # refuses everything
    desk = MicroBatchDesk(None, None, None, "", None, None, None, None, admission, None)
    service = SimpleNamespace(
        worker=SimpleNamespace(epoch=3),
        admission=admission,
        compute=SimpleNamespace(tasks_done=0),
        serving=False,
        draining=False,
    )
    now = [100.0]
    clock = ActivityClock(clock=lambda: now[0])
    clock.watch(stage_markers(service))
    assert _advance(clock, now, 40.0) == pytest.approx(40.0)
    answer = asyncio.run(desk._serve(SimpleNamespace(header={}), run=None))
    assert answer.header["code"] == "unavailable"  # refused, and counted
    assert clock.idle_s() == 0.0
