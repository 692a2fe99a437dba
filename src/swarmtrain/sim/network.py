"""The link model: every peer's uplink and downlink is a FIFO server of bytes.

A transfer of n bytes from A to B requested at time t:
- occupies A's uplink for n / uplink_A, starting when the uplink is free (after earlier transfers);
- occupies B's downlink for n / downlink_B, likewise;
- cannot beat the per-flow cap of the path between their locations, n / path_bandwidth;
- arrives when all three are done, plus the one-way latency between the locations.
So concurrent transfers share a link by queueing behind each other at the full link rate (a serialized
link), each link's capacity is exact, and a fast sender feeding slow receivers is not held back by them
(its uplink time is its own). The two ends are not synchronized, which is slightly optimistic when both
are congested. Cost: O(1) per transfer, no events for link state. Trainers are endpoints with an
unlimited link by default (they are cheap CPU machines one can place well; `SimConfig.trainer_link_bytes_per_s`
limits it).

Background traffic (gradient averaging with delayed parameter updates) has lower priority: its bytes
are a debt that the link pays off whenever it would otherwise be idle, so it does not delay transfers
on the critical path; but a round must be done before the next round starts, so whatever debt is left
when a new round is added is sent at once, ahead of later transfers. A link that cannot carry its
averaging is therefore slowed down by exactly the missing capacity.
"""

from __future__ import annotations

import math

from swarmtrain.sim.entities import Locations


class Endpoint:
    """Link state of one network endpoint (a peer or a trainer)."""

    __slots__ = (
        "location",
        "up_bytes_per_s",
        "down_bytes_per_s",
        "up_free_s",
        "down_free_s",
        "up_debt",
        "down_debt",
    )

    def __init__(self, location: int, up_bytes_per_s: float, down_bytes_per_s: float) -> None:
        self.location = location
        self.up_bytes_per_s = up_bytes_per_s
        self.down_bytes_per_s = down_bytes_per_s
        self.up_free_s = 0.0
        self.down_free_s = 0.0
        self.up_debt = 0.0  # background bytes still to send
        self.down_debt = 0.0

    def settle(self, now_s: float) -> None:
        """Pay background debt out of the idle time since each direction was last free."""
        if self.up_debt > 0 and self.up_free_s < now_s:
            paid = min(self.up_debt, (now_s - self.up_free_s) * self.up_bytes_per_s)
            self.up_debt -= paid
            self.up_free_s += paid / self.up_bytes_per_s
        if self.down_debt > 0 and self.down_free_s < now_s:
            paid = min(self.down_debt, (now_s - self.down_free_s) * self.down_bytes_per_s)
            self.down_debt -= paid
            self.down_free_s += paid / self.down_bytes_per_s

    def add_background(self, now_s: float, num_bytes: float) -> None:
        """A new averaging round of `num_bytes` each way; the previous round's leftover goes first."""
        self.settle(now_s)
        if self.up_debt > 0:
            self.up_free_s = max(self.up_free_s, now_s) + self.up_debt / self.up_bytes_per_s
        if self.down_debt > 0:
            self.down_free_s = max(self.down_free_s, now_s) + self.down_debt / self.down_bytes_per_s
        self.up_debt = self.down_debt = num_bytes

    def clear(self, now_s: float) -> None:
        """A fresh machine: nothing queued on its links."""
        self.up_free_s = self.down_free_s = now_s
        self.up_debt = self.down_debt = 0.0

    def reserve_both(self, now_s: float, num_bytes: float) -> None:
        """Occupy both directions for `num_bytes` each (an all-reduce round trip)."""
        self.up_free_s = max(self.up_free_s, now_s) + num_bytes / self.up_bytes_per_s
        self.down_free_s = max(self.down_free_s, now_s) + num_bytes / self.down_bytes_per_s

    def link_free_s(self) -> float:
        return max(self.up_free_s, self.down_free_s)


class Network:
    def __init__(self, locations: Locations) -> None:
        self.latency_s = [list(row) for row in locations.latency_s]
        self.path_bytes_per_s = [list(row) for row in locations.bandwidth_bytes_per_s]

    def transfer(
        self, now_s: float, src: Endpoint, dst: Endpoint, num_bytes: float, deadline_s: float = math.inf
    ) -> float | None:
        """Reserve the links for one transfer and return its arrival time.

        If it would arrive more than `deadline_s` from now, nothing is reserved and None is returned: the
        request is given up, and its bytes do not clog the links (without this, retries of timed-out
        requests pile reservations onto congested links and goodput collapses to zero)."""
        if src.up_debt > 0 or dst.down_debt > 0:
            src.settle(now_s)
            dst.settle(now_s)
        up_end = (src.up_free_s if src.up_free_s > now_s else now_s) + num_bytes / src.up_bytes_per_s
        down_end = (dst.down_free_s if dst.down_free_s > now_s else now_s) + num_bytes / dst.down_bytes_per_s
        path_end = now_s + num_bytes / self.path_bytes_per_s[src.location][dst.location]
        end = up_end if up_end > down_end else down_end
        if path_end > end:
            end = path_end
        arrival = end + self.latency_s[src.location][dst.location]
        if arrival - now_s > deadline_s:
            return None
        src.up_free_s = up_end
        dst.down_free_s = down_end
        return arrival

    def latency(self, a: int, b: int) -> float:
        return self.latency_s[a][b]
