"""The clock that stands still while the process is stopped (utils/awake_clock.py), and the stage view
counted on it (runtime/server/stage_members.LiveReplicas)."""

import pytest

from swarmtrain.runtime.server.stage_members import LiveReplicas
from swarmtrain.utils.awake_clock import AwakeClock

pytestmark = pytest.mark.unit


def test_an_overshoot_past_the_gap_is_stopped_time_and_scheduling_noise_is_not():
    now = [100.0]
    clock = AwakeClock(tick_s=0.25, gap_s=2.0, clock=lambda: now[0])
    clock.observe(100.0, 100.25 + 0.5)  # late by 0.5 s: a busy machine
    assert clock.stopped_s == 0.0
    clock.observe(100.75, 100.75 + 0.25 + 19.0)  # 19 s late: a SIGSTOP
    assert clock.stopped_s == pytest.approx(19.0)
    now[0] = 121.0
    assert clock() == pytest.approx(102.0)


def test_a_replica_that_wakes_from_a_freeze_still_has_the_peers_it_saw_before():
    """Netbed chaos, seed 0: a stage-1 replica frozen for 19 s woke with an empty view of its stage and
    could not ask the peer that had run the steps it missed (that peer froze 3 s later)."""
    now = [100.0]
    clock = AwakeClock(tick_s=0.25, gap_s=2.0, clock=lambda: now[0])
    view = LiveReplicas(keep_s=8.0, clock=clock)
    view.update(["B"])
    now[0] += 19.25
    clock.observe(100.0, now[0])  # the watching thread's sleep took the whole freeze
    assert view.current() == {"B"}
    monotonic = LiveReplicas(keep_s=8.0, clock=lambda: now[0])
    monotonic.update(["B"], now_s=100.0)
    assert monotonic.current() == frozenset()  # on the monotonic clock it had gone
    now[0] += 8.5  # awake for longer than the keep time: gone
    assert view.current() == frozenset()


def test_a_stop_between_two_sleeps_is_counted():
    """CI, a loaded machine: a real SIGSTOP went uncounted. The watching thread's readings are contiguous,
    so a stop that lands after one reading and before the next sleep still shows as an overshoot."""
    now = [100.0]
    sleeps = [0]

    class Done(Exception):
        pass

    def sleep(tick_s):
        sleeps[0] += 1
        if sleeps[0] == 4:
            raise Done
        now[0] += tick_s

    def read():
        value = now[0]
        if sleeps[0] == 1:
            now[0] += 19.0  # stopped right after the reading that followed the first sleep
        return value

    clock = AwakeClock(tick_s=0.25, gap_s=2.0, clock=read, sleep=sleep)
    with pytest.raises(Done):
        clock._watch()
    assert clock.stopped_s == pytest.approx(19.0)
