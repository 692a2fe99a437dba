"""A peer's deadline (planner/deadlines.py): the request timeout until its usual time is known, then a
generous multiple of it, never below the floor nor above the request timeout."""

import pytest

from swarmtrain.planner.deadlines import (
    CHECK_FLOOR_S,
    CHECK_RATIO,
    DEADLINE_FLOOR_S,
    DEADLINE_RATIO,
    EXCHANGE_PING_RATIO,
    MIN_CALLS,
    PING_TIMEOUT_FLOOR_S,
    UNMEASURED_CHECK_S,
    UNMEASURED_EXCHANGE_BYTES_PER_S,
    CallTimes,
    check_after_s,
    deadline_s,
    exchange_ping_timeout_s,
    ping_timeout_s,
    reply_ping_timeout_s,
    silent_deadline_s,
)

pytestmark = pytest.mark.unit
CAP_S = 30.0


def _times(*calls_s: float) -> CallTimes:
    times = CallTimes()
    for call_s in calls_s:
        times = times.observed(call_s)
    return times


def test_unknown_or_barely_known_peers_get_the_request_timeout():
    assert deadline_s(None, CAP_S) == CAP_S
    assert deadline_s(_times(*[0.1] * (MIN_CALLS - 1)), CAP_S) == CAP_S


def test_a_fast_steady_peer_gets_the_floor():
    assert deadline_s(_times(*[0.1] * MIN_CALLS), CAP_S) == DEADLINE_FLOOR_S


def test_a_slow_peer_gets_a_multiple_of_its_usual_time_within_the_cap():
    times = _times(*[2.0] * 50)
    assert times.mean_s == pytest.approx(2.0) and times.var_s2 == pytest.approx(0.0, abs=1e-12)
    assert deadline_s(times, CAP_S) == pytest.approx(DEADLINE_RATIO * 2.0)
    assert deadline_s(times, 5.0) == 5.0  # never more than the request timeout


def test_a_peer_with_a_wide_spread_gets_room_for_it():
    """Calls of 0.5 s and 4 s alternating (a step's exchange now and then): mean + 6 std, not 4 x mean."""
    times = _times(*[0.5, 4.0] * 40)
    std_s = times.var_s2**0.5
    assert std_s > 1.0
    assert deadline_s(times, CAP_S) == pytest.approx(times.mean_s + 6 * std_s)
    assert deadline_s(times, CAP_S) > 4.0 * 2  # far beyond the slowest usual call


def test_the_estimate_follows_a_peer_that_slows_down():
    times = _times(*[0.1] * 20, *[3.0] * 30)
    assert times.mean_s > 2.5 and deadline_s(times, CAP_S) > 10.0


def test_a_silent_call_is_checked_on_long_before_its_deadline():
    assert check_after_s(None, CAP_S) == UNMEASURED_CHECK_S
    fast, slow = _times(*[0.1] * MIN_CALLS), _times(*[2.0] * 50)
    assert check_after_s(fast, CAP_S) == CHECK_FLOOR_S < deadline_s(fast, CAP_S)
    assert check_after_s(slow, CAP_S) == pytest.approx(CHECK_RATIO * 2.0)
    assert check_after_s(slow, CAP_S) < deadline_s(slow, CAP_S)
    assert check_after_s(slow, 1.0) == 1.0  # never more than the request timeout


def test_a_noisy_peer_is_checked_on_later():
    noisy = _times(*[0.1, 1.1] * 20)
    assert check_after_s(noisy, CAP_S) > CHECK_RATIO * noisy.mean_s


def test_a_ping_gets_at_least_as_long_as_the_peers_usual_call():
    assert ping_timeout_s(None) == PING_TIMEOUT_FLOOR_S
    assert ping_timeout_s(_times(*[0.1] * 10)) == PING_TIMEOUT_FLOOR_S
    assert ping_timeout_s(_times(*[3.0] * 10)) == pytest.approx(3.0)


def test_a_stage_ping_waits_for_one_exchange_each_way():
    """A stage ping queues behind the sums on one libp2p connection: twice the exchange, floored."""
    assert exchange_ping_timeout_s(None) == PING_TIMEOUT_FLOOR_S
    assert exchange_ping_timeout_s(_times(*[0.01] * 10)) == PING_TIMEOUT_FLOOR_S  # a LAN
    slow_link = _times(*[2.0] * 10)  # ~1 MB of sums at 4 Mbit/s
    assert exchange_ping_timeout_s(slow_link) == pytest.approx(EXCHANGE_PING_RATIO * 2.0)
    assert exchange_ping_timeout_s(_times(*[1.0, 3.0] * 10)) > EXCHANGE_PING_RATIO * 2.0  # its spread too


def test_a_first_stage_ping_waits_for_our_sums_at_a_slow_links_rate():
    """Before any exchange with the peer is timed, the timeout follows the size of our sums: 1 MB of fp32
    sums takes 2 s each way at 4 Mbit/s, which the floor alone took for a freeze."""
    fp32_sums = 1_000_000
    assert exchange_ping_timeout_s(None, fp32_sums) == pytest.approx(
        EXCHANGE_PING_RATIO * fp32_sums / UNMEASURED_EXCHANGE_BYTES_PER_S
    )
    assert exchange_ping_timeout_s(None, fp32_sums) > 2 * 2.0  # behind one exchange each way at 4 Mbit/s
    assert exchange_ping_timeout_s(None, 10_000) == PING_TIMEOUT_FLOOR_S  # small sums: the floor
    slow_link = _times(*[2.0] * 10)
    assert exchange_ping_timeout_s(slow_link, fp32_sums) == exchange_ping_timeout_s(slow_link)  # measured


def test_a_silent_peer_not_yet_measured_is_given_up_at_the_floor_not_the_request_timeout():
    """Found in netbed chaos: a replica started 11 s before its link was cut held chains for the whole
    request timeout while pings said it was silent."""
    assert silent_deadline_s(None, CAP_S) == DEADLINE_FLOOR_S < CAP_S
    assert silent_deadline_s(_times(*[0.1] * (MIN_CALLS - 1)), CAP_S) == DEADLINE_FLOOR_S
    assert silent_deadline_s(None, 2.0) == 2.0  # never past the call's own deadline
    measured = _times(*[2.0] * MIN_CALLS)
    assert (
        silent_deadline_s(measured, deadline_s(measured, CAP_S))
        == deadline_s(measured, CAP_S)
        > DEADLINE_FLOOR_S
    )


def test_a_ping_during_a_replay_waits_for_the_means_it_queues_behind():
    """A donor's ping answer queues behind the step's means it sends (fp32): the exchange's timeout scaled
    by how much larger they are than the sums (8-bit sums: a quarter), the means' own size at a slow
    link's rate before any sums were sent, never less than the exchange's own timeout."""
    slow_link, means = _times(*[2.0] * 10), 4_000_000
    assert reply_ping_timeout_s(slow_link, means // 4, means) == pytest.approx(4 * EXCHANGE_PING_RATIO * 2.0)
    assert reply_ping_timeout_s(slow_link, means, means) == pytest.approx(EXCHANGE_PING_RATIO * 2.0)
    assert reply_ping_timeout_s(slow_link, 2 * means, means) == pytest.approx(EXCHANGE_PING_RATIO * 2.0)
    assert reply_ping_timeout_s(None, 0, means) == pytest.approx(
        EXCHANGE_PING_RATIO * means / UNMEASURED_EXCHANGE_BYTES_PER_S
    )
