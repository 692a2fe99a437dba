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


class _Direction:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.all = BusyClock(clock)
        self.bytes = 0
        self.partners: OrderedDict[str, list] = OrderedDict()  # partner -> [BusyClock, bytes]

    def partner(self, name: str) -> list | None:
        entry = self.partners.get(name)
        if entry is None:
            if len(self.partners) >= MAX_PARTNERS and not self._make_room():
                return None
            entry = self.partners[name] = [BusyClock(self.clock), 0]
        self.partners.move_to_end(name)
        return entry

    def _make_room(self) -> bool:
        for name, (busy, _) in self.partners.items():
            if not busy.active:
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
                entry[0].start()

    def stopped(self, direction: str, partner: str, num_bytes: int, ended_s: float | None = None) -> None:
        """The transfer ended (at `ended_s` on this meter's clock, if earlier than now); `num_bytes` it
        delivered (0 when it failed)."""
        with self._lock:
            d = self._directions[direction]
            d.all.stop(ended_s)
            d.bytes += num_bytes
            entry = d.partners.get(partner)
            if entry is not None:
                entry[0].stop(ended_s)
                entry[1] += num_bytes

    def totals(self, direction: str) -> DirectionTotals:
        with self._lock:
            d = self._directions[direction]
            partners = {name: (entry[1], entry[0].busy_s()) for name, entry in d.partners.items()}
            return DirectionTotals(d.bytes, d.all.busy_s(), partners)
