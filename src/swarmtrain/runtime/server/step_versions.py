"""The parameter version a stage's forwards wait for.

A forward of step k must run on the parameters after step k - 1 (`StageRequest.version`), so it parks
here until the step loop (runtime/server/stage_steps.py) or a resync (runtime/server/stage_sync.py)
moves the epoch. Everything here runs on the server's asyncio loop; a resync on another thread
signals through `changed_threadsafe`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class VersionGate:
    def __init__(self, epoch: Callable[[], int], loop: asyncio.AbstractEventLoop) -> None:
        """`epoch`: the stage's current parameter version; `loop`: the loop waiters run on."""
        self._epoch, self._loop = epoch, loop
        self._changed = asyncio.Event()

    async def wait(
        self, version: int, deadline_s: float, abandon: Callable[[], bool] = lambda: False
    ) -> bool:
        """Until the parameters have reached `version`; False at the deadline (a time.monotonic()
        value), or once `abandon()` is true when the version changes (`changed` makes waiters check)."""
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
