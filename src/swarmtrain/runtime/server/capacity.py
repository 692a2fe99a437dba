"""What a server announces as its throughput: samples per second of the work each sample costs on its
compute device (CPU seconds on a CPU).

The balancer sums its stages' announcements into capacities and plans moves on them, so the figure must
say what a server could serve, whatever its share of the traffic now: a figure that depends on the share
is not additive, and a plan built on it stops short. Timed as the CPU of the whole process tree less an
idle baseline, it was share-dependent: a stage-0 replica serving a quarter of the traffic read ~430
samples per CPU second and a busy one ~650-890 (bench/rebalance_live.py, 0.25 CPU each), because every
replica also pays work that does not come with its samples (p2pd and hivemind's processes, ~0.08 CPU s/s
at any load; the gradient exchange and bookkeeping of every step, ~35 ms of CPU per step; DHT upkeep).
Left in, that work is a small difference of two similar numbers at a light share; the plan from 4+1
moved one or two servers and the rest came a minute later, one at a time.

So the figure counts only the CPU that comes with samples, measured where it is exact: the compute
thread's CPU on forward and backward jobs (thread time per job, runtime/server/compute.py) and the
transport's (de)serialization of those requests (net/transport.py). Both are the same per sample at any
share (stage 0: 0.7-0.9 ms compute at 8 and at 50 samples/s). What every replica pays whatever its share
is left out, so a plan slightly overrates what one more replica adds: with 4 replicas the per-step work
was ~6% of a 0.25-CPU server's usable CPU here, inside the policy's 10% hysteresis margin. On a GPU the
compute thread's CPU is not its work (kernels run asynchronously on the device), so the compute thread
reads the device's busy time instead (`model.device.busy_clock_s`: wall time after synchronizing the
compute thread's current stream only, so a reply's encoding and its copy to the host, which run on a side
stream while the next job computes, are not counted; never run here, no GPU). With request batching on (`--max-batch-tokens`), a call of several micro-batches
costs less per sample than one alone, so the figure then rises with the load that queues together.

Samples count once their backward ran here, after the job's CPU was counted (runtime/server/compute.py),
so a window never holds samples without their CPU. The estimate is the ratio of sums over the last `BUSY_WINDOWS` windows with samples, not an EMA: from a
start-up figure far off, an EMA of weight 0.3 took about 25 windows (50 s) to settle, and the balancer's
plan changed under it. Windows weigh by their samples, so one with a couple of samples cannot swing it.

A server's links may limit it before its compute does. `LinkCapacityMeter` reads, over the same
windows, what each direction of the data plane's links carried and how long it was busy
(net/link_meter.py), and planner/link_capacity.py turns that into samples per second per direction and
the server's figure, min(compute, uplink, downlink), with the resource that limits it. Calls over
libp2p (the gradient exchange, relayed hand-offs) add evidence of a direction's rate per partner, but
the bytes per sample are the data plane's only: a server without data-plane traffic reads its links as
limiting nothing and announces its compute figure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from swarmtrain.planner.link_capacity import Transfers, link_rate_bytes_per_s, link_samples_per_s

BUSY_WINDOWS = 8  # announce windows with samples in the estimate (16 s at the default 2 s period)


@dataclass
class CapacityMeter:
    """Fed the running totals (samples computed, CPU seconds of their work) at every announcement."""

    samples_per_work_s: float  # the start: a compute-only measurement, replaced once samples come
    # the start figure stands until the windows hold this many samples: the first window of a moved
    # server, a few micro-batches, read 5,556 samples per CPU second for a 190 one (bench/rebalance_live.py)
    min_samples: int = 0
    # samples served before measuring: a fresh stage's first micro-batches cost several times the CPU of
    # later ones (cold caches and allocator, TorchScript's profiling runs), and figures read in the first
    # seconds of traffic swung from 380 to 1,100 for one stage-0 server, so a plan's third move was
    # withdrawn and made 10 s later (bench/rebalance_live.py)
    warmup_samples: int = 0
    _warm: bool = False
    _mark: tuple[int, float] | None = None
    _busy: deque = field(default_factory=lambda: deque(maxlen=BUSY_WINDOWS))  # (samples, work CPU s)

    def __post_init__(self) -> None:
        self._warm = self.warmup_samples <= 0

    def restart(self, samples: int, work_s: float) -> None:
        """Count from here (start-up work is not serving)."""
        self._mark = (samples, work_s)

    def update(self, samples: int, work_s: float) -> float:
        if self._mark is None:
            self.restart(samples, work_s)
            return self.samples_per_work_s
        d_samples, d_work_s = samples - self._mark[0], work_s - self._mark[1]
        if not self._warm:
            if d_samples >= self.warmup_samples:
                self._warm = True
                self._mark = (samples, work_s)
            return self.samples_per_work_s
        if d_samples <= 0 or d_work_s <= 0:
            return self.samples_per_work_s  # nothing served (or a job still running): the figure stands
        self._busy.append((d_samples, d_work_s))
        self._mark = (samples, work_s)
        total_samples = sum(n for n, _ in self._busy)
        if total_samples >= self.min_samples:
            self.samples_per_work_s = total_samples / sum(w for _, w in self._busy)
        return self.samples_per_work_s


@dataclass
class _LinkWindow:
    samples: int
    directions: dict  # direction -> (bytes, busy s, {partner: (bytes, busy s)}), this window's share


@dataclass
class LinkCapacityMeter:
    """Samples per second each direction of the server's links could carry (None: nothing timed yet;
    infinite: timed, but no data-plane byte per sample), from the `LinkMeter` totals read at every
    announcement; the same windows and warm-up as `CapacityMeter`, decided by planner/link_capacity.py.
    """

    min_samples: int = 0
    warmup_samples: int = 0
    uplink_samples_per_s: float | None = None
    downlink_samples_per_s: float | None = None
    _mark: tuple[int, dict] | None = None  # (samples, {direction: DirectionTotals}) at the last reading
    _windows: deque = field(default_factory=lambda: deque(maxlen=BUSY_WINDOWS))

    def update(self, samples: int, totals: dict) -> None:
        """`totals`: {"up": DirectionTotals, "down": DirectionTotals}, running (net/link_meter.py)."""
        if self._mark is None or samples - self._mark[0] < 0:
            self._mark = (samples, totals)
            return
        d_samples = samples - self._mark[0]
        if self.warmup_samples > 0:  # a fresh stage's first transfers start cold: not measured
            if d_samples >= self.warmup_samples:
                self.warmup_samples, self._mark = 0, (samples, totals)
            return
        if d_samples <= 0:
            return  # nothing served since: the figures stand
        window = _LinkWindow(d_samples, {d: _difference(totals[d], self._mark[1][d]) for d in totals})
        self._mark = (samples, totals)
        self._windows.append(window)
        served = sum(w.samples for w in self._windows)
        if served >= self.min_samples:
            self.uplink_samples_per_s = self._samples_per_s("up", served)
            self.downlink_samples_per_s = self._samples_per_s("down", served)

    def _samples_per_s(self, direction: str, served: int) -> float | None:
        total_bytes = sum(w.directions[direction][0] for w in self._windows)
        total_busy_s = sum(w.directions[direction][1] for w in self._windows)
        partners: dict[str, list[float]] = {}
        for w in self._windows:
            for name, (num_bytes, busy_s) in w.directions[direction][2].items():
                entry = partners.setdefault(name, [0.0, 0.0])
                entry[0] += num_bytes
                entry[1] += busy_s
        rate = link_rate_bytes_per_s(
            Transfers(total_bytes, total_busy_s), [Transfers(b, s) for b, s in partners.values()]
        )
        if rate is None:
            return None
        return link_samples_per_s(rate, total_bytes / served)


def _difference(now, before) -> tuple[float, float, dict]:
    """What a direction carried between two readings of its running totals; a partner evicted and seen
    again meanwhile (its totals restarted) counts from zero."""
    partners = {}
    for name, (num_bytes, busy_s) in now.partners.items():
        old_bytes, old_busy_s = before.partners.get(name, (0, 0.0))
        if num_bytes < old_bytes or busy_s < old_busy_s:
            old_bytes, old_busy_s = 0, 0.0
        if num_bytes > old_bytes:
            partners[name] = (num_bytes - old_bytes, busy_s - old_busy_s)
    return now.bytes - before.bytes, now.busy_s - before.busy_s, partners
