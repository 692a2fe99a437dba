"""Clocks: the wall clock for the runtime and a virtual clock the simulator advances by hand."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_s(self) -> float: ...


class WallClock:
    """Monotonic seconds; used for durations and timeouts in live processes."""

    def now_s(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock that only moves when told to; never reads the wall clock."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now_s(self) -> float:
        return self._now_s

    def advance_to(self, t_s: float) -> None:
        if t_s < self._now_s:
            raise ValueError(f"virtual clock cannot go back from {self._now_s} to {t_s}")
        self._now_s = t_s
