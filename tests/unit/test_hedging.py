"""The two waits a hedged call is made of (runtime/trainer/hedging.py): `silent_while` (wait for a call,
asking now and then which of its peers are silent) and `first_success` (the first of two calls to
succeed wins, the other is cancelled; both failing raises the original's failure)."""

import asyncio

import pytest

from swarmtrain.runtime.trainer.hedging import first_success, silent_while

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
