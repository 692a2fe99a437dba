"""The parameter version a stage's forwards wait for.

A forward of step k must run on the parameters after step k - 1 (`StageRequest.version`), so it parks
here until the step loop (runtime/server/stage_steps.py) or a resync (runtime/server/stage_sync.py)
moves the epoch. Everything here runs on the server's asyncio loop; a resync on another thread
signals through `changed_threadsafe`, and the catch-up reads `held_since` from its thread: a request
parked for a version this replica does not reach is the sign that its stage went on without it when no
close says so (runtime/server/stage_catch_up.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable


class VersionGate:
    def __init__(self, epoch: Callable[[], int], loop: asyncio.AbstractEventLoop) -> None:
        """`epoch`: the stage's current parameter version; `loop`: the loop waiters run on."""
        self._epoch, self._loop = epoch, loop
        self._changed = asyncio.Event()
        self._parked: dict[int, tuple[float, int]] = {}  # waiter -> (parked since, version it waits for)
        self._tickets = itertools.count()

    async def wait(
        self,
        version: int,
        deadline_s: float,
        abandon: Callable[[], bool] = lambda: False,
        counted: bool = True,
    ) -> bool:
        """Until the parameters have reached `version`; False at the deadline (a time.monotonic()
        value), or once `abandon()` is true when the version changes (`changed` makes waiters check).
        `counted`: the wait shows in `held_since` (a training request's; an evaluation may name any step)."""
        if self._epoch() >= version:
            return True
        if not counted:
            return await self._until(version, deadline_s, abandon)
        ticket = next(self._tickets)
        self._parked[ticket] = (time.monotonic(), version)
        try:
            return await self._until(version, deadline_s, abandon)
        finally:
            del self._parked[ticket]

    def held_since(self, max_version: int) -> float | None:
        """(any thread) Since when the oldest counted request still parked has waited for a version past
        the epoch and at most `max_version` (time.monotonic()); None when none waits. A request further
        ahead shows nothing (an honest one is refused at once by a replica that trails its stage)."""
        try:
            parked = list(self._parked.values())
        except RuntimeError:  # the loop parked or released a request while this thread copied
            return None
        epoch = self._epoch()
        return min((since_s for since_s, version in parked if epoch < version <= max_version), default=None)

    async def _until(self, version: int, deadline_s: float, abandon: Callable[[], bool]) -> bool:
        while self._epoch() < version:
            if abandon():
                return False
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining_s)
            except TimeoutError:
                return False
        return True

    def changed(self) -> None:
        """Waiters look again: the epoch moved, or they may have to give up (a drain)."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def changed_threadsafe(self) -> None:
        """After a resync on another thread moved the epoch."""
        self._loop.call_soon_threadsafe(self.changed)
