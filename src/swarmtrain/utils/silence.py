"""Waiting on a call while asking whether its peer still answers: a busy peer from a silent one.

A frozen peer (SIGSTOP, a laptop lid, a partition) keeps its sockets open and answers nothing, so a call
to it ends only at its timeout. Its event loop answers a ping at once however busy its compute is, so a
caller that pings the peers a long call waits on learns within seconds which of them went silent. The
trainers hedge such a call (runtime/trainer/hedging.py); a replica replaying a step from a stage peer
gives the peer up (runtime/server/stage_exchange.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

P = TypeVar("P")


class PeerSilent(TimeoutError):
    """A peer stopped answering pings during a call to it (taken for frozen)."""


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
