"""Stochastic wiring: interleaved weighted round-robin (IWRR) over measured peer throughput.

One `StageRouter` per (trainer, stage). Each peer has a *virtual finish time*: the sum of the expected
durations of the work dispatched to it. `choose` picks the peer with the smallest virtual finish time and
charges the expected duration at dispatch, so concurrent micro-batches spread out over peers in
proportion to their throughput. Throughput is an exponential moving average of samples/s observed
end-to-end by this trainer, so a peer that is far away on the network counts as slow.

Time is passed in by the caller (wall clock in the runtime, virtual clock in the simulator).
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

PeerId = Hashable

FORWARD_WEIGHT = 1.0
BACKWARD_WEIGHT = 2.0  # backward costs ~2x forward (docs/DESIGN.md section 5)
# A forward on a stage that is not the last commits its peer to the micro-batch's backward as well
# (the peer keeps the activations), so choosing it charges both, and the backward sent back to it is
# charged nothing. Charging the backward only when it was sent made a step's forwards, sent together,
# all go to the replica whose backward charges had not come in yet: on `tiny` with 2 replicas of stage
# 0, 96 of 128 synchronous steps ran entirely on one replica while the other idled.
FORWARD_CHARGE = FORWARD_WEIGHT + BACKWARD_WEIGHT


@dataclass
class PeerState:
    throughput_samples_per_s: float  # observed end to end (EMA), in weighted samples per second
    virtual_finish_s: float
    banned_until_s: float = float("-inf")
    # what the peer says it can serve, in the same units (`set_capacity`): its observed figure may
    # leave out what limits it (a hop's report times the peer's own work, not the link the activations
    # crossed to reach it), so dispatch never assumes more than this
    capacity_samples_per_s: float = float("inf")

    def rate(self) -> float:
        return min(self.throughput_samples_per_s, self.capacity_samples_per_s)


class StageRouter:
    """IWRR over the peers of one stage. Deterministic: ties break by insertion order."""

    def __init__(self, ema_alpha: float = 0.2, default_throughput_samples_per_s: float = 1.0) -> None:
        if not 0 < ema_alpha <= 1:
            raise ValueError("ema_alpha must be in (0, 1]")
        if default_throughput_samples_per_s <= 0:
            raise ValueError("default throughput must be positive")
        self.ema_alpha = ema_alpha
        self.default_throughput_samples_per_s = default_throughput_samples_per_s
        self._peers: dict[PeerId, PeerState] = {}
        self._heap: list[tuple[float, int, PeerId]] = []
        self._order = itertools.count()

    # membership ---------------------------------------------------------------------------------
    def add_peer(self, peer: PeerId, throughput_samples_per_s: float | None = None) -> None:
        """Add a peer (no-op if present). It enters at the current minimum virtual finish time, so it
        neither floods with work (entering at 0) nor waits behind everyone (entering at the max)."""
        if peer in self._peers:
            if throughput_samples_per_s is not None and throughput_samples_per_s > 0:
                self._peers[peer].throughput_samples_per_s = throughput_samples_per_s
            return
        start_s = self._min_finish_s()
        tput = throughput_samples_per_s if throughput_samples_per_s and throughput_samples_per_s > 0 else None
        self._peers[peer] = PeerState(tput or self._typical_throughput(), start_s)
        self._push(peer)

    def set_capacity(self, peer: PeerId, samples_per_s: float) -> None:
        """The peer's announced capacity, in samples/s of whole forward and backward work (charged
        `FORWARD_CHARGE` each); ignored unless positive."""
        if peer in self._peers and samples_per_s > 0:
            self._peers[peer].capacity_samples_per_s = samples_per_s * FORWARD_CHARGE

    def remove_peer(self, peer: PeerId) -> None:
        self._peers.pop(peer, None)  # stale heap entries are skipped lazily

    @property
    def peers(self) -> list[PeerId]:
        return list(self._peers)

    def throughput(self, peer: PeerId) -> float:
        return self._peers[peer].throughput_samples_per_s

    def virtual_finish_s(self, peer: PeerId) -> float:
        return self._peers[peer].virtual_finish_s

    # bans ---------------------------------------------------------------------------------------
    def ban(self, peer: PeerId, until_s: float) -> None:
        if peer in self._peers:
            self._peers[peer].banned_until_s = max(self._peers[peer].banned_until_s, until_s)

    def unban(self, peer: PeerId) -> None:
        if peer in self._peers:
            self._peers[peer].banned_until_s = float("-inf")

    def is_banned(self, peer: PeerId, now_s: float) -> bool:
        return peer in self._peers and self._peers[peer].banned_until_s > now_s

    def available(self, now_s: float) -> list[PeerId]:
        return [p for p, s in self._peers.items() if s.banned_until_s <= now_s]

    # dispatch -----------------------------------------------------------------------------------
    def choose(
        self,
        now_s: float,
        num_samples: float = 1.0,
        weight: float = FORWARD_WEIGHT,
        exclude: Iterable[PeerId] = (),
    ) -> PeerId | None:
        """Pick the peer with the least virtual finish time; charge it the expected duration.

        Returns None when every peer is banned or excluded (the caller waits and logs)."""
        excluded = set(exclude)
        skipped: list[tuple[float, int, PeerId]] = []
        chosen = None
        while self._heap:
            key, order, peer = heapq.heappop(self._heap)
            state = self._peers.get(peer)
            if state is None or key != state.virtual_finish_s:
                continue  # stale entry: peer removed or re-keyed
            if peer in excluded or state.banned_until_s > now_s:
                skipped.append((key, order, peer))
                continue
            chosen = peer
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            return None
        state = self._peers[chosen]
        state.virtual_finish_s += weight * num_samples / state.rate()
        self._push(chosen)
        return chosen

    def report(
        self, peer: PeerId, num_samples: float, duration_s: float, weight: float = FORWARD_WEIGHT
    ) -> None:
        """Fold an observed end-to-end duration into the peer's throughput EMA."""
        state = self._peers.get(peer)
        if state is None or duration_s <= 0 or num_samples <= 0:
            return
        observed = weight * num_samples / duration_s
        a = self.ema_alpha
        state.throughput_samples_per_s = (1 - a) * state.throughput_samples_per_s + a * observed

    # internals ----------------------------------------------------------------------------------
    def _push(self, peer: PeerId) -> None:
        heapq.heappush(self._heap, (self._peers[peer].virtual_finish_s, next(self._order), peer))

    def _min_finish_s(self) -> float:
        return min((s.virtual_finish_s for s in self._peers.values()), default=0.0)

    def _typical_throughput(self) -> float:
        if not self._peers:
            return self.default_throughput_samples_per_s
        values = sorted(s.throughput_samples_per_s for s in self._peers.values())
        return values[len(values) // 2]


def direct_from(direct: Sequence[bool]) -> int:
    """Where a route's direct hand-offs can start, given for each boundary (stage k to k+1) whether its
    two peers can hand off directly (`can_hand_off`): the stage after the last boundary that cannot, 0
    when all can. The trainer relays the stages before it, as with `--hand-off relay`."""
    first = 0
    for boundary, ok in enumerate(direct):
        if not ok:
            first = boundary + 1
    return first


def can_hand_off(behind_nat: tuple[bool, bool], ips: tuple[Sequence[str], Sequence[str]]) -> bool:
    """Can two peers of neighbouring stages hand off directly? Yes when one of them is public (the one
    behind a NAT dials out: runtime/server/chain_hop.py). Two peers behind NATs cannot dial each other
    (a circuit relay carries too little for activations: docs/LOG.md), unless they share a LAN: taken
    to be so when both announce an IP in the same private /24 (a guess: two homes on the same
    192.168.1.0/24 look alike, and their hop then fails and is retried as before). `ips`: the IPs of
    each peer's announced (not relayed) addresses."""
    if not all(behind_nat):
        return True
    return bool(_private_lans(ips[0]) & _private_lans(ips[1]))


def _private_lans(ips: Sequence[str]) -> set[ipaddress.IPv4Network]:
    """The /24 networks of the private IPv4 addresses among `ips` (loopback, IPv6 and malformed ones
    tell nothing about a LAN)."""
    lans = set()
    for text in ips:
        try:
            ip = ipaddress.IPv4Address(text)
        except ValueError:
            continue
        if ip.is_private and not ip.is_loopback:
            lans.add(ipaddress.IPv4Network(f"{ip}/24", strict=False))
    return lans
