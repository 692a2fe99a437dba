"""Speculative copies of a call whose peer went silent (issue 23: a frozen replica must not stall the
swarm).

A frozen peer (SIGSTOP, a host that lost power, a partition) keeps its sockets open and answers
nothing: a call to it is only given up on at its deadline, seconds later, and its step cannot close
meanwhile. So a call that runs past its peer's usual time makes the caller ping the peers it waits on
(planner/deadlines.py: `check_after_s`, `ping_timeout_s`). A peer whose event loop answers is busy,
not frozen: the call goes on. A silent one is treated as dead (banned until it announces itself
again) and the call is hedged: a copy goes to another replica, and the first answer wins.

At most once: the copy never accumulates gradients anywhere (the frozen peer, or a later stage it
already reached, may hold the micro-batch and apply it when it wakes). If the copy wins, the step
tracker records that no stage accumulated the micro-batch; whatever the original's peers do with it
later is theirs alone (a replica the trainers' close does not list drops it, counted as lost). The
loser's answer is discarded: its call is cancelled.
"""

from __future__ import annotations

import asyncio
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
