"""How long the stage a server serves has been idle, and so the slack its DHT records allow
(planner/idle_pace.py): the server process's `RunRecords` asks `slack_s()` at every read and store.

Activity is any change of a few counters of the served stage (`stage_markers`): its parameter version
(steps applied, a resync, an adopted step), the micro-batch requests that reached it (refused ones too:
a replica that trails its stage and refuses trainers is not idle), the samples whose backward ran here,
the compute thread's jobs (micro-batches, `info` calls) and whether it serves or drains. Read lazily
from whichever thread reads or stores a record, so a micro-batch ends the slack at the next record call,
not at the next tick. So does waking: a look `WAKE_GAP_S` after the last one (the sync thread looks
twice a second, the progress heartbeat once) means the process was stopped (SIGSTOP) or starved, and
what it read before is old news. (A host's suspend is not seen here, the clock being monotonic; the
records age their reads and stores in wall time, which sees it.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

from swarmtrain.planner.idle_pace import idle_slack_s

Markers = Callable[[], Hashable]

# a gap this long between two looks at the clock is a wake-up (SIGSTOP, a starved process): activity
WAKE_GAP_S = 5.0


def stage_markers(service) -> Markers:
    """The counters of a `StageService` whose change is activity."""

    def markers() -> Hashable:
        return (
            service.worker.epoch,
            service.admission.received,
            service.admission.samples_done,
            service.compute.tasks_done,
            service.serving,
            service.draining,
        )

    return markers


class ActivityClock:
    """The idleness of the service being watched; none (the usual pace) while none is."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._markers: Markers | None = None
        self._last: Hashable = None
        self._active_at_s = self._looked_at_s = clock()

    def watch(self, markers: Markers | None) -> None:
        """Watch a new service's counters (None: none served); it starts active."""
        last = markers() if markers is not None else None
        with self._lock:
            self._markers, self._last, self._active_at_s = markers, last, self._clock()

    def idle_s(self) -> float:
        with self._lock:
            now_s, markers = self._clock(), self._markers
            woke, self._looked_at_s = now_s - self._looked_at_s >= WAKE_GAP_S, now_s
            if markers is None:
                self._active_at_s = now_s
                return 0.0
            current = markers()
            if current != self._last or woke:
                self._last, self._active_at_s = current, now_s
            return now_s - self._active_at_s

    def slack_s(self) -> float:
        return idle_slack_s(self.idle_s())
