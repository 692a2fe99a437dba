"""What a server announces as its throughput: samples per CPU second of work, its idle baseline left out.

The balancer compares stages' capacities (the sum of their servers' announcements), so the figure must
say what a server could serve when busy, whatever its load now. Samples per CPU second of the whole
process tree (compute, serialization, p2pd, DHT) is close to that for a busy server, but an idle
server still burns CPU: ~0.067 CPU seconds per second for a `tiny` server here (DHT upkeep,
announcements, p2pd), 27% of a 0.25-CPU quota. Counted as work, that overhead made the lightly loaded
replicas of a well-served stage look slow, so that stage's capacity read low and the balancer did not
move a server from it to the real bottleneck (bench/rebalance_live.py). The baseline is measured in
the windows where the server computed nothing and subtracted from the busy ones.

The estimate is the ratio of sums over the last `BUSY_WINDOWS` busy windows, not an EMA: from a start-up
figure off by 10x (a compute-only timing at a CPU quota beside four other starting servers read 33 to 506
samples/s for identical stage-0 servers), an EMA of weight 0.3 took about 25 windows (50 s) to settle, and
the balancer's plan changed under it while it did (bench/rebalance_live.py). Windows weigh by their
samples, so a window with a couple of samples cannot swing it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

BUSY_WINDOWS = 8  # busy announce windows in the estimate (16 s at the default 2 s period)
IDLE_EMA = 0.5  # weight of the newest idle window in the baseline
MIN_WORK_SHARE = 0.3  # never count less than this share of a busy window's CPU as work


@dataclass
class CapacityMeter:
    """Fed (wall clock, process-tree CPU seconds, samples computed) at every announcement."""

    samples_per_cpu_s: float  # the start: a compute-only measurement, refined while serving
    idle_cpu_per_s: float | None = None  # the baseline, once a window without work was seen
    _mark: tuple[float, float, int] | None = None
    _busy: deque = field(default_factory=lambda: deque(maxlen=BUSY_WINDOWS))  # (samples, work CPU s)

    def restart(self, wall_s: float, cpu_s: float, samples: int) -> None:
        """Count from here (start-up work is neither idle nor serving)."""
        self._mark = (wall_s, cpu_s, samples)

    def update(self, wall_s: float, cpu_s: float, samples: int) -> float:
        if self._mark is None:
            self.restart(wall_s, cpu_s, samples)
            return self.samples_per_cpu_s
        then_wall_s, then_cpu_s, then_samples = self._mark
        d_wall, d_cpu, d_samples = wall_s - then_wall_s, cpu_s - then_cpu_s, samples - then_samples
        if d_wall <= 0 or d_cpu < 0:
            return self.samples_per_cpu_s
        if d_samples == 0:
            rate = d_cpu / d_wall
            old = self.idle_cpu_per_s
            self.idle_cpu_per_s = rate if old is None else (1 - IDLE_EMA) * old + IDLE_EMA * rate
        elif d_cpu > 0:
            work_cpu_s = max(d_cpu - (self.idle_cpu_per_s or 0.0) * d_wall, MIN_WORK_SHARE * d_cpu)
            self._busy.append((d_samples, work_cpu_s))
            self.samples_per_cpu_s = sum(n for n, _ in self._busy) / sum(w for _, w in self._busy)
        else:
            return self.samples_per_cpu_s  # samples but no CPU tick yet: wait for the next window
        self._mark = (wall_s, cpu_s, samples)
        return self.samples_per_cpu_s
