"""The event queue: a heap of (time_s, seq, handler, a, b) on a virtual clock.

Events at the same time run in the order they were scheduled (`seq`), so a run is a pure function of
its inputs and seed. Nothing here reads the wall clock. Handlers are plain callables taking two
arguments; passing them positionally (no closures, no kwargs) keeps the hot loop cheap.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Handler = Callable[[Any, Any], None]


class EventQueue:
    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s
        self._heap: list[tuple[float, int, Handler, Any, Any]] = []
        self._seq = 0
        self.events_processed = 0
        self.trace: list[tuple[float, int, str]] | None = None  # set to a list to record every event

    def schedule(self, time_s: float, handler: Handler, a: Any = None, b: Any = None) -> None:
        if time_s < self.now_s:
            raise ValueError(f"cannot schedule at {time_s} before now ({self.now_s})")
        heapq.heappush(self._heap, (time_s, self._seq, handler, a, b))
        self._seq += 1

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until_s: float) -> None:
        """Process every event with time <= until_s, then leave the clock at until_s."""
        heap = self._heap
        pop = heapq.heappop
        processed = 0
        trace = self.trace
        while heap and heap[0][0] <= until_s:
            time_s, seq, handler, a, b = pop(heap)
            self.now_s = time_s
            if trace is not None:
                trace.append((time_s, seq, getattr(handler, "__name__", "?")))
            handler(a, b)
            processed += 1
        self.events_processed += processed
        if until_s > self.now_s:
            self.now_s = until_s
