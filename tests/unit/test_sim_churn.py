"""Churn models (consistent, seeded, shaped as documented) and trace files with their error messages."""

from collections import Counter

import pytest

from swarmtrain.config.errors import UserError
from swarmtrain.sim.churn import (
    CHURN_MODELS,
    ChurnEvent,
    ChurnSchedule,
    TraceError,
    churn_schedule,
    load_trace,
    write_trace,
)
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, uniform_locations
from swarmtrain.sim.fleet import synthetic_fleet

pytestmark = pytest.mark.unit

FLEET = synthetic_fleet(300, seed=0)


def small_fleet(n=3):
    locations = uniform_locations(("here", "there"), 0.01, 1e9)
    return Fleet(tuple(PeerSpec.from_device(f"p{i}", DEVICE_TYPES["t4"], i % 2) for i in range(n)), locations)


def assert_consistent(schedule: ChurnSchedule, num_peers: int, duration_s: float):
    live = [p not in schedule.initially_offline for p in range(num_peers)]
    last = 0.0
    for e in schedule.events:
        assert last <= e.time_s <= duration_s
        last = e.time_s
        assert live[e.peer] == (e.event != "join"), e
        live[e.peer] = e.event == "join"


@pytest.mark.parametrize("name", CHURN_MODELS)
def test_models_are_consistent_and_seeded(name):
    schedule = churn_schedule(name, FLEET, 7200.0, seed=5)
    assert_consistent(schedule, FLEET.num_peers, 7200.0)
    assert schedule == churn_schedule(name, FLEET, 7200.0, seed=5)
    if name != "none":
        assert schedule.events and schedule != churn_schedule(name, FLEET, 7200.0, seed=6)


def test_preemptible_reclaims_in_batches_and_instances_come_back():
    schedule = churn_schedule("preemptible", FLEET, 3 * 3600.0, seed=0)
    fails_at = Counter(e.time_s for e in schedule.events if e.event == "fail")
    assert max(fails_at.values()) >= 5  # a batch: many instances reclaimed at the same moment
    batch_time = max(fails_at, key=fails_at.get)
    victims = [FLEET.peers[e.peer] for e in schedule.events if e.time_s == batch_time]
    assert len({(p.device, p.location) for p in victims}) == 1  # one spot pool
    assert schedule.counts()["join"] > 0.5 * schedule.counts()["fail"]


def test_regional_outage_takes_a_whole_location_down_together():
    schedule = churn_schedule("regional-outage", FLEET, 4 * 3600.0, seed=1)
    first = schedule.events[0]
    same_time = [e for e in schedule.events if e.time_s == first.time_s]
    locations = {FLEET.peers[e.peer].location for e in same_time}
    assert len(locations) == 1
    everyone_there = sum(1 for p in FLEET.peers if p.location in locations)
    assert len(same_time) == everyone_there


def test_diurnal_starts_some_peers_offline_and_uses_graceful_leaves():
    schedule = churn_schedule("diurnal", FLEET, 3600.0, seed=2)
    assert 0 < len(schedule.initially_offline) < FLEET.num_peers
    assert {e.event for e in schedule.events} <= {"join", "leave"}


def test_unknown_model_is_a_user_error():
    with pytest.raises(UserError, match="unknown churn model"):
        churn_schedule("meteor", FLEET, 10.0, 0)


def test_trace_round_trip(tmp_path):
    schedule = churn_schedule("exponential", FLEET, 3600.0, seed=3)
    path = tmp_path / "trace.csv"
    write_trace(path, schedule, FLEET)
    assert load_trace(path, FLEET) == schedule


def test_trace_round_trip_of_peers_offline_all_along(tmp_path):
    schedule = churn_schedule("diurnal", FLEET, 600.0, seed=3)
    silent = schedule.initially_offline - {e.peer for e in schedule.events}
    assert silent  # some volunteers stay away for the whole (short) run
    path = tmp_path / "trace.csv"
    write_trace(path, schedule, FLEET)
    back = load_trace(path, FLEET)
    assert back.events[len(silent) :] == schedule.events
    assert {e.peer for e in back.events[: len(silent)]} == silent
    assert all(e.time_s == 0.0 and e.event == "leave" for e in back.events[: len(silent)])


def test_trace_first_join_means_initially_offline(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("# comment\ntime_s,peer,event\n5,p1,join\n7.5,p0,fail\n9,p1,leave\n")
    schedule = load_trace(path, small_fleet())
    assert schedule.initially_offline == frozenset({1})
    assert schedule.events == (
        ChurnEvent(5.0, 1, "join"),
        ChurnEvent(7.5, 0, "fail"),
        ChurnEvent(9.0, 1, "leave"),
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("time,peer,event\n", "header must be `time_s,peer,event`"),
        ("time_s,peer,event\nabc,p0,fail\n", "line 2: time_s 'abc' is not a number"),
        ("time_s,peer,event\n-1,p0,fail\n", "line 2: time_s must be a finite number >= 0"),
        ("time_s,peer,event\nnan,p0,fail\n", "line 2: time_s must be a finite number >= 0"),
        ("time_s,peer,event\n5,p0,fail\n3,p1,fail\n", "line 3: time_s 3 goes back in time"),
        ("time_s,peer,event\n1,zz,fail\n", "line 2: unknown peer 'zz'"),
        ("time_s,peer,event\n1,p0,explode\n", "line 2: event must be join, leave or fail"),
        ("time_s,peer,event\n1,p0\n", "line 2: expected 3 fields"),
        ("time_s,peer,event\n1,p0,fail\n2,p0,leave\n", "line 3: peer p0 cannot leave: it is not live"),
        ("time_s,peer,event\n1,p0,fail\n2,p0,join\n3,p0,join\n", "line 4: peer p0 joins but is already live"),
    ],
)
def test_trace_errors_name_the_line_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace("`", ".")):
        load_trace(path, small_fleet())


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.csv", small_fleet())
