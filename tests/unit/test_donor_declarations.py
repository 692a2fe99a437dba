"""The pace of a stage replica's declaration as a state donor (planner/donor_declarations.py)."""

from __future__ import annotations

import pytest

from swarmtrain.planner.donor_declarations import MIN_REDECLARE_S, declaration_wait_s

pytestmark = pytest.mark.unit

PERIOD_S = 5.0


def _wait(now_s, priority, declared, sharing=True, was_sharing=True):
    return declaration_wait_s(
        now_s,
        sharing=sharing,
        was_sharing=was_sharing,
        priority=priority,
        declared=declared,
        period_s=PERIOD_S,
    )


def test_the_first_declaration_goes_at_once_and_a_peer_that_never_shared_stores_nothing():
    assert _wait(100.0, 3.0, None) == 0.0
    assert _wait(100.0, 3.0, None, sharing=False, was_sharing=False) == PERIOD_S


def test_a_step_is_declared_at_most_once_a_second_and_with_the_priority_of_then():
    declared = (10.0, 100.0, 105.0)  # priority 10 stored at 100 s, expiring at 105 s
    assert _wait(100.2, 11.0, declared) == pytest.approx(MIN_REDECLARE_S - 0.2)
    assert _wait(100.0 + MIN_REDECLARE_S, 17.0, declared) == 0.0  # due: stored with what it is then
    # unchanged: again with half its life left, so the next store lands before it expires (at its expiry
    # the donor went unlisted until the new store reached the DHT)
    assert _wait(100.2, 10.0, declared) == pytest.approx(2.3)
    assert _wait(102.5, 10.0, declared) == 0.0
    assert _wait(102.4, 11.0, (10.0, 100.0 - 0.5, 105.0)) == 0.0  # a rise past its second, now


def test_a_fall_a_recovery_and_a_switch_go_at_once():
    declared = (10.0, 100.0, 105.0)
    assert _wait(100.1, 9.5, declared) == 0.0  # marked as having skipped steps
    assert _wait(100.1, -1.0, declared) == 0.0  # stale: never to be picked on its old standing
    assert _wait(100.1, 12.0, (-1.0, 100.0, 105.0)) == 0.0  # caught up
    assert _wait(100.1, 10.0, declared, sharing=False) == 0.0  # withdrawn
    assert _wait(100.1, 10.0, declared, sharing=False, was_sharing=False) == PERIOD_S  # already withdrawn
    assert _wait(100.1, 10.0, declared, was_sharing=False) == 0.0  # shared again


def test_a_rise_never_waits_past_the_declarations_renewal():
    assert _wait(104.3, 11.0, (10.0, 104.2, 104.6)) == pytest.approx(0.1)
