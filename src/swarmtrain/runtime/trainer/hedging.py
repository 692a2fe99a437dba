"""Speculative copies of a call whose peer went silent: a frozen peer must not stall the swarm.

A frozen peer (SIGSTOP, a host that lost power, a partition) keeps its sockets open and answers
nothing: a call to it is only given up on at its deadline, seconds later, and its step cannot close
meanwhile. So a call that runs past its peer's usual time makes the caller ping the peers it waits on
(planner/deadlines.py: `check_after_s`, `ping_timeout_s`). A peer whose event loop answers is busy,
not frozen: the call goes on, up to the request timeout (a peer's own deadline would give up on calls
that wait on a slow step exchange further down, and retry them without accumulating). A silent one is
treated as dead (banned until it announces itself again) and the call is hedged: a copy goes to another
replica (a chain: on a route around the silent peers), and the first answer wins; with nobody to take a
copy, the silent peer's call is given up at its deadline (`within_deadline`). `Hedger` is that whole
sequence, for the relayed calls and the chains alike; the functions below are its waits.

At most once: the copy never accumulates gradients anywhere (the frozen peer, or a later stage it
already reached, may hold the micro-batch and apply it when it wakes). If the copy wins, the step
tracker records that no stage accumulated the micro-batch; whatever the original's peers do with it
later is theirs alone (a replica the trainers' close does not list drops it, counted as lost). The
loser's answer is discarded: its call is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from swarmtrain.planner.deadlines import CallTimes, check_after_s, ping_timeout_s, silent_deadline_s
from swarmtrain.runtime.trainer.call_policy import Attempt, CallStats, PeerChoice
from swarmtrain.utils.logging import get_logger
from swarmtrain.utils.silence import silent_while

logger = get_logger(__name__)

T = TypeVar("T")
Pair = tuple[int, str]  # (stage, peer)


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


@dataclass
class Copy(Generic[T]):
    """A hedged copy of a call, not sent yet: the peer it goes to (a chain's first) and its call."""

    peer: str
    call: Coroutine[Any, Any, T]


class Hedger:
    """Sends a call and waits for it; once it runs past its peer's usual time, pings the peers it waits on
    and, when one is silent, bans the silent ones (frozen) and races a copy on other peers."""

    def __init__(
        self,
        peers: PeerChoice,
        stats: CallStats,
        silent_peers: Callable[[list[Pair], float], Awaitable[list[Pair]]],
    ) -> None:
        """`silent_peers(pairs, timeout_s)`: those of `pairs` that do not answer a ping in `timeout_s`."""
        self.peers, self.stats, self.silent_peers = peers, stats, silent_peers

    async def call(
        self,
        send: Coroutine[Any, Any, T],
        attempt: Attempt,
        times: CallTimes | None,
        waited_on: list[Pair],
        copy_around: Callable[[list[Pair]], Copy[T] | None],
        what: str,
    ) -> tuple[Copy[T] | None, T]:
        """(the copy if it answered first, else None; the answer) of `send`, the call to `attempt.peer`
        (whose usual time is `times`), hedged with `copy_around(silent)` (None: nobody can take a copy)
        once some peer of `waited_on` is silent. While they all answer pings the call is waited for up to
        `attempt.cap_s`; once one is silent, until the peer's deadline (`SilentPastDeadline`). `what`:
        the call, for the log."""
        start_s = time.monotonic()
        original: asyncio.Future[T] = asyncio.ensure_future(send)

        async def probe() -> list[Pair]:
            return await self.silent_peers(waited_on, ping_timeout_s(times))

        silent = await silent_while(original, check_after_s(times, attempt.wait_s), probe)
        if not silent:
            return None, await original
        deadline_at_s = start_s + silent_deadline_s(times, attempt.wait_s)
        original = asyncio.ensure_future(within_deadline(original, deadline_at_s))
        copy = copy_around(silent)
        if copy is None:  # nobody to hedge on: wait for the silent peer until its deadline
            return None, await original
        self.treat_as_frozen(silent)
        self.stats.hedges += 1
        copy_won, answer = await first_success(original, asyncio.ensure_future(copy.call))
        self.stats.hedges_won += copy_won
        logger.info(
            "%s: %s silent; hedged on %s, the %s won",
            what,
            ", ".join(peer[-8:] for _, peer in silent),
            copy.peer[-8:],
            "copy" if copy_won else "original",
        )
        return copy if copy_won else None, answer

    def treat_as_frozen(self, silent: list[Pair]) -> None:
        """Silent peers that a call is hedged around are banned until they announce themselves again
        (a frozen peer cannot): no new work goes to them, and the step's close does not wait for them."""
        for stage, peer in silent:
            self.stats.frozen += 1
            self.peers.ban(stage, peer)
            logger.warning("stage %d peer %s does not answer a ping: treated as frozen", stage, peer[-8:])
