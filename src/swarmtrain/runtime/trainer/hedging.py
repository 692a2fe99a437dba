"""Speculative copies of a call whose peer went silent (issue 23: a frozen replica must not stall the
swarm).

A frozen peer (SIGSTOP, a host that lost power, a partition) keeps its sockets open and answers
nothing: a call to it is only given up on at its deadline, seconds later, and its step cannot close
meanwhile. So a call that runs past its peer's usual time makes the caller ping the peers it waits on
(planner/deadlines.py: `check_after_s`, `ping_timeout_s`). A peer whose event loop answers is busy,
not frozen: the call goes on, up to the request timeout. A silent one is treated as dead (banned until
it announces itself again) and the call is hedged: a copy goes to another replica, and the first answer
wins; with no other replica to take a copy, the silent peer's call is given up at its deadline
(`within_deadline`).

The deadline used to be the call's own timeout, whatever the pings said. On the test bed's link fleet
with fp32 gradient sums (bench/rebalance_live.py), a stage-1 replica's step exchange over a 4 Mbit/s
link took 4-6 s, and chains waiting at stage 1 for that step ran past the 5 s deadline of the one
stage-0 replica, which answered every ping: each was retried without accumulating and its peer banned
for a moment, and the swarm's steps went from 5 s to 14-22 s apart.

At most once: the copy never accumulates gradients anywhere (the frozen peer, or a later stage it
already reached, may hold the micro-batch and apply it when it wakes). If the copy wins, the step
tracker records that no stage accumulated the micro-batch; whatever the original's peers do with it
later is theirs alone (a replica the trainers' close does not list drops it, counted as lost). The
loser's answer is discarded: its call is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
P = TypeVar("P")


async def silent_while(call: asyncio.Future, check_after_s: float, probe: Callable[[], Awaitable[list[P]]]):
    """Wait for `call`; every `check_after_s` while it runs, ask `probe()` which of the peers it waits
    on do not answer. Returns those once there are any and the call still runs; [] when the call
    finished (successfully or not: the caller awaits it)."""
    while True:
        done, _ = await asyncio.wait({call}, timeout=check_after_s)
        if done:
            return []
        silent = await probe()
        if silent and not call.done():
            return silent


class SilentPastDeadline(TimeoutError):
    """A call given up at its deadline because its peer stopped answering pings (taken for frozen)."""


async def within_deadline(call: asyncio.Future[T], deadline_at_s: float) -> T:
    """`call`'s result, given up (and cancelled) at `deadline_at_s` (time.monotonic()): a call whose
    peer went silent. Its own failure is raised as it is."""
    try:
        return await asyncio.wait_for(call, max(deadline_at_s - time.monotonic(), 0.0))
    except TimeoutError as exc:
        if call.cancelled():  # ours: the deadline passed
            raise SilentPastDeadline("the peer went silent and its deadline passed") from exc
        raise


async def first_success(primary: asyncio.Future[T], hedge: asyncio.Future[T]) -> tuple[bool, T]:
    """(whether the hedge won, its result) for whichever of the two calls succeeds first; the other is
    cancelled. When both fail, the primary's exception is raised (it decides the retry)."""
    pending: set[asyncio.Future[T]] = {primary, hedge}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for call in sorted(done, key=lambda c: c is hedge):  # the primary first when both are done
                if not call.cancelled() and call.exception() is None:
                    return call is hedge, call.result()
    finally:
        for call in pending:
            call.cancel()
    if not hedge.cancelled():
        hedge.exception()  # retrieved: its failure is not ours to report
    return False, primary.result()
