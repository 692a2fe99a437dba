"""How the swarm runs as one stage replica sees it: the swarm's samples per second (`StepRate`) and how
busy this replica's own resources are (`Utilization`), both announced for the balancer.

The swarm's samples per second: each step it applies carries the step's
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


UTILIZATION_WINDOWS = 8  # announce windows (16 s at the default 2 s period)


class Utilization:
    """The fraction of wall time each of a server's resources was busy over its last announce windows:
    the compute thread (wall time running jobs, which a CPU quota or a busy machine stretches) and each
    direction of its links (seconds with a transfer under way, net/link_meter.py). The balancer reads
    the figure of the resource that limits a server (planner/rebalance.py): a stage whose limiting
    resources idle much of the time waits on something else, and more capacity there buys little."""

    def __init__(self) -> None:
        self._mark: tuple[float, dict[str, float]] | None = None
        self._windows: deque[tuple[float, dict[str, float]]] = deque(maxlen=UTILIZATION_WINDOWS)

    def update(self, now_s: float, busy_s: dict[str, float]) -> None:
        """`busy_s`: each resource's running busy seconds (resource -> seconds)."""
        if self._mark is not None and now_s > self._mark[0]:
            before = self._mark[1]
            self._windows.append(
                (now_s - self._mark[0], {r: s - before.get(r, s) for r, s in busy_s.items()})
            )
        self._mark = (now_s, dict(busy_s))

    def fraction(self, resource: str) -> float | None:
        """Busy seconds over wall seconds (0 to 1), None before a window."""
        wall_s = sum(w for w, _ in self._windows)
        if wall_s <= 0:
            return None
        busy_s = sum(max(0.0, d.get(resource, 0.0)) for _, d in self._windows)
        return min(1.0, busy_s / wall_s)
