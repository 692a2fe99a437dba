"""The swarm's samples per second as one stage replica sees it: each step it applies carries the step's
samples (the close's count, the same on every stage), and the seconds since the step before say how long
the whole swarm took for them. The replica announces the figure; the balancer compares it with what its
stages' capacities predict (planner/rebalance.py), so it must describe the swarm as it runs now.

The figure is the median of the last `STEP_RATE_WINDOW` steps' rates, not a ratio of sums: one long
gap (a pause between trainers, a resync, a move) would otherwise drag it down for the whole window.
Before `MIN_STEPS` intervals, or once no step came for `IDLE_INTERVALS` x the median interval (and at
least `IDLE_FLOOR_S`), it is 0: not known, and the balancer plans on capacities alone as before.
"""

from __future__ import annotations

import statistics
from collections import deque

STEP_RATE_WINDOW = 8
MIN_STEPS = 3
IDLE_INTERVALS = 4.0
IDLE_FLOOR_S = 30.0


class StepRate:
    def __init__(self) -> None:
        self._last_s: float | None = None
        self._steps: deque[tuple[float, float]] = deque(maxlen=STEP_RATE_WINDOW)  # (samples/s, interval s)

    def applied(self, samples: int, now_s: float) -> None:
        """A step of `samples` (the whole swarm's) was applied here at `now_s` (monotonic)."""
        if self._last_s is not None and now_s > self._last_s and samples > 0:
            interval_s = now_s - self._last_s
            self._steps.append((samples / interval_s, interval_s))
        self._last_s = now_s

    def samples_per_s(self, now_s: float) -> float:
        """The median rate of the recent steps; 0 when too few or when the swarm went idle."""
        if len(self._steps) < MIN_STEPS or self._last_s is None:
            return 0.0
        idle_after_s = max(IDLE_FLOOR_S, IDLE_INTERVALS * statistics.median(s for _, s in self._steps))
        if now_s - self._last_s > idle_after_s:
            return 0.0
        return statistics.median(rate for rate, _ in self._steps)
