"""Hedging (runtime/trainer/hedging.py): the waits a hedged call is made of, `silent_while` (wait for a
call, asking now and then which of its peers are silent) and `first_success` (the first of two calls to
succeed wins, the other is cancelled; both failing raises the original's failure), and `Hedger`, the one
helper the relayed calls and the chains hedge through (their own tests: test_stage_calls.py)."""

import asyncio
import time

import pytest
from test_stage_calls import A, B, SpyTable

from swarmtrain.config import SwarmConfig
from swarmtrain.planner import deadlines
from swarmtrain.runtime.trainer.call_policy import Attempt, CallStats, PeerChoice
from swarmtrain.runtime.trainer.hedging import Copy, Hedger, SilentPastDeadline, first_success
from swarmtrain.utils.silence import silent_while

pytestmark = pytest.mark.unit


async def _answer(value, after_s: float):
    await asyncio.sleep(after_s)
    return value


async def _fail(exc: Exception, after_s: float):
    await asyncio.sleep(after_s)
    raise exc


def _race(primary, hedge):
    async def race():
        calls = asyncio.ensure_future(primary), asyncio.ensure_future(hedge)
        try:
            return await first_success(*calls)
        finally:
            await asyncio.sleep(0)  # let cancellations land before the checks
            assert all(call.done() for call in calls)

    return asyncio.run(race())


def test_the_first_call_to_succeed_wins():
    assert _race(_answer("original", 0.01), _answer("copy", 0.2)) == (False, "original")
    assert _race(_answer("original", 0.2), _answer("copy", 0.01)) == (True, "copy")


def test_a_failure_does_not_win_the_other_call_is_waited_for():
    assert _race(_fail(TimeoutError(), 0.01), _answer("copy", 0.1)) == (True, "copy")
    assert _race(_answer("original", 0.1), _fail(ConnectionError(), 0.01)) == (False, "original")


def test_when_both_fail_the_originals_failure_is_raised():
    with pytest.raises(TimeoutError):
        _race(_fail(TimeoutError(), 0.05), _fail(ConnectionError(), 0.01))
    with pytest.raises(TimeoutError):
        _race(_fail(TimeoutError(), 0.01), _fail(ConnectionError(), 0.05))


def test_the_loser_is_cancelled():
    async def race():
        slow = asyncio.ensure_future(_answer("original", 10.0))
        hedge_won, value = await first_success(slow, asyncio.ensure_future(_answer("copy", 0.01)))
        await asyncio.sleep(0)
        return hedge_won, value, slow.cancelled()

    assert asyncio.run(race()) == (True, "copy", True)


def test_a_call_that_finishes_is_never_reported_silent():
    probes = []

    async def probe():
        probes.append(1)
        return ["peer"]

    async def wait():
        call = asyncio.ensure_future(_answer("ok", 0.01))
        return await silent_while(call, 0.5, probe)

    assert asyncio.run(wait()) == [] and probes == []


def test_peers_that_answer_are_asked_again_until_one_is_silent():
    answers = [[], [], ["frozen"]]

    async def probe():
        return answers.pop(0)

    async def wait():
        call = asyncio.ensure_future(_answer("late", 10.0))
        try:
            return await silent_while(call, 0.01, probe)
        finally:
            call.cancel()

    assert asyncio.run(wait()) == ["frozen"] and answers == []


# Hedger ------------------------------------------------------------------------------------------------
WAIT_S = 0.3  # the silent peer's deadline in these tests


@pytest.fixture
def quick_checks(monkeypatch):
    """Ping a call's peers after 50 ms; a ping gets 50 ms."""
    monkeypatch.setattr(deadlines, "UNMEASURED_CHECK_S", 0.05)
    monkeypatch.setattr(deadlines, "PING_TIMEOUT_FLOOR_S", 0.05)


def _hedged(original, copy=None, silent=(A,)):
    """`Hedger.call` on `original` (a call to A at stage 0), with `copy()` (a call to B; None: nobody can
    take one) when a peer of `silent` does not answer pings. Returns (its result, or the
    exception it raised; the stats; the table; the pings; what `copy_around` was asked)."""
    table, stats, pings, asked = SpyTable([[A, B]]), CallStats(), [], []

    async def silent_peers(pairs, timeout_s):
        pings.append(pairs)
        return [pair for pair in pairs if pair[1] in silent]

    def copy_around(silent_pairs):
        asked.append(silent_pairs)
        return None if copy is None else Copy(B, copy())

    async def run():
        hedger = Hedger(PeerChoice(table, SwarmConfig(), asyncio.Event(), refresh=None), stats, silent_peers)
        try:
            return await hedger.call(original, Attempt(A, WAIT_S, 3.0), None, [(0, A)], copy_around, "a call")
        except Exception as exc:
            return exc

    return asyncio.run(run()), stats, table, pings, asked


def _counters(stats):
    return stats.frozen, stats.hedges, stats.hedges_won


def test_a_call_answered_in_its_usual_time_is_neither_pinged_nor_hedged(quick_checks):
    result, stats, table, pings, asked = _hedged(_answer("original", 0.01), lambda: _answer("copy", 0.01))
    assert result == (None, "original") and pings == [] and asked == []
    assert _counters(stats) == (0, 0, 0) and table.bans == []


def test_a_silent_peer_is_banned_as_frozen_and_a_copy_raced_against_it(quick_checks):
    result, stats, table, pings, asked = _hedged(_answer("original", 10.0), lambda: _answer("copy", 0.01))
    copy, answer = result
    assert (copy.peer, answer) == (B, "copy") and asked == [[(0, A)]] and pings[0] == [(0, A)]
    assert _counters(stats) == (1, 1, 1) and table.bans == [(0, A)]


def test_the_original_still_wins_when_it_answers_first(quick_checks):
    result, stats, table, _, _ = _hedged(_answer("original", 0.15), lambda: _answer("copy", 5.0))
    assert result == (None, "original")
    assert _counters(stats) == (1, 1, 0) and table.bans == [(0, A)]  # it was silent: banned all the same


def test_with_nobody_to_take_a_copy_a_silent_peers_call_ends_at_its_deadline(quick_checks):
    start_s = time.monotonic()
    result, stats, table, _, asked = _hedged(_answer("original", 10.0))
    assert isinstance(result, SilentPastDeadline) and WAIT_S <= time.monotonic() - start_s < 2.0
    assert asked == [[(0, A)]]
    assert _counters(stats) == (0, 0, 0) and table.bans == []  # run_call bans it, as any timed-out peer


def test_a_peer_that_answers_pings_is_waited_for_past_its_deadline(quick_checks):
    result, stats, table, pings, asked = _hedged(_answer("original", 2 * WAIT_S), silent=())
    assert result == (None, "original") and asked == [] and len(pings) >= 2
    assert _counters(stats) == (0, 0, 0) and table.bans == []
