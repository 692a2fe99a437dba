"""The swarm's samples/s as a replica's applied steps show it (runtime/server/step_rate.py)."""

import pytest

from swarmtrain.runtime.server.step_rate import (
    IDLE_FLOOR_S,
    MIN_STEPS,
    UTILIZATION_WINDOWS,
    StepRate,
    Utilization,
)

pytestmark = pytest.mark.unit


def test_the_rate_is_the_median_of_recent_steps_so_one_long_gap_does_not_drag_it():
    rate, now_s = StepRate(), 100.0
    rate.applied(512, now_s)
    for interval_s in (5.0, 5.0, 40.0, 5.0, 5.0):  # a resync or a pause between trainers in the middle
        now_s += interval_s
        rate.applied(512, now_s)
    assert rate.samples_per_s(now_s) == pytest.approx(512 / 5.0)


def test_the_rate_is_unknown_until_a_few_steps_and_again_once_the_swarm_is_idle():
    rate, now_s = StepRate(), 0.0
    for _ in range(MIN_STEPS):  # the first step only starts the clock
        assert rate.samples_per_s(now_s) == 0.0
        rate.applied(32, now_s)
        now_s += 0.5
    rate.applied(32, now_s)
    assert rate.samples_per_s(now_s) == pytest.approx(64.0)
    assert rate.samples_per_s(now_s + IDLE_FLOOR_S - 1) == pytest.approx(64.0)
    assert rate.samples_per_s(now_s + IDLE_FLOOR_S + 1) == 0.0


def test_a_step_of_no_samples_or_no_time_adds_no_rate():
    rate = StepRate()
    for now_s, samples in ((0.0, 8), (1.0, 0), (1.0, 8), (2.0, 8), (3.0, 8), (4.0, 8)):
        rate.applied(samples, now_s)
    assert rate.samples_per_s(4.0) == pytest.approx(8.0)


def test_utilization_is_each_resources_busy_seconds_over_the_recent_wall_seconds():
    busy = Utilization()
    assert busy.fraction("compute") is None
    busy.update(0.0, {"compute": 10.0, "uplink": 0.0})
    busy.update(2.0, {"compute": 10.5, "uplink": 1.8})
    busy.update(4.0, {"compute": 11.5, "uplink": 3.6})
    assert busy.fraction("compute") == pytest.approx(1.5 / 4)
    assert busy.fraction("uplink") == pytest.approx(3.6 / 4)
    assert busy.fraction("downlink") == 0.0  # not measured: never busy
    for k in range(UTILIZATION_WINDOWS):  # old windows leave: the last ones alone count
        busy.update(6.0 + 2 * k, {"compute": 13.5 + 2 * k, "uplink": 3.6})
    assert busy.fraction("compute") == pytest.approx(1.0) and busy.fraction("uplink") == 0.0
