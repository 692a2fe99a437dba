"""Running totals of what a process's links carried, per direction: bytes, and busy seconds (the time
during which at least one transfer in that direction was under way: the union of the transfers'
intervals), in all and per partner. The data plane feeds it (net/data_plane.py: a download lasts from
a frame's header to its last byte's arrival, an upload from its first write until the peer's TCP has
acknowledged every byte); a server turns windows of it into link capacity (runtime/server/capacity.py;
planner/link_capacity.py says why these figures).

Ends are taken from the kernel where it tells them (Linux's TCP_INFO: milliseconds since the last data
segment came, or the last acknowledgement): on a machine whose event loops wait for the CPU, the
moment a process notices the end is late by that wait, and a link timed by it would read slower than
it is. The start is when the process wrote the first byte or noticed the header, so a late reader
makes a download look shorter, never longer: a wait for the CPU does not pass for a slow link.

Only frames of at least `METERED_MIN_BYTES` are timed: a small frame's time is the path's latency, not
its rate, and acknowledgements queue behind bulk data on the same uplink.

Calls over libp2p (net/transport.py) add evidence per partner, not to the union (`call`). They matter
for attribution: a transfer is as slow as the slower of the sender's uplink and the receiver's
downlink, and a stage-0 server whose every data-plane partner is a stage-1 server behind a slow link
cannot tell from those transfers alone whose link is slow. Its gradient exchange with its own stage's
replicas (libp2p) shows its own link's speed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

UP, DOWN = "up", "down"
METERED_MIN_BYTES = 16 << 10
MAX_PARTNERS = 256  # partners tracked one by one (the least recently active inactive one makes room)


class BusyClock:
    """Seconds during which at least one of the intervals started and not yet stopped was open. An
    interval may end earlier than its `stop` call (`ended_s`: when the kernel saw its last byte, which
    a busy event loop learns late); a spell of overlapping intervals ends at the latest of their ends."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open = 0
        self._since_s = 0.0
        self._until_s = 0.0  # the latest end of the spell's intervals stopped so far
        self._busy_s = 0.0

    @property
    def active(self) -> bool:
        return self._open > 0

    def start(self) -> None:
        if self._open == 0:
            self._since_s = self._until_s = self._clock()
        self._open += 1

    def stop(self, ended_s: float | None = None) -> None:
        if self._open == 0:
            return  # nothing open (a caller's bug would otherwise make the clock run backwards)
        now_s = self._clock()
        self._until_s = max(self._until_s, now_s if ended_s is None else min(ended_s, now_s))
        self._open -= 1
        if self._open == 0:
            self._busy_s += self._until_s - self._since_s

    def busy_s(self) -> float:
        return self._busy_s + (self._clock() - self._since_s if self._open else 0.0)


@dataclass(frozen=True)
class DirectionTotals:
    """Running totals of one direction: (bytes, busy seconds), in all and per partner."""

    bytes: int
    busy_s: float
    partners: dict[str, tuple[int, float]]


class _Partner:
    """What one partner's transfers in a direction carried: the data plane's, timed as a union (`busy`),
    and calls timed whole (`call_s`, `LinkMeter.call`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.busy = BusyClock(clock)
        self.bytes = 0
        self.call_s = 0.0

    def busy_s(self) -> float:
        return self.busy.busy_s() + self.call_s


class _Direction:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.all = BusyClock(clock)
        self.bytes = 0
        self.partners: OrderedDict[str, _Partner] = OrderedDict()

    def partner(self, name: str) -> _Partner | None:
        entry = self.partners.get(name)
        if entry is None:
            if len(self.partners) >= MAX_PARTNERS and not self._make_room():
                return None
            entry = self.partners[name] = _Partner(self.clock)
        self.partners.move_to_end(name)
        return entry

    def _make_room(self) -> bool:
        for name, entry in self.partners.items():
            if not entry.busy.active:
                del self.partners[name]
                return True
        return False


class LinkMeter:
    """Thread-safe; `started` and `stopped` pair up per transfer (or per busy spell of one connection)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._directions = {UP: _Direction(clock), DOWN: _Direction(clock)}

    def started(self, direction: str, partner: str) -> None:
        with self._lock:
            d = self._directions[direction]
            d.all.start()
            entry = d.partner(partner)
            if entry is not None:
                entry.busy.start()

    def stopped(self, direction: str, partner: str, num_bytes: int, ended_s: float | None = None) -> None:
        """The transfer ended (at `ended_s` on this meter's clock, if earlier than now); `num_bytes` it
        delivered (0 when it failed)."""
        with self._lock:
            d = self._directions[direction]
            d.all.stop(ended_s)
            d.bytes += num_bytes
            entry = d.partners.get(partner)
            if entry is not None:
                entry.busy.stop(ended_s)
                entry.bytes += num_bytes

    def call(self, direction: str, partner: str, num_bytes: int, seconds: float) -> None:
        """A transfer timed whole by a call (libp2p: an upload until the receiver says it has all of
        it, a download from its first chunk to its last): evidence of the partner's rate only. Such a
        time may hold more than the transfer (opening a stream, a busy event loop), which makes the
        evidence weaker, never wrong; kept out of the union, where it could hide a saturated link."""
        if num_bytes < METERED_MIN_BYTES or seconds <= 0:
            return
        with self._lock:
            entry = self._directions[direction].partner(partner)
            if entry is not None:
                entry.bytes += num_bytes
                entry.call_s += seconds

    def totals(self, direction: str) -> DirectionTotals:
        with self._lock:
            d = self._directions[direction]
            partners = {name: (entry.bytes, entry.busy_s()) for name, entry in d.partners.items()}
            return DirectionTotals(d.bytes, d.all.busy_s(), partners)
