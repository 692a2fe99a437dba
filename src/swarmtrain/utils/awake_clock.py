"""A clock that stands still while the process is stopped: time a process spent stopped (SIGSTOP, a
suspended host, a starved machine) is not time in which what it last saw of the swarm grew old.

A stage replica keeps its stage peers for a few seconds after it last saw them (runtime/server/
stage_members.LiveReplicas), so that one failed read drops nobody. Measured on the monotonic clock, a
replica frozen for 19 s woke with none left: it could not ask the peer that had run the steps it missed
(alive for 3 s more), adopted the other stages' step without them, and held the trainers for a request
timeout (netbed chaos, seed 0: 23 s without a micro-batch). On this clock the peers it saw just before it
froze are still there when it wakes, and are asked.

A daemon thread sleeps `tick_s` and counts every overshoot past `gap_s` as stopped time. Its readings are
contiguous (each sleep is measured from the previous reading, not from a fresh one), so a stop that lands
between two sleeps is counted too; `start()` returns once the thread has taken its first reading, so a
stop right after it is counted. A process forked after the clock started has no such thread: its clock is
the monotonic one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

TICK_S = 0.25
# an overshoot this long is a stop, not scheduling noise (a busy 2-core machine delays a sleep by ms)
GAP_S = 2.0


class AwakeClock:
    """`clock()` less the time this process was seen stopped; `start()` runs the watching thread."""

    def __init__(
        self,
        tick_s: float = TICK_S,
        gap_s: float = GAP_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.tick_s, self.gap_s, self._clock, self._sleep = tick_s, gap_s, clock, sleep
        self._lock = threading.Lock()
        self._watching = threading.Event()
        self.stopped_s = 0.0

    def __call__(self) -> float:
        with self._lock:
            return self._clock() - self.stopped_s

    def observe(self, slept_from_s: float, woke_at_s: float) -> None:
        """A sleep of `tick_s` that began at `slept_from_s` ended at `woke_at_s` (both on `clock`)."""
        late_s = woke_at_s - slept_from_s - self.tick_s
        if late_s > self.gap_s:
            with self._lock:
                self.stopped_s += late_s

    def start(self) -> AwakeClock:
        threading.Thread(target=self._watch, name="awake-clock", daemon=True).start()
        # a stop before the first reading would go uncounted (CI, a loaded machine: the thread had not run
        # yet when the test stopped the process)
        self._watching.wait()
        return self

    def _watch(self) -> None:
        last_s = self._clock()
        self._watching.set()
        while True:
            self._sleep(self.tick_s)
            now_s = self._clock()
            self.observe(last_s, now_s)
            last_s = now_s


_shared: AwakeClock | None = None
_shared_lock = threading.Lock()


def awake_clock() -> AwakeClock:
    """The process's clock (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = AwakeClock().start()
        return _shared
